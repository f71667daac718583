"""Put on PYTHONPATH by `tensile run` and the operator: switches the Tensile hook on when TENSILE_JOB is set.

It must never stop the user's program from starting: any failure is reported and training runs
without Tensile.
"""

import os
import sys


def _started_by_multiprocessing() -> bool:
    """A process that multiprocessing spawns (a DataLoader's workers under spawn or forkserver, its resource
    tracker, a forkserver) runs a piece of its parent's program, not a training of its own: with the hook it
    wrote over the job's report and would register with the node agent as the job."""
    argv = getattr(sys, "orig_argv", [])
    return "--multiprocessing-fork" in argv or any(arg.startswith("from multiprocessing.") for arg in argv)


if os.environ.get("TENSILE_JOB") and not _started_by_multiprocessing():
    try:
        from tensile.runtime_hook import activate_from_env

        activate_from_env()
    except Exception as exc:  # noqa: BLE001 - the user's training must start regardless
        print(f"tensile: hook not active ({type(exc).__name__}: {exc}); training runs without Tensile", file=sys.stderr)
