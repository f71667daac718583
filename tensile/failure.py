"""What a failed training's log says at its job's end (the operator's TrainingJob, `tensile local`'s view): its last
line, and where that is PyTorch's out-of-memory error, that the job outgrew the memory it was admitted with."""

from __future__ import annotations

import re

from tensile.knobs import MEMORY_CAP, memory_text

# PyTorch's words for a CUDA allocation it could not make (torch.OutOfMemoryError)
CUDA_OUT_OF_MEMORY = re.compile(r"OutOfMemoryError|CUDA out of memory")
# a line of the hook's own ("tensile: ...", with or without a logging prefix): at exit it may speak after the
# training's traceback
HOOK_LINE = re.compile(r"(^|:)tensile: ")
LAST_LINE_CHARS = 500  # of a log's last line, in a message


def last_line(text: str) -> str:
    """The last line of a training's log that says something, at most LAST_LINE_CHARS long, passing over the hook's
    own lines after it (its last words at exit come after the traceback); "" where no line says anything."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    training = [line for line in lines if not HOOK_LINE.search(line)]
    said = training or lines
    return said[-1][:LAST_LINE_CHARS] if said else ""


def outgrew_cap(said: str, cap_bytes: int | None) -> str | None:
    """`said` of a failed training (its log's last line in it) with, where that is PyTorch's out-of-memory error, what
    that means: the job outgrew the memory its process may hold (`cap_bytes`, what it was admitted with; None where
    it had no cap) and failed alone. None for any other failure."""
    if not CUDA_OUT_OF_MEMORY.search(said):
        return None
    if cap_bytes is None:
        return f"{said.rstrip('.')}. Its process ran out of CUDA memory"
    return (f"{said.rstrip('.')}. Its process may hold {memory_text(cap_bytes)} ({MEMORY_CAP.variable}, what it was "
            "admitted with), so it failed alone rather than take its neighbours' memory; its log says whether the "
            "hook, which turns such errors into evictions, carried it")
