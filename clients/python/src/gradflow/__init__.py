"""gradflow: gradient-flow diagnostics for PyTorch training loops.

gf = gradflow.watch(model, optimizer)
for batch in loader:
    ...
    optimizer.step()
    gf.step(loss=loss)
gf.close()

``import gradflow`` does not import torch: ``watch``, ``Watcher`` and ``NoopWatcher``
are loaded on first use, so the ``gradflow check`` and ``gradflow report`` commands
run where torch is not installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .api import Watch
from .errors import GradflowAlertWarning, GradflowWarning, TrainingAlert

if TYPE_CHECKING:
    from .watcher import NoopWatcher, Watcher, watch

__all__ = [
    "GradflowAlertWarning",
    "GradflowWarning",
    "NoopWatcher",
    "TrainingAlert",
    "Watch",
    "Watcher",
    "watch",
]
__version__ = "0.1.0"

_LAZY = ("NoopWatcher", "Watcher", "watch")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import watcher

        value = getattr(watcher, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gradflow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
