"""What a trace can be asked for, by name: the model, optimizers, dtypes, devices and the default batch size.

Kept apart from `tensile.forecast`, which builds them with torch, so that the command line, the TrainingJob spec and
the webhook can offer and check the choices without importing torch (`tensile --help` answers at once)."""

from __future__ import annotations

OPTIMIZER_NAMES = ("sgd", "momentum", "adam", "adamw")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEVICES = ("cuda", "cpu")
DEFAULT_BATCH_SIZE = 16  # what --model is traced at when no --batch-size is given


def is_user_model(spec: str) -> bool:
    """A model named as FILE.py:FUNC (the user's builder) rather than by its zoo name."""
    return ".py:" in spec
