"""gradflow: gradient-flow diagnostics for PyTorch training loops.

gf = gradflow.watch(model, optimizer)
for batch in loader:
    ...
    optimizer.step()
    gf.step(loss=loss)
gf.close()

``import gradflow`` does not import torch: ``watch``, ``Watcher`` and ``NoopWatcher``
are loaded on first use, and so is ``gradflow.integrations`` (whose ``transformers``
and ``lightning`` submodules import those frameworks only when named), so the
``gradflow check`` and ``gradflow report`` commands run where torch is not installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .api import Watch
from .errors import GradflowAlertWarning, GradflowWarning, TrainingAlert

if TYPE_CHECKING:
    from . import integrations
    from .watcher import NoopWatcher, Watcher, watch

__all__ = [
    "GradflowAlertWarning",
    "GradflowWarning",
    "NoopWatcher",
    "TrainingAlert",
    "Watch",
    "Watcher",
    "integrations",
    "watch",
]
__version__ = "0.1.0"

_LAZY = ("NoopWatcher", "Watcher", "watch")


def __getattr__(name: str) -> Any:
    if name == "integrations":
        # ``gradflow.integrations.transformers.GradflowCallback()`` after a bare
        # ``import gradflow``: the subpackage, loaded now (it imports no framework).
        import importlib

        return importlib.import_module(".integrations", __name__)
    if name in _LAZY:
        from . import watcher

        value = getattr(watcher, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gradflow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {"integrations"})
