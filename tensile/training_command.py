"""A training command as it runs on this machine, for `tensile run` and `tensile local` alike.

Apart from the TrainingJob files' reader (`tensile.local.jobs`) so that `tensile run` needs none of what reading
them takes (jsonschema): it runs in the training's environment, a GPU image that may lack it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def local_command(command: list[str]) -> tuple[list[str], str | None]:
    """The container command as it runs here (from the current directory): `python` is this Python
    (the one with Tensile), and so is torchrun's (it starts its workers with its own Python); a program or script
    that does not exist here is a problem, not a crash."""
    program, *rest = command
    if Path(program).name == "torchrun":
        program, rest = "python", ["-m", "torch.distributed.run", *rest]
    if Path(program).name in ("python", "python3"):
        program = sys.executable
        script = next((a for a in rest if not a.startswith("-")), None)
        if script is not None and script.endswith(".py") and not Path(script).exists():
            return [program, *rest], f"cannot run locally: {script} does not exist here (the command runs from {Path.cwd()})"
    elif shutil.which(program) is None:
        return command, f"cannot run locally: no program '{program}' here"
    return [program, *rest], None
