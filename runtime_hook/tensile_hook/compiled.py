"""torch.compile under the hook: TorchDynamo does not compile a frame while a dispatch mode is on the
stack ("non-infra torch dispatch mode present"), and marks that code to be skipped for the rest of the
process, so compiled code first run in a dispatch-path iteration runs eagerly under Tensile even in native
iterations. Training stays correct (eager PyTorch's numerics) and within its plan; the user, who compiled for
speed, is told why it is gone. Code first run in a native iteration (the mode off) compiles as usual."""

from __future__ import annotations

import sys

COMPILE_SKIPPED = (
    "torch.compile'd code ran under the hook: TorchDynamo does not compile while the hook's dispatch mode "
    "is active and then skips that code for the rest of the process, so it runs eagerly (eager PyTorch's "
    "speed and numerics; memory as planned). Run the job without Tensile to keep compilation"
)


def dynamo_frames() -> int:
    """How many code objects TorchDynamo has been asked to compile in this process (0 until torch.compile'd
    code first runs). Its internal tracker, read defensively: another PyTorch may not have it."""
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    seen = getattr(getattr(convert_frame, "input_codes", None), "seen_ids", None)
    return len(seen) if isinstance(seen, set) else 0
