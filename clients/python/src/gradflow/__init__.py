"""gradflow: gradient-flow diagnostics for PyTorch training loops.

gf = gradflow.watch(model, optimizer)
for batch in loader:
    ...
    optimizer.step()
    gf.step(loss=loss)
gf.close()
"""

from .errors import GradflowAlertWarning, GradflowWarning, TrainingAlert
from .watcher import NoopWatcher, Watcher, watch

__all__ = [
    "GradflowAlertWarning",
    "GradflowWarning",
    "NoopWatcher",
    "TrainingAlert",
    "Watcher",
    "watch",
]
__version__ = "0.1.0"
