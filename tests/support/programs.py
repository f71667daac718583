"""Programs on PATH that are not this Python's: what `tensile run` must not take for the Python it runs."""

from __future__ import annotations

import os
from pathlib import Path


def path_with_another(name: str, folder: Path) -> str:
    """PATH with a program `name` first that is not this Python's (it exits 7), written in `folder`."""
    other = folder / name
    other.parent.mkdir(exist_ok=True)
    other.write_text("#!/bin/sh\nexit 7\n")
    other.chmod(0o755)
    return f"{other.parent}{os.pathsep}{os.environ['PATH']}"
