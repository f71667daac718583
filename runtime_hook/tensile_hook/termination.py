"""SIGTERM ends a hooked training as SystemExit, so that the hook's exit handlers run: the last report, the node
agent's unregistering. SIGTERM's default (a pod's termination, `kill`, `tensile run` passing it on or dying) ended
the process at once: the report stopped at its last periodic write, and the agent held the job until it expired.

Python runs a signal's handler between any two bytecodes of the main thread, inside a weakref callback too (the
storage registry's run hundreds of times an iteration) or a `__del__`, where an exception is printed and ignored
and the training went on. So the handler also records the signal, and the optimizer step hook raises it again
(`raise_if_terminated`).
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger("tensile.hook")
_status: int | None = None  # the exit status a SIGTERM asked for, once one came


def exit_on_sigterm() -> bool:
    """SIGTERM raises SystemExit from now on; True if set. Only where the program has no handler of its own (one it
    sets later replaces this), and from the main thread, as Python requires."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminated)
        return True
    return False


def default_sigterm() -> None:
    """SIGTERM's default back, and no signal remembered (a forked child's end is its parent's business), unless the
    program has set a handler of its own since."""
    global _status
    _status = None
    if signal.getsignal(signal.SIGTERM) is _terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def raise_if_terminated() -> None:
    """SystemExit again where a SIGTERM's was swallowed: called at each optimizer step, outside any callback."""
    if _status is not None:
        raise SystemExit(_status)


def _terminated(signum: int, _frame: object) -> None:
    global _status
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    _status = 128 + signum  # the status a shell gives a command SIGTERM ended
    log.warning("tensile: SIGTERM: the training ends here, after the hook's last report")
    raise SystemExit(_status)
