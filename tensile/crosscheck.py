"""PyTorch's own MemTracker on a training step: the independent figure the tracer is checked against."""

from __future__ import annotations

import torch

from tensile.tracer import TrainingStep


def memtracker_peak(step: TrainingStep) -> int:
    """Peak device bytes of one steady-state iteration, as MemTracker counts them.

    A warm-up iteration runs first (optimizer state appears), as the tracer does. The batch is
    created before tracking starts, so MemTracker does not see it: its bytes are added here.
    """
    device = step.batch[0].device
    step.run()
    step.zero_grad()
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(step.model, *step.optimizers)
    with tracker:
        step.run()
    peak = tracker.get_tracker_snapshot("peak")[device]["Total"]
    return int(peak) + sum(t.nbytes for t in step.batch)
