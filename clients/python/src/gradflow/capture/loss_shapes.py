"""An element-wise loss whose prediction and target differ in shape and broadcast
into more pairs than either holds: ``MSELoss()(yhat, y)`` with ``yhat`` of shape
(N, 1) and ``y`` of shape (N) compares every prediction with every target, an (N, N)
loss whose minimum is the mean target (pytorch/pytorch#16045). Torch warns once, in a
log that scrolls by; training runs and the loss falls. Sent as the wiring finding
``loss_broadcasts`` (protocol v1.10) in an amendment: ``attribute`` the function and
the two shapes, ``measured`` how many times more pairs the loss compares than there
are predictions.

The rule is the shapes themselves: grad enabled, a prediction that requires grad,
and a broadcast shape with more elements than both the prediction and the target (a
target broadcast over a prediction's extra dimension, (N, 4) against (N, 1), is not
one). The functionals are wrapped by their module attribute
(``_torch_compat.wrap_loss_function``) for the first ``CALLS`` calls of the run, then
restored: the mistake repeats on every call.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch

from .. import _torch_compat, wire
from .._log import swallow

FUNCTIONS = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss")
# Loss calls watched before the wrappers come off.
CALLS = 100


class LossShapes:
    """Watches the element-wise regression losses for broadcasting shapes."""

    def __init__(self) -> None:
        self._calls = 0
        self._said: set[str] = set()
        self._found: List[wire.WiringFinding] = []
        self._restores: List[Callable[[], None]] = []
        try:
            for name in FUNCTIONS:
                restore = _torch_compat.wrap_loss_function(name, self._observe)
                if restore is not None:
                    self._restores.append(restore)
        except Exception as exc:
            swallow("watching the loss's shapes", exc)

    def remove(self) -> None:
        restores, self._restores = self._restores, []
        for restore in restores:
            restore()

    def findings(self) -> List[wire.WiringFinding]:
        found, self._found = self._found, []
        return found

    def _observe(self, name: str, given: Any, target: Any) -> None:
        try:
            self._calls += 1
            if self._calls > CALLS:
                self.remove()
                return
            if (
                name in self._said
                or not torch.is_grad_enabled()
                or not isinstance(given, torch.Tensor)
                or not isinstance(target, torch.Tensor)
                or not given.requires_grad
                or given.shape == target.shape
            ):
                return
            pairs = torch.Size(torch.broadcast_shapes(given.shape, target.shape)).numel()
            if pairs <= max(given.numel(), target.numel()):
                return
            self._said.add(name)
            finding: Dict[str, Any] = {
                "kind": "loss_broadcasts",
                "module": "",
                "attribute": f"{name}: input {_shape(given)}, target {_shape(target)}",
                "measured": pairs // max(1, given.numel()),
            }
            self._found.append(finding)  # type: ignore[arg-type]
        except Exception as exc:
            swallow("watching the loss's shapes", exc)


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(d) for d in t.shape) + ("," if t.dim() == 1 else "") + ")"
