"""Put on PYTHONPATH by `tensile run` and the operator: switches the Tensile hook on when TENSILE_JOB is set.

It must never stop the user's program from starting: any failure is reported and training runs
without Tensile.
"""

import os
import sys
from typing import Any

# launchers, which start the training as processes of their own and train nothing themselves, by the module that is
# one (`python -m torch.distributed.run`) or by their script's name: torchrun, Hugging Face's accelerate (`accelerate
# launch`), DeepSpeed's
LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch",
                    "accelerate.commands.accelerate_cli", "deepspeed.launcher.runner", "deepspeed.launcher.launch")
LAUNCHER_SCRIPTS = ("torchrun", "accelerate", "accelerate-launch", "deepspeed")
# PyTorch's own helper processes, which it starts with the job's environment: torch.compile's compile workers
# (`python .../torch/_inductor/compile_worker/__main__.py`) compile kernels for the job and train nothing
HELPER_MODULES = ("torch._inductor.compile_worker",)
OPTIONS_WITH_A_VALUE = ("-W", "-X")  # Python's own options that take the next argument


def _started_by_multiprocessing() -> bool:
    """A process that multiprocessing spawns (a DataLoader's workers under spawn or forkserver, its resource
    tracker, a forkserver) runs a piece of its parent's program, not a training of its own: with the hook it
    wrote over the job's report and would register with the node agent as the job."""
    argv = getattr(sys, "orig_argv", [])
    return "--multiprocessing-fork" in argv or any(arg.startswith("from multiprocessing.") for arg in argv)


def _program() -> tuple[str, str]:
    """What this Python runs, from its command line: ("module", name) for `-m name`, ("script", path), or ("code", "")
    for `-c` and an interactive Python."""
    argv = getattr(sys, "orig_argv", [])[1:]
    skip = False
    for index, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg == "-m":
            return ("module", argv[index + 1]) if index + 1 < len(argv) else ("code", "")
        elif arg.startswith("-m"):
            return "module", arg[2:]
        elif arg == "-c":
            return "code", ""
        elif arg in OPTIONS_WITH_A_VALUE:
            skip = True
        elif not arg.startswith("-"):
            return "script", arg
    return "code", ""


def _launcher() -> bool:
    """A launcher (torchrun, `accelerate launch`) starts the training's processes and trains nothing itself: with the
    hook, its report ("no optimizer step was seen") replaced the training's at exit, and on a GPU the hook's movers
    and the cap gave it a CUDA context of its own beside the training's."""
    kind, name = _program()
    return name in LAUNCHER_MODULES if kind == "module" else kind == "script" and os.path.basename(name) in LAUNCHER_SCRIPTS


def _pytorch_helper() -> bool:
    """A helper process PyTorch starts for the job (HELPER_MODULES, by module or by its package's __main__.py) trains
    nothing: with the hook its movers' CUDA streams gave it a CUDA context of its own on the job's GPU, beside the one
    the job was admitted with, for as long as the job ran, and the cap would have made one too."""
    kind, name = _program()
    if kind == "script" and os.path.basename(name) == "__main__.py":
        kind, name = "module", ".".join(os.path.normpath(os.path.dirname(name)).split(os.sep))
    return kind == "module" and any(name == helper or name.endswith("." + helper) or name.startswith(helper + ".")
                                    for helper in HELPER_MODULES)


def _processes() -> int:
    """The job's processes as torchrun (or a launcher like it) numbers them: 1 where none does."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _cap_memory() -> Any:
    """The process's CUDA memory capped at its admitted size (TENSILE_MEMORY_CAP; tensile_hook.memory_cap), before
    and whatever the hook then does: None where no cap is set (none given, no CUDA, or setting it failed)."""
    if not os.environ.get("TENSILE_MEMORY_CAP"):
        return None
    try:
        import torch

        from tensile_hook.memory_cap import cap_memory

        cap = cap_memory(torch.cuda, os.environ)
        if cap is not None and cap.note:
            print(f"tensile: {cap.note}", file=sys.stderr)
        return cap
    except Exception as exc:  # noqa: BLE001 - the user's training must start regardless
        print(f"tensile: CUDA memory not capped ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None


def _stood_down(reason: str, cap: Any) -> None:
    """The hook is off from the start, under a cap: the cap is said, and the job's report (TENSILE_REPORT) says both,
    so that `tensile run`, `tensile local` and the user find what held the job. Without a cap nothing is written: no
    report, as before the cap (the processes of a job of several would share it)."""
    if cap is None:
        return
    try:
        from tensile_hook.memory_cap import cap_text
        from tensile_hook.report import write_stood_down

        print(f"tensile: {cap_text(cap)}, the hook being off", file=sys.stderr)
        if os.environ.get("TENSILE_REPORT"):
            write_stood_down(os.environ["TENSILE_REPORT"], os.environ["TENSILE_JOB"], reason, cap)
    except Exception as exc:  # noqa: BLE001
        print(f"tensile: the hook's report not written ({type(exc).__name__}: {exc})", file=sys.stderr)


if os.environ.get("TENSILE_JOB") and not _started_by_multiprocessing() and not _launcher() and not _pytorch_helper():
    cap = _cap_memory()
    processes = _processes()
    if processes > 1:
        # each process has its GPU's memory to plan, and they would share the job's report and agent registration
        if os.environ.get("RANK", "0") == "0":
            print(f"tensile: hook not active: a job of {processes} processes (WORLD_SIZE) is not carried; Tensile "
                  "plans a job of one process on one GPU, so training runs without Tensile", file=sys.stderr)
            _stood_down(f"a job of {processes} processes (WORLD_SIZE) is not carried", cap)
    else:
        try:
            from tensile_hook import activate_from_env

            activate_from_env(cap)
        except Exception as exc:  # noqa: BLE001 - the user's training must start regardless
            print(f"tensile: hook not active ({type(exc).__name__}: {exc}); training runs without Tensile",
                  file=sys.stderr)
            _stood_down(f"{type(exc).__name__}: {exc}", cap)
