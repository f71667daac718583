"""Put on PYTHONPATH by `tensile run` and the operator: switches the Tensile hook on when TENSILE_JOB is set.

It must never stop the user's program from starting: any failure is reported and training runs
without Tensile.
"""

import os
import sys

if os.environ.get("TENSILE_JOB"):
    try:
        from tensile.runtime_hook import activate_from_env

        activate_from_env()
    except Exception as exc:  # noqa: BLE001 - the user's training must start regardless
        print(f"tensile: hook not active ({type(exc).__name__}: {exc}); training runs without Tensile", file=sys.stderr)
