"""Training commands started by Tensile end when Tensile's process does, even killed with SIGKILL.

A `kill -9` of `tensile run` (or of the local runner) is seen by no handler, so nothing passes it on: the training
went on with no parent, its GPU memory held, its report never read. Linux's parent-death signal asks the kernel to
send the command SIGTERM instead, as `kill` of `tensile run` passes it on. It reaches the command Tensile started,
not what that starts: a wrapper (`bash train.sh`) that does not pass SIGTERM on leaves its Python running.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def ends_with_this_process(then: Callable[[], object] | None = None) -> Callable[[], None]:
    """A Popen `preexec_fn` (it runs in the child, before exec) that arms the parent-death signal, then runs `then`.
    Where there is no prctl (not Linux), only `then`. The kernel sends the signal when the *thread* that started the
    child ends (prctl(2)): call Popen from the thread that outlives it (both callers use their main thread)."""
    parent = os.getpid()
    prctl = _prctl()

    def arm() -> None:
        if prctl is not None and prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGTERM)) == 0 \
                and os.getppid() != parent:  # the parent died before the signal was armed: it will never come
            os.kill(os.getpid(), signal.SIGTERM)
        if then is not None:
            then()

    return arm


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up once in the parent: a forked child must not load libraries before exec."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.restype = ctypes.c_int
    return prctl
