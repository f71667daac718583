"""The Tensile runtime hook: carries TENSILE plans out inside an unmodified PyTorch process.

Switched on by `sitecustomize` when TENSILE_JOB is set (`tensile run`, or the operator's pod), or by
calling `activate()`. It never imports FastAPI, Kopf or kubernetes: it runs in the user's image.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensile_hook.lifecycle import activate, activate_from_env, deactivate

__all__ = ["activate", "activate_from_env", "deactivate"]


def __getattr__(name: str) -> Any:
    """`activate` & co. load torch on first use, not on import: the init container that copies the hook into
    a pod (`python -m tensile_hook.install`) imports this package, and with torch it needed 152 MB,
    over its 128Mi limit (killed for memory: no training pod started)."""
    if name in __all__:
        from tensile_hook import lifecycle

        return getattr(lifecycle, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
