"""Frozen weights that ``optimizer.step()`` changes anyway: parameters with
``requires_grad=False`` left in the optimizer, which it still moves by weight decay
or momentum (a gradient zeroed rather than set to None, as ``zero_grad`` did before
torch 2.0: iamwangyabin/S-Prompts#2; an optimizer that decays parameters without a
gradient: KellerJordan/Muon#54). The user believes them frozen; they drift. Sent as
the wiring finding ``frozen_weights_stepped`` (protocol v1.10) in an amendment, one
per module: ``params`` the tensors that moved, ``attribute`` their names.

Why only inside ``optimizer.step()``: weights moved by hand outside it (an EMA
teacher, MoCo's momentum encoder, a DQN target copied from the online network) are
the legitimate cases, and they are never judged. The rule is the fact itself: a
parameter that requires no gradient, held by the watched optimizer, whose values
``optimizer.step()`` changed.

How, cheaply: only on sampled optimizer steps (the first ``LOOKS``, then one in
``EVERY``), the frozen parameters the optimizer holds are noted with their in-place
version counters before the step and compared after it. A counter that moved is only
a suspect (an update of exactly zero, plain SGD on a zeroed gradient, bumps it and
changes nothing): on the very next step the suspects' norms are read before and
after the step, and a norm that changed is the proof. A freeze made mid-run is seen
within ``EVERY`` + 1 steps. Nothing is read on the other steps but a counter.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from .. import _torch_compat, wire
from .._log import swallow

# Optimizer steps checked from the start, then one in EVERY.
LOOKS = 12
EVERY = 50


class FrozenMoves:
    """Watches ``optimizer.step()`` for frozen parameters it changes."""

    def __init__(self, names: Dict[int, str], optimizer: Any) -> None:
        # The watched model's parameters, by id: their names.
        self._names = names
        self._optimizer = optimizer
        self._steps = 0
        self._checking = False
        # Noted before a checked step: (parameter, its version) for every frozen
        # parameter the optimizer holds; (parameter, its norm) for the suspects.
        self._versions: List[Tuple[torch.Tensor, int]] = []
        self._norms: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._suspects: List[torch.Tensor] = []
        self._said: set[str] = set()
        self._found: List[wire.WiringFinding] = []
        self._handles: List[Any] = []
        if optimizer is None or not hasattr(optimizer, "register_step_pre_hook"):
            return
        try:
            self._handles = [
                optimizer.register_step_pre_hook(self._before),
                optimizer.register_step_post_hook(self._after),
            ]
        except Exception as exc:
            swallow("watching frozen weights", exc)

    def hook_ids(self) -> Tuple[int, ...]:
        """The ids of its step hooks (they only read)."""
        return tuple(h.id for h in self._handles)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._versions, self._norms, self._suspects = [], [], []

    def findings(self) -> List[wire.WiringFinding]:
        found, self._found = self._found, []
        return found

    def _before(self, *_: Any) -> None:
        # A step right after suspects were found confirms them; else a sampled step
        # looks for suspects.
        confirm = bool(self._suspects)
        self._checking = confirm or self._steps < LOOKS or self._steps % EVERY == 0
        self._steps += 1
        if not self._checking:
            return
        try:
            if confirm:
                suspects = [p for p in self._suspects if not p.requires_grad]
                self._suspects = []
                if suspects:
                    with torch.no_grad():
                        norms = torch._foreach_norm([p.detach() for p in suspects])
                    self._norms = [(p, n.clone()) for p, n in zip(suspects, norms)]
            else:
                frozen = self._frozen_held()
                self._versions = [(p, _torch_compat.grad_version(p)) for p in frozen]
        except Exception as exc:
            swallow("watching frozen weights", exc)
            self._checking = False
            self._versions, self._norms = [], []

    def _after(self, *_: Any) -> None:
        if not self._checking:
            return
        self._checking = False
        try:
            if self._versions:
                self._suspects = [
                    p for p, v in self._versions if _torch_compat.grad_version(p) != v
                ]
                self._versions = []
            if not self._norms:
                return
            params = [p for p, _ in self._norms]
            with torch.no_grad():
                now = torch.stack(list(torch._foreach_norm([p.detach() for p in params])))
                moved = (now != torch.stack([n for _, n in self._norms])).tolist()
            self._norms = []
            self._say([p for p, m in zip(params, moved) if m])
        except Exception as exc:
            swallow("watching frozen weights", exc)
            self._versions, self._norms = [], []

    def _frozen_held(self) -> List[torch.Tensor]:
        return [
            p
            for group in self._optimizer.param_groups
            for p in group["params"]
            if not p.requires_grad and id(p) in self._names
        ]

    def _say(self, moved: List[torch.Tensor]) -> None:
        by_module: Dict[str, List[str]] = {}
        for p in moved:
            module, _, attribute = self._names[id(p)].rpartition(".")
            by_module.setdefault(module, []).append(attribute)
        for module, attributes in by_module.items():
            if module in self._said:
                continue
            self._said.add(module)
            finding: Dict[str, Any] = {
                "kind": "frozen_weights_stepped",
                "module": module,
                "attribute": ", ".join(attributes),
                "params": len(attributes),
            }
            self._found.append(finding)  # type: ignore[arg-type]
