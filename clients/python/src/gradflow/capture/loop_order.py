"""The training loop's order, seen during the first optimizer steps. Sent as wiring
findings (protocol v1.6) in an amendment; the empty param groups found with the
registration (``param_group_empty``) are :func:`gradflow.measurement.wiring.empty_groups`.

- ``clip_after_step``: ``clip_grad_norm_`` or ``clip_grad_value_`` cut gradients
  that no ``backward`` wrote since the last ``optimizer.step()`` (a clip after the
  step, or before the next backward): the optimizer steps on unclipped gradients.
  Or a clip that ran before the backward that wrote the gradients the next step used
  (it found none, or only zeros) while those gradients were above its bound on at
  least two steps (:mod:`.clip_before_backward`): the finding then carries ``bound``
  and ``used_norms`` (v1.11).
- ``clip_before_unscale``: a clip ran on fresh gradients under a GradScaler whose
  ``unscale_`` had not run for the watched optimizer: it clipped the scaled norm, or
  clamped the scaled elements.

A clip "cut" when it changed something: the norm was above ``max_norm``, or some
element's magnitude above ``clip_value``. A value clip's finding names it in
``attribute`` (``clip_grad_value_``); a norm clip's carries none (as before v1.10).
- ``scheduler_per_micro_batch``: an LR scheduler of the optimizer advanced the same
  k >= 2 steps at every optimizer step.

Why wiring findings in an amendment and not a per-step metric: each is a fact about
the loop's structure, fixed once the first steps ran; the verdict needs no series,
and the server words it like the registration's findings.

How, exactly and cheaply. Only during the first ``LOOKS`` optimizer steps: an
optimizer step post-hook notes, for a few of the model's parameters, which gradient
tensor they hold and its in-place version (``backward`` makes a new one or bumps
it); ``clip_grad_norm_`` is observed through the module-level function it calls
(``_torch_compat.wrap_clip_grads``), ``clip_grad_value_`` through its public name
(``_torch_compat.wrap_clip_values``; the largest gradient element is read, one host
sync per clip, only during these steps), only for clips of the watched model's
parameters: a clip that finds those gradients as the step left them, and that cut,
acted on used gradients. The scaler's per-optimizer stage
says whether ``unscale_`` ran. The schedulers bound to the optimizer are found once,
after the first step, by ``gc.get_referrers(optimizer)`` (one walk of the heap,
about 0.1 s in a process with 360 000 objects), then their ``last_epoch`` is read at
each step. After ``LOOKS`` steps everything is removed and restored; ``close``
removes it earlier. One exception: a clip seen on used gradients at least ``CLIPS``
times that has not cut yet (a misplaced clip whose bound the early gradients stay
under; it matters once they pass it) keeps the clip observers and the step hook
(nothing else) for up to ``MISPLACED_LOOKS`` optimizer steps, until it cuts (a host
read of the clip's norm per clip there); a loop whose clips sit where they act never
gets there.
"""

from __future__ import annotations

import gc
import math
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import _torch_compat, wire
from .._log import swallow
from .clip_before_backward import ClipsBeforeBackward

# Optimizer steps watched.
LOOKS = 12
# Optimizer steps a misplaced clip that has not cut yet is watched for.
MISPLACED_LOOKS = 1000
# Clips seen where they cannot act before it is said (the loop repeats itself).
CLIPS = 2
# Scheduler advances, all equal and >= 2, before it is said.
ADVANCES = 4
# Parameters whose gradient tensors are noted at each step.
NOTED = 8


class LoopOrder:
    """Watches the first optimizer steps of ``model`` for the loop's order."""

    def __init__(self, model: nn.Module, optimizer: Any, scaler: Any) -> None:
        self._optimizers = [o for o in (optimizer, getattr(optimizer, "optimizer", None)) if o]
        self._scaler = scaler
        self._params = {id(p) for p in model.parameters()}
        # Spread over the model, so that a branch some steps skip cannot be all of them.
        trainable = [p for p in model.parameters() if p.requires_grad]
        self._noted_params = trainable[:: max(1, len(trainable) // NOTED)][:NOTED]
        # (parameter, id of its gradient, the gradient's version) after the last step.
        self._noted: List[Tuple[Any, int, int]] = []
        self._steps = 0
        self._clipped_used = 0
        # Clips seen on used gradients, whether they cut or not.
        self._misplaced = 0
        self._clipped_scaled = 0
        self._clip_params = 0
        self._scale: Optional[float] = None
        self._schedulers: List[Tuple[weakref.ref[Any], List[int]]] = []
        self._said: set[str] = set()
        self._done = False
        self._found: List[wire.WiringFinding] = []
        self._handle: Optional[Any] = None
        self._restores: List[Any] = []
        # The clip function of the last clip counted ("" for clip_grad_norm_).
        self._clip_name = ""
        self._before_backward = ClipsBeforeBackward()
        if optimizer is None or not hasattr(optimizer, "register_step_post_hook"):
            return
        try:
            self._handle = optimizer.register_step_post_hook(self._after_step)
            self._restores = [
                restore
                for restore in (
                    _torch_compat.wrap_clip_grads(self._on_clip),
                    _torch_compat.wrap_clip_values(self._on_value_clip),
                )
                if restore is not None
            ]
        except Exception as exc:
            swallow("watching the loop's order", exc)
            self.remove()

    def _finish(self) -> None:
        """Stops watching from inside the optimizer's hook, where removing the hook
        would change the hooks torch is iterating: the hook is removed at the next
        look (``findings``)."""
        self._done = True
        self._unwrap()
        self._noted = []
        self._schedulers = []

    def remove(self) -> None:
        self._finish()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._unwrap()
        self._noted_params = []

    def _unwrap(self) -> None:
        for restore in self._restores:
            restore()
        self._restores = []

    def hook_ids(self) -> Tuple[int, ...]:
        """The id of its optimizer step hook while it has one (it only reads)."""
        return (self._handle.id,) if self._handle is not None else ()

    def findings(self) -> List[wire.WiringFinding]:
        """What the steps since the last look proved, once each."""
        found, self._found = self._found, []
        if self._done and self._handle is not None:
            self.remove()
        return found

    # -- the optimizer step --------------------------------------------------------

    def _after_step(self, *_: Any) -> None:
        if self._done:
            return
        try:
            self._steps += 1
            self._noted = [
                (p, id(p.grad), _torch_compat.grad_version(p.grad))
                for p in self._noted_params
                if p.grad is not None
            ]
            self._judge_clips_before_backward()
            if self._steps == 1:
                self._find_schedulers()
            elif self._steps <= LOOKS:
                self._read_schedulers()
            if self._steps >= LOOKS and not self._waiting_for_a_cut():
                self._finish()
        except Exception as exc:
            swallow("watching the loop's order", exc)
            self._finish()

    def _judge_clips_before_backward(self) -> None:
        clips = self._before_backward
        seen = clips.seen
        if clips.step():
            self._say(
                "clip_after_step",
                params=clips.params,
                attribute=clips.name or None,
                bound=clips.bound,
                used_norms=clips.sent_norms(),
            )
        self._misplaced += clips.seen - seen

    def _waiting_for_a_cut(self) -> bool:
        """Whether a clip that cannot act has been seen but has not cut yet, within
        ``MISPLACED_LOOKS`` steps: then only the clips are watched on."""
        waiting = (
            self._misplaced >= CLIPS
            and "clip_after_step" not in self._said
            and self._steps < MISPLACED_LOOKS
        )
        if waiting:
            self._schedulers = []
        return waiting

    def _find_schedulers(self) -> None:
        types = _torch_compat.lr_scheduler_types()
        plateau = getattr(torch.optim.lr_scheduler, "ReduceLROnPlateau", ())
        seen: set[int] = set()
        for optimizer in self._optimizers:
            for ref in gc.get_referrers(optimizer):
                # ReduceLROnPlateau counts calls, not time: a per-batch one is coherent.
                if (
                    isinstance(ref, types)
                    and not isinstance(ref, plateau)
                    and id(ref) not in seen
                    and getattr(ref, "optimizer", None) is optimizer
                ):
                    seen.add(id(ref))
                    epoch = int(getattr(ref, "last_epoch", 0))
                    self._schedulers.append((weakref.ref(ref), [epoch]))

    def _read_schedulers(self) -> None:
        for ref, epochs in self._schedulers:
            scheduler = ref()
            if scheduler is None:
                continue
            epochs.append(int(scheduler.last_epoch))
            advances = [b - a for a, b in zip(epochs, epochs[1:])]
            k = advances[0]
            name = type(scheduler).__name__
            if (
                len(advances) >= ADVANCES
                and k >= 2
                and all(a == k for a in advances)
                and k != _world_size()  # accelerate steps it once per process, by design
            ):
                self._say("scheduler_per_micro_batch", attribute=name, measured=k)

    # -- clip_grad_norm_ and clip_grad_value_ -------------------------------------------

    def _on_clip(self, parameters: Any, max_norm: Any, total_norm: Any) -> None:
        try:
            limit = float(max_norm)
            if math.isfinite(limit):  # clip_grad_norm_(..., inf) measures; it cuts nothing
                self._on_any_clip(
                    parameters, "", lambda: float(total_norm) > limit, limit, total_norm
                )
        except Exception as exc:
            swallow("watching gradient clipping", exc)

    def _on_value_clip(self, parameters: Any, clip_value: Any) -> None:
        try:
            limit = float(clip_value)
            if math.isfinite(limit) and limit > 0:  # a limit of 0 is clip_zero's

                def cut() -> bool:
                    grads = [p.grad for p in _listed(parameters) if p.grad is not None]
                    largest = torch.stack(torch._foreach_norm(grads, math.inf)).max()
                    return bool(largest > limit)

                self._on_any_clip(parameters, "clip_grad_value_", cut, limit, None)
        except Exception as exc:
            swallow("watching gradient clipping", exc)

    def _on_any_clip(
        self, parameters: Any, name: str, cut: Any, limit: float, total_norm: Any
    ) -> None:
        """One clip of `parameters` by the function `name` with bound `limit`; `cut()`
        says whether it changed anything (read only when it matters: it may cost a
        host sync); `total_norm`: a norm clip's, None for a value clip."""
        if self._done:
            return
        params = _listed(parameters)
        first = next((p for p in params if p.grad is not None), None)
        watched = first if first is not None else next(iter(params), None)
        if watched is None or id(watched) not in self._params:
            return
        if first is None:  # nothing to cut yet: judged at the step, once backward ran
            self._before_backward.clip(params, limit, name, None, None)
            return
        if self._used(params):
            self._misplaced += 1
            if cut():
                self._clipped_used += 1
                self._clip_params, self._clip_name = len(params), name
            if self._clipped_used >= CLIPS:
                self._say("clip_after_step", params=self._clip_params, attribute=self._name())
            return
        self._before_backward.clip(params, limit, name, first.grad, total_norm)
        if self._steps < LOOKS and self._unscale_pending():
            scale = _torch_compat.scaler_scale(self._scaler)
            if scale is not None and scale > 1.0 and cut():
                self._clipped_scaled += 1
                self._clip_params, self._scale, self._clip_name = len(params), scale, name
            if self._clipped_scaled >= CLIPS:
                self._say(
                    "clip_before_unscale",
                    params=self._clip_params,
                    measured=round(self._scale or 0),
                    attribute=self._name(),
                )

    def _name(self) -> Optional[str]:
        return self._clip_name or None

    def _used(self, params: List[Any]) -> bool:
        """Whether the noted gradients are still those the last step used (no
        backward wrote them since): one the clip holds, and all unchanged."""
        if not self._noted:
            return False
        clipped = {id(p) for p in params}
        held = [(p, g, v) for p, g, v in self._noted if id(p) in clipped]
        return bool(held) and all(
            p.grad is not None and id(p.grad) == g and _torch_compat.grad_version(p.grad) == v
            for p, g, v in held
        )

    def _unscale_pending(self) -> bool:
        scaler = self._scaler
        if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
            return False
        # accelerate unscales the optimizer inside its wrapper: any unscaled is enough.
        return all(_torch_compat.scaler_unscale_pending(scaler, o) for o in self._optimizers)

    def _say(self, kind: str, **fields: Any) -> None:
        if kind in self._said:
            return
        self._said.add(kind)
        finding: Dict[str, Any] = {"kind": kind, "module": ""}
        finding.update({k: v for k, v in fields.items() if v is not None})
        self._found.append(finding)  # type: ignore[arg-type]


def _listed(parameters: Any) -> List[Any]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _world_size() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
    except Exception:
        pass
    return 1
