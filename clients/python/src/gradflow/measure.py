"""Per-step measurements on the device, brought to the host in one transfer.

Gradient norms are read in the optimizer's step pre-hook (after unscaling, before
anything can zero them; on a step the scaler skips, from its ``step`` wrapper), the
norm weights are snapshotted there and compared in the step post-hook, and at
``gf.step`` every piece is concatenated into one vector and copied to the host
(non-blocking into pinned memory on CUDA). The reporter thread waits for the copy
and turns the numbers into a step record (:mod:`gradflow.record`), so the training
thread never syncs. What the hooks on the model see during the step (hook hits, the
input peak, the carry-over probe) comes from :mod:`gradflow.hooks`.

In a multi-rank run (``partial``) each rank measures the elements it holds (a
DTensor's local shard) and also sends each module's sum of squares, the elements it
covers and how many are not finite, and each parameter's element count: the server
adds the partial sums of sharded parameters across ranks and compares the copies of
replicated ones. Sums are taken in f64 (the vector brought to the host is f64; f32
on Apple's MPS, which has no f64).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import _torch_compat, intended, wire
from .hooks import ModelHooks
from .ranks import StepClock, local, param_sums
from .record import (
    TRAINING_METRIC,
    Intended,
    ModuleAt,
    NormAt,
    NormStats,
    PendingStep,
    Slots,
    UpdatesAt,
    width,
)
from .registration import Registry
from .updates import Updates


@dataclass
class _Norm:
    """A norm weight whose drift, update and intended update are reported."""

    name: str
    tensor: torch.Tensor
    init: torch.Tensor  # f32 copy at registration, for drift (of this rank's elements)
    group_index: Optional[int]  # optimizer parameter group, None when not in it
    numel: int  # elements this rank holds


# Where this step's gradient numbers lie in `Measurer._grads`: the slot of each
# module's squared norm, of each norm weight's, and each module's element count.
_GradSlots = Tuple[List[Optional[int]], List[Optional[int]], List[Optional[int]]]


class Measurer:
    """Everything measured on the device for one step of one watched model."""

    def __init__(self, registry: Registry, hooks: ModelHooks) -> None:
        self.registry = registry
        self.hooks = hooks
        # Set for a multi-rank run: records carry the partial sums (see the module).
        self.partial = False
        # Multi-rank: every how many steps each module's weights are summed, the
        # replicas' fingerprint (0: never).
        self.fingerprint_every = 0
        self.optimizer = registry.optimizer
        self._family = intended.family(self.optimizer) if self.optimizer is not None else None
        self._norms: List[_Norm] = []
        self._index_cache: Dict[Tuple[int, ...], Tuple[torch.Tensor, torch.Tensor]] = {}
        self._seg_cache: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}
        self._modules: List[str] = []
        self._module_of: List[int] = []
        self._norm_init: Optional[torch.Tensor] = None
        # This step's numbers so far, on the device.
        self._grads: Optional[torch.Tensor] = None
        self._grad_meta: Optional[_GradSlots] = None
        self._before: Optional[torch.Tensor] = None
        self._stats: Optional[torch.Tensor] = None
        self._intended_slots: Dict[int, int] = {}
        self.rebuild()
        self.reset()

    @property
    def clock(self) -> Optional[StepClock]:
        return self.hooks.clock

    # -- structure ---------------------------------------------------------------

    def rebuild(self) -> None:
        """After registration or an amendment: modules, hooks, norm weights."""
        params = self.registry.params
        self._modules = []
        index: Dict[str, int] = {}
        self._module_of = []
        for p in params:
            if p.module not in index:
                index[p.module] = len(self._modules)
                self._modules.append(p.module)
            self._module_of.append(index[p.module])
        self.hooks.rebuild()
        membership = self.registry._membership()
        old = {n.name: n for n in self._norms}
        norms = []
        for p in params:
            if p.role != "norm" or not p.tensor.is_floating_point():
                continue
            prior = old.get(p.name)
            mine = local(p.tensor)
            init = prior.init if prior is not None else mine.detach().float().reshape(-1).clone()
            norms.append(
                _Norm(p.name, p.tensor, init, membership.get(id(p.tensor)), int(mine.numel()))
            )
        # Contiguous runs of one optimizer group and dtype: the intended update is
        # computed per run with plain scalars.
        norms.sort(key=lambda n: (n.group_index is None, n.group_index or 0, str(n.tensor.dtype)))
        self._norms = norms
        self._norm_init = torch.cat([n.init for n in norms]) if norms else None
        self._index_cache.clear()
        self._seg_cache.clear()
        # Anything measured against the old layout is dropped; collect() measures the
        # gradients again if they are still there.
        self._grads = None
        self._grad_meta = None
        self._before = None
        self._stats = None
        self._intended_slots = {}

    def reset(self) -> None:
        """A new step: nothing measured yet."""
        self._grads = None
        self._grad_meta = None
        self._before = None
        self._stats = None
        self._intended_slots = {}
        self.hooks.reset()

    @property
    def grads_measured(self) -> bool:
        return self._grads is not None or self._grad_meta is not None

    # -- the optimizer step ------------------------------------------------------

    def measure_grads(self) -> None:
        """Per-parameter gradient norms (foreach) of the elements this rank holds,
        squared and summed per module on the device, in f64."""
        params = self.registry.params
        present = [
            i for i, p in enumerate(params) if p.tensor.requires_grad and p.tensor.grad is not None
        ]
        module_slot: List[Optional[int]] = [None] * len(self._modules)
        norm_slot: List[Optional[int]] = [None] * len(self._norms)
        module_numel: List[Optional[int]] = [None] * len(self._modules)
        if not present:
            self._grads, self._grad_meta = None, (module_slot, norm_slot, module_numel)
            return
        grad_of = {i: local(_grad(params[i].tensor)) for i in present}
        by_kind: Dict[Tuple[torch.device, torch.dtype], List[int]] = {}
        for i in present:
            g = grad_of[i]
            by_kind.setdefault((g.device, g.dtype), []).append(i)
        device = grad_of[present[0]].device
        order: List[int] = []
        parts = []
        for (_dev, _dtype), idx in by_kind.items():
            grads = [grad_of[i] for i in idx]
            parts.append(_norms(grads).to(device, non_blocking=True))
            order.extend(idx)
        per_param = torch.cat(parts) if len(parts) > 1 else parts[0]
        per_param = per_param.to(_wide(device))
        squared = per_param * per_param
        key = tuple(order)
        cached = self._index_cache.get(key)
        if cached is None:
            if len(self._index_cache) > 32:
                # The set of parameters with gradients varies (mixture of experts):
                # keep the cache from growing without bound.
                self._index_cache.clear()
            modules = torch.tensor([self._module_of[i] for i in order], device=device)
            position = {id(params[i].tensor): k for k, i in enumerate(order)}
            picks = [position.get(id(n.tensor), 0) for n in self._norms]
            cached = (modules, torch.tensor(picks, device=device, dtype=torch.long))
            self._index_cache[key] = cached
        modules_index, norm_pick = cached
        per_module = torch.zeros(len(self._modules), device=device, dtype=squared.dtype)
        per_module.index_add_(0, modules_index, squared)
        for i in order:
            m = self._module_of[i]
            module_slot[m] = m
            module_numel[m] = (module_numel[m] or 0) + int(grad_of[i].numel())
        measured = {id(params[i].tensor) for i in order}
        for k, n in enumerate(self._norms):
            if id(n.tensor) in measured:
                norm_slot[k] = len(self._modules) + k
        pieces = [per_module]
        if self._norms:
            pieces.append(squared.index_select(0, norm_pick))
        self._grads = torch.cat(pieces)
        self._grad_meta = (module_slot, norm_slot, module_numel)

    def snapshot_norms(self) -> None:
        if self._norms:
            self._before = torch.cat([_flat32(n.tensor) for n in self._norms])

    def after_step(self) -> None:
        """Update, drift and mean of the norm weights, and what the optimizer meant."""
        if not self._norms or self._before is None:
            return
        before = self._before
        self._before = None
        after = torch.cat([_flat32(n.tensor) for n in self._norms])
        if after.shape != before.shape or self._norm_init is None:
            return  # a norm weight was replaced or resized since the snapshot
        device = after.device
        segments, sizes = self._segments(0, len(self._norms), device)
        count = len(self._norms)
        zeros = torch.zeros(count, device=device)
        diff = after - before
        update_sq = zeros.index_add(0, segments, diff * diff)
        init = self._norm_init.to(device, non_blocking=True)
        away = (after - init).abs()
        drift = zeros.scatter_reduce(0, segments, away, "amax", include_self=False)
        drift = drift + zeros.index_add(0, segments, away) * 0.0
        mean = zeros.index_add(0, segments, after) / sizes
        pieces = [torch.stack([update_sq, drift, mean], dim=1).reshape(-1)]
        self._intended_slots = {}
        if self._family is not None:
            pieces.extend(self._intended(before, after, width(NormStats) * count))
        self._stats = torch.cat(pieces)

    def _segments(
        self, start: int, end: int, device: torch.device
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Segment id of each element of norms[start:end] and each one's size, cached
        on the device (built once, not every step)."""
        key = (start, end)
        cached = self._seg_cache.get(key)
        if cached is None or cached[0].device != device:
            sizes = torch.tensor([self._norms[k].numel for k in range(start, end)])
            ids = torch.repeat_interleave(torch.arange(len(sizes)), sizes).to(device)
            cached = (ids, sizes.to(device, torch.float32))
            self._seg_cache[key] = cached
        return cached

    def _intended(self, before: torch.Tensor, after: torch.Tensor, base: int) -> List[torch.Tensor]:
        pieces: List[torch.Tensor] = []
        offsets = [0]
        for n in self._norms:
            offsets.append(offsets[-1] + n.numel)
        groups = self.optimizer.param_groups
        slot = base
        tensors = [n.tensor for n in self._norms]
        indices = [n.group_index for n in self._norms]
        for start, end in intended.runs(tensors, indices):
            first = self._norms[start]
            if (
                self._family is not None
                and first.group_index is not None
                and first.group_index < len(groups)
            ):
                a, b = offsets[start], offsets[end]
                upd = intended.update(
                    self._family,
                    self.optimizer,
                    groups[first.group_index],
                    tensors[start:end],
                    before[a:b],
                )
                if upd is not None:
                    segments, _ = self._segments(start, end, upd.device)
                    summary = intended.summary(
                        upd, before[a:b], after[a:b], first.tensor.dtype, segments, end - start
                    )
                    pieces.append(summary.reshape(-1))
                    for k in range(start, end):
                        self._intended_slots[k] = slot + width(Intended) * (k - start)
                    slot += width(Intended) * (end - start)
        return pieces

    # -- the step record ---------------------------------------------------------

    def collect(
        self,
        step: int,
        loss: Any,
        scaler_state: Optional[torch.Tensor],
        lrs: Dict[str, float],
        amend: Optional[wire.Amendment],
        metrics: Optional[Dict[str, Any]],
        updates: Optional[Updates] = None,
    ) -> PendingStep:
        """This step's pending record: every device number in one vector, on its way
        to the host, and where each lies."""
        if not self.grads_measured:
            self.measure_grads()  # gf.step without an optimizer step: what is there now
        pending = PendingStep(
            step=step, time=time.time(), lrs=lrs, amend=amend, partial=self.partial
        )
        if metrics:
            pending.metrics.update(metrics)
        # Whether the model was in training mode at gf.step (dropout on): a model left
        # in eval() after an evaluation trains without it. 1 or 0.
        pending.metrics.setdefault(TRAINING_METRIC, 1.0 if self.registry.model.training else 0.0)
        pieces: List[torch.Tensor] = []
        slots = Slots()

        def add(t: torch.Tensor) -> int:
            pieces.append(t)
            return slots.take(t.numel())

        if isinstance(loss, torch.Tensor):
            pending.loss_at = add(loss.detach().float().mean().reshape(1))
        elif loss is not None:
            pending.loss = float(loss)
        grad_base = add(self._grads) if self._grads is not None else 0
        stats_base = add(self._stats) if self._stats is not None else None
        if scaler_state is not None:
            pending.scaler_at = add(scaler_state)
        if self.hooks.input_absmax is not None:
            pending.input_at = add(self.hooks.input_absmax.reshape(1))
        if updates is not None and updates.stats is not None:
            pending.updates = UpdatesAt(
                list(updates.names), list(updates.numels), add(updates.stats.reshape(-1))
            )
        carried = self.hooks.carried
        if isinstance(carried, torch.Tensor):
            pending.carried_at = add(carried.reshape(1))
        elif carried is False:
            pending.carried = False
        if self.hooks.step_backwards > 1:
            # Several backward passes before one optimizer step: how many of the later
            # ones found the gradient reset (None, or zeroed in place).
            pending.resets = self.hooks.resets_seen
            zeroed = self.hooks.resets_zeroed
            if zeroed is not None:
                pending.resets_at = add(zeroed.reshape(1))
        nothing: List[Optional[int]] = [None] * len(self._modules)
        no_norms: List[Optional[int]] = []
        module_slot, norm_slot, module_numel = self._grad_meta or (nothing, no_norms, nothing)
        sums_at: Optional[int] = None
        if self.partial and self.fingerprint_every and step % self.fingerprint_every == 0:
            sums = param_sums(
                [p.tensor for p in self.registry.params], self._module_of, len(self._modules)
            )
            if sums is not None:
                sums_at = add(sums)
        hits = self.hooks.module_hits(self._module_of, len(self._modules))
        trainable = self._module_trainable()
        for m, name in enumerate(self._modules):
            if not trainable[m]:
                continue
            slot = module_slot[m]
            grad_sq = None if slot is None else grad_base + slot
            fingerprint = None if sums_at is None else sums_at + m
            pending.modules.append(ModuleAt(name, grad_sq, hits[m], module_numel[m], fingerprint))
        for k, n in enumerate(self._norms):
            grad = norm_slot[k] if k < len(norm_slot) else None
            stats = None if stats_base is None else stats_base + width(NormStats) * k
            inten = self._intended_slots.get(k)
            pending.norms.append(
                NormAt(
                    n.name,
                    None if grad is None else grad_base + grad,
                    stats,
                    None if inten is None or stats_base is None else stats_base + inten,
                    n.numel,
                )
            )
        if pieces:
            device = pieces[0].device
            wide = _wide(device)
            vector = torch.cat([p.to(device, wide, non_blocking=True) for p in pieces])
            if device.type == "cuda":
                host = torch.empty(vector.shape, dtype=wide, pin_memory=True)
                host.copy_(vector, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                pending.vector, pending.event = host, event
            else:
                pending.vector = vector
        self.reset()
        return pending

    def _module_trainable(self) -> List[bool]:
        trainable = [False] * len(self._modules)
        for p, m in zip(self.registry.params, self._module_of):
            if p.tensor.requires_grad:
                trainable[m] = True
        return trainable


def _wide(device: torch.device) -> torch.dtype:
    """The dtype of sums and of the vector brought to the host: f64, except on a
    device without it (Apple's MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _flat32(t: torch.Tensor) -> torch.Tensor:
    """This rank's elements of a parameter, flat, in f32."""
    return local(t).detach().reshape(-1).float()


def _norms(grads: List[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each tensor, in f32, as one vector (multi-tensor kernels)."""
    if any(g.is_sparse for g in grads):
        return torch.stack([g.coalesce().values().float().norm() for g in grads])
    return torch.stack(_torch_compat.foreach_norm(grads))


def _grad(t: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient, known to be there."""
    grad = t.grad
    assert grad is not None
    return grad
