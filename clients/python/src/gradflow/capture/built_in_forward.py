"""Layers built inside a watched module's ``forward`` and registered nowhere
(``nn.Linear(d, d)(x)`` in ``forward``): new random weights at every call, which
neither ``model.parameters()`` nor the optimizer ever sees. Sent as the wiring
finding ``params_created_in_forward`` in an amendment (protocol v1.5).

How it is seen, exactly and at next to no cost: during the first steps only, torch's
global parameter-registration hook fires whenever any module registers a parameter
(a layer's ``__init__`` does). A registration counts when it is on a module that is
not the model's and a watched module's ``forward`` is on the Python stack (read only
then, so a training loop that builds nothing pays nothing). The verdict waits for
the next look, after the forward: a layer the model then holds (``self.proj =
nn.Linear(...)`` assigned once, lazily) is registered and is the amendment's
ordinary business, not this. A parameter kept alive by nothing, or alive but not the
model's, was built for one call only.

Why an amendment and not a per-step metric: the fact does not change from step to
step and needs no series; the server words it like the registration's findings.
Parameters created under ``torch.compile`` tracing or by FSDP/ZeRO swapping a
module's own parameters are on modules of the model, so they never count.
"""

from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import Any, Dict, List, Optional, Set, Tuple

from torch import nn

from .. import wire
from .._log import swallow

# Looks (``Registry.amendment`` runs 1-3 times a step) before the hook is removed:
# the first few steps. A finding removes it at once.
LOOKS = 8
# Frames read up the stack to find the watched module whose forward runs.
MAX_DEPTH = 64
# Parameters held, weakly, before a look judges them.
MAX_PENDING = 256
_FORWARD_FRAMES = ("forward", "_call_impl")


class BuiltInForward:
    """Watches parameter registrations during the first steps of ``model``."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self._names: Dict[int, str] = {id(m): name for name, m in model.named_modules()}
        # (module name, layer class, the parameter) for each candidate.
        self._pending: List[Tuple[str, str, weakref.ref[Any]]] = []
        self._looks = 0
        self._handle: Optional[Any] = None
        try:
            register = nn.modules.module.register_module_parameter_registration_hook
            self._handle = register(self._on_registration)
        except Exception as exc:  # an older torch: nothing is watched
            swallow("watching layers built in forward", exc)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._pending.clear()

    def _on_registration(self, module: nn.Module, _name: str, param: Any) -> None:
        try:
            if param is None or id(module) in self._names or len(self._pending) >= MAX_PENDING:
                return
            where = self._running_forward()
            if where is not None:
                self._pending.append((where, type(module).__name__, weakref.ref(param)))
        except Exception as exc:
            swallow("watching layers built in forward", exc)

    def _running_forward(self) -> Optional[str]:
        """The innermost watched module whose forward is on the stack, by name."""
        frame: Optional[FrameType] = sys._getframe(2)
        for _ in range(MAX_DEPTH):
            if frame is None:
                return None
            if frame.f_code.co_name in _FORWARD_FRAMES:
                owner = frame.f_locals.get("self")
                if owner is not None and id(owner) in self._names:
                    return self._names[id(owner)]
            frame = frame.f_back
        return None

    def findings(self) -> List[wire.WiringFinding]:
        """What the registrations since the last look prove; removes the hook after
        the first steps or the first finding."""
        if self._handle is None:
            return []
        self._looks += 1
        pending, self._pending = self._pending, []
        found: List[wire.WiringFinding] = []
        model = self._model()
        if pending and model is not None:
            found = _strays(model, pending)
        if found or self._looks >= LOOKS or model is None:
            self.remove()
        return found


def _strays(
    model: nn.Module, pending: List[Tuple[str, str, weakref.ref[Any]]]
) -> List[wire.WiringFinding]:
    held: Set[int] = {id(p) for p in model.parameters()}
    per_module: Dict[str, Tuple[List[str], int]] = {}
    for module, layer, ref in pending:
        param = ref()
        if param is not None and id(param) in held:
            continue  # built once and registered: the model holds it now
        layers, count = per_module.get(module, ([], 0))
        if layer not in layers:
            layers.append(layer)
        per_module[module] = (layers, count + 1)
    return [
        {"kind": "params_created_in_forward", "module": name, "attribute": layers[0], "params": n}
        for name, (layers, n) in per_module.items()
    ]
