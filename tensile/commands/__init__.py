"""The `tensile` sub-commands (one module each, see tensile/cli.py) and the checks they share."""

from __future__ import annotations

import os
from pathlib import Path

from tensile.errors import TensileUserError

# exit statuses every command shares (docs/cli.md): 2 is bad input (tensile.console.print_user_error)
CANNOT_FIT = 3  # the plan cannot bring the job(s) within the memory budget: output printed, nothing wrong with the input
PLAN_EXIT_STATUSES = "exit status: 0 the plan fits, 2 bad input (the message names it), 3 the plan cannot fit the budget"


def output_folder(path: str | Path, option: str) -> Path:
    """A folder to write into, created now: a bad one is named before any work, not met as a traceback
    after the jobs have run."""
    return _make_folder(Path(path), option, path)


def output_file(path: str | Path, option: str) -> Path:
    """A file to write, its folder created now as --plot always did (so every output option behaves alike)."""
    file = Path(path)
    if file.is_dir():
        raise TensileUserError(f"{option} {path}: is a folder; give a file name in it")
    _make_folder(file.parent, option, path)
    return file


def _make_folder(folder: Path, option: str, given: str | Path) -> Path:
    if folder.exists() and not folder.is_dir():
        wanted = "a folder" if folder == Path(given) else "a path in a folder"
        raise TensileUserError(f"{option} {given}: {folder} is a file, not a folder; give {wanted} (missing folders are created)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TensileUserError(f"{option} {given}: cannot create the folder {folder} ({exc.strerror}); "
                               "give a path in a folder you can write") from None
    if not os.access(folder, os.W_OK):
        raise TensileUserError(f"{option} {given}: the folder {folder} is not writable; give a path in a folder you can write")
    return folder
