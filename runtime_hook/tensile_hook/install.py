"""Copy the runtime hook into a directory, for a training image that lacks Tensile.

`python -m tensile_hook.install DEST` (the operator's init container) or `tensile
install-hook DEST`: DEST/lib holds the core `tensile` package (no local mode, no CLI) and `tensile_hook`
(no operator, no agent) and DEST/site the sitecustomize that switches the hook on; the training container's
PYTHONPATH starts with DEST/site:DEST/lib. The hook needs torch and numpy, which a PyTorch image has.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import tensile
import tensile_hook

SKIP = {"local", "commands", "cli.py", "__pycache__"}  # the core's upper layers: the hook needs none of them


def install(dest: str | Path) -> Path:
    dest = Path(dest)
    lib = dest / "lib" / "tensile"
    hook_lib = dest / "lib" / "tensile_hook"
    for old in (lib, hook_lib):
        if old.exists():
            shutil.rmtree(old)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    core = Path(tensile.__file__).parent
    lib.mkdir(parents=True)
    for item in core.iterdir():
        if item.name in SKIP:
            continue
        if item.is_dir():
            shutil.copytree(item, lib / item.name, ignore=ignore)
        elif item.suffix == ".py":
            shutil.copy2(item, lib / item.name)
    hook = Path(tensile_hook.__file__).parent
    shutil.copytree(hook, hook_lib, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "site"))
    (dest / "site").mkdir(parents=True, exist_ok=True)
    shutil.copy2(hook / "site" / "sitecustomize.py", dest / "site" / "sitecustomize.py")
    return dest


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tensile_hook.install DEST", file=sys.stderr)
        return 2
    install(args[0])
    print(f"tensile hook installed in {args[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
