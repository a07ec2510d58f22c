"""Per-step measurements on the device, brought to the host in one transfer.

Gradient norms are read in the optimizer's step pre-hook (after unscaling, before
anything can zero them; on a step the scaler skips, from its ``step`` wrapper), the
norm weights are snapshotted there and compared in the step post-hook, and at
``gf.step`` every piece is concatenated into one vector and copied to the host
(non-blocking into pinned memory on CUDA). The reporter thread waits for the copy
and turns the numbers into a step record, so the training thread never syncs.

Backward reaching a module is counted by ``register_post_accumulate_grad_hook`` on
its parameters: a host counter, no tensor work, and training stays bit-identical
(module full-backward hooks would change its numerics).

In a multi-rank run (``partial``) each rank measures the elements it holds (a
DTensor's local shard) and also sends each module's sum of squares, the elements it
covers and how many are not finite, and each parameter's element count: the server
adds the partial sums of sharded parameters across ranks and compares the copies of
replicated ones. Sums are taken in f64 (the vector brought to the host is f64; f32
on Apple's MPS, which has no f64).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import encode, intended, ranks
from .ranks import StepClock, is_dtensor, local
from .registration import Param, Registry


@dataclass
class _Norm:
    """A norm weight whose drift, update and intended update are reported."""

    name: str
    tensor: torch.Tensor
    init: torch.Tensor  # f32 copy at registration, for drift (of this rank's elements)
    group_index: Optional[int]  # optimizer parameter group, None when not in it
    numel: int  # elements this rank holds


@dataclass
class PendingStep:
    """One step's numbers (a device vector still being copied) and where each lies."""

    step: int
    time: float
    vector: Optional[torch.Tensor] = None
    event: Any = None
    loss: Optional[float] = None
    loss_slot: Optional[int] = None
    # (module, slot of its squared norm, hook hits, elements covered)
    modules: List[Tuple[str, Optional[int], Optional[int], Optional[int]]] = field(
        default_factory=list
    )
    # (parameter, gradient slot, stats slot, intended-update slot, elements held)
    norms: List[Tuple[str, Optional[int], Optional[int], Optional[int], int]] = field(
        default_factory=list
    )
    scaler_slot: Optional[int] = None
    lrs: Dict[str, float] = field(default_factory=dict)
    amend: Optional[Dict[str, Any]] = None
    graph_cuts: List[Dict[str, Any]] = field(default_factory=list)
    carried: Optional[bool] = None
    carried_slot: Optional[int] = None
    input_slot: Optional[int] = None
    update_names: List[str] = field(default_factory=list)
    update_numels: List[int] = field(default_factory=list)
    update_slot: Optional[int] = None
    metrics: Dict[str, Any] = field(default_factory=dict)
    # A multi-rank run (v1.4): the sending rank, the start and end of its own work
    # on the step (see ranks.StepClock), the partial sums.
    partial: bool = False
    rank: Optional[int] = None
    step_span: Optional[Tuple[Any, Any]] = None

    def values(self) -> List[float]:
        if self.vector is None:
            return []
        if self.event is not None:
            self.event.synchronize()
        return self.vector.tolist()

    def record(self) -> Dict[str, Any]:
        """The protocol's step record (runs on the reporter thread)."""
        v = self.values()
        rec: Dict[str, Any] = {"step": self.step, "time": self.time}
        if self.rank is not None:
            rec["rank"] = self.rank
        if self.step_span is not None:
            step_time = _step_time(self.step_span)
            if step_time is not None:
                rec["step_time"] = step_time
        loss = v[self.loss_slot] if self.loss_slot is not None else self.loss
        if loss is not None:
            rec["loss"] = encode.number(loss)
        if self.lrs:
            rec["lrs"] = self.lrs
            rec["lr"] = next(iter(self.lrs.values()))
        modules = []
        nonfinite = 0
        for name, slot, hits, numel in self.modules:
            entry: Dict[str, Any] = {"module": name}
            if slot is None:
                entry["grad_norm"] = None
            else:
                sq = v[slot]
                norm = sq**0.5 if sq >= 0 else float("nan")
                if norm != norm or norm == float("inf"):
                    nonfinite += 1
                entry["grad_norm"] = encode.norm(norm)
                if self.partial:
                    entry["grad_sumsq"] = encode.norm(sq)
                    if numel is not None:
                        entry["numel"] = numel
                        # A finite sum means every element is finite. A sum that is
                        # not may also be an overflow of finite elements: the count is
                        # then not known (it would take another pass over them).
                        if math.isfinite(sq):
                            entry["nonfinite"] = 0
            if hits is not None:
                entry["hook_hits"] = hits
            modules.append(entry)
        if modules:
            rec["modules"] = modules
            self.metrics.setdefault("grad_nonfinite_modules", float(nonfinite))
        params = []
        for name, grad_slot, stats_slot, intended_slot, held in self.norms:
            entry = {"name": name}
            if grad_slot is not None:
                entry["grad_norm"] = _root(v[grad_slot])
            if stats_slot is not None:
                update_sq, drift, mean = v[stats_slot : stats_slot + 3]
                entry["update_norm"] = _root(update_sq)
                entry["drift"] = encode.norm(drift)
                if held > 0:  # an empty shard has no mean
                    entry["mean"] = encode.number(mean)
            if intended_slot is not None:
                _intended_fields(entry, v[intended_slot : intended_slot + 4])
            if self.partial:
                entry["numel"] = held
            params.append(entry)
        if self.update_slot is not None:
            for i, name in enumerate(self.update_names):
                at = self.update_slot + 5 * i
                entry = {"name": name, "update_norm": _root(v[at])}
                if v[at + 1] == v[at + 1]:  # NaN: no intended update for this optimizer
                    _intended_fields(entry, v[at + 1 : at + 5])
                if self.partial and i < len(self.update_numels):
                    entry["numel"] = self.update_numels[i]
                params.append(entry)
        if params:
            rec["params"] = params
        if self.scaler_slot is not None:
            scale, tracker, found = v[self.scaler_slot : self.scaler_slot + 3]
            scaler: Dict[str, Any] = {"scale": encode.norm(scale)}
            if encode.count(tracker) is not None:
                scaler["growth_tracker"] = encode.count(tracker)
            if found == found:
                scaler["found_inf"] = found > 0
                scaler["step_skipped"] = found > 0
            rec["scaler"] = scaler
        if self.metrics:
            rec["metrics"] = _metrics(self.metrics)
        if self.amend:
            rec["amend"] = self.amend
        if self.graph_cuts:
            rec["graph_cuts"] = self.graph_cuts
        carried = self.carried
        if self.carried_slot is not None:
            probe = v[self.carried_slot]
            carried = None if probe != probe else probe > 0  # NaN: a non-finite gradient
        if carried is not None:
            rec["grads_carried_over"] = bool(carried)
        if self.input_slot is not None:
            rec["input_absmax"] = encode.norm(v[self.input_slot])
        return rec


class Measurer:
    """Everything measured for one step of one watched model."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        # Set for a multi-rank run: records carry the partial sums (see the module).
        self.partial = False
        # Set for a multi-rank run: times this rank's own work on each step.
        self.clock: Optional[StepClock] = None
        self.optimizer = registry.optimizer
        self._family = intended.family(self.optimizer) if self.optimizer is not None else None
        self._hits: Dict[int, int] = {}
        self._hooks: Dict[int, Any] = {}
        self._fresh: set = set()
        self._norms: List[_Norm] = []
        self._index_cache: Dict[Tuple[int, ...], Tuple[torch.Tensor, torch.Tensor]] = {}
        self._seg_cache: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}
        # Set by arm_backward_end: called once when the backward pass now running ends.
        self._at_backward_end: Optional[Callable[[], None]] = None
        # The carry-over probe: one parameter whose gradient is looked at just before
        # the first backward after each optimizer step (see arm_carry_probe).
        self._sentinel: Optional[torch.Tensor] = None
        self._sentinel_hook: Any = None
        self._probe_armed = False
        self._carried: Any = None  # None, False, or a device scalar (> 0: carried)
        # The largest |value| of the floating-point inputs of the watched model's
        # forward passes this step (a device scalar), and the hook that reads it.
        self._input_absmax: Optional[torch.Tensor] = None
        self._input_hook = registry.model.register_forward_pre_hook(
            self._on_model_input, with_kwargs=True
        )
        self.rebuild()
        self.reset()

    # -- structure ---------------------------------------------------------------

    def rebuild(self) -> None:
        """After registration or an amendment: modules, hooks, norm weights."""
        params = self.registry.params
        self._modules: List[str] = []
        index: Dict[str, int] = {}
        self._module_of: List[int] = []
        for p in params:
            if p.module not in index:
                index[p.module] = len(self._modules)
                self._modules.append(p.module)
            self._module_of.append(index[p.module])
        for p in params:
            self._hook(p)
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

    def _hook(self, p: Param) -> None:
        key = id(p.tensor)
        if key in self._hooks or not p.tensor.requires_grad:
            return
        register = getattr(p.tensor, "register_post_accumulate_grad_hook", None)
        if register is None:
            return
        hits = self._hits
        measurer = self
        cuda = p.tensor.device.type == "cuda"

        def hook(_tensor: torch.Tensor, key: int = key) -> None:
            hits[key] = hits.get(key, 0) + 1
            if measurer.clock is not None:
                measurer.clock.on_grad(cuda)
            if measurer._at_backward_end is not None:
                callback, measurer._at_backward_end = measurer._at_backward_end, None
                _queue_at_backward_end(callback)

        self._hooks[key] = register(hook)
        self._fresh.add(key)

    def arm_backward_end(self, callback: Callable[[], None]) -> None:
        """Runs `callback` once, when the next backward pass that reaches a watched
        parameter has finished: after every gradient of that pass is accumulated (and,
        under DistributedDataParallel, averaged), before the loop clips them."""
        self._at_backward_end = callback

    def remove_hooks(self) -> None:
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        if self._sentinel_hook is not None:
            self._sentinel_hook.remove()
            self._sentinel_hook = None
        if self._input_hook is not None:
            self._input_hook.remove()
            self._input_hook = None

    def _on_model_input(self, _module: Any, args: Any, kwargs: Any) -> None:
        """The step's largest input magnitude, on the device (a NaN propagates)."""
        try:
            if not torch.is_grad_enabled():
                return  # evaluation: not the batch the optimizer steps on
            if self.clock is not None:
                self.clock.on_forward()
            peaks = [
                t.detach().abs().amax().float() for t in float_inputs(args, kwargs) if t.numel() > 0
            ]
            if not peaks:
                return
            peak = torch.stack([p.to(peaks[0].device) for p in peaks]).amax()
            previous = self._input_absmax
            self._input_absmax = peak if previous is None else torch.maximum(previous, peak)
        except Exception:  # never break the forward pass
            self._input_absmax = None

    def arm_carry_probe(self) -> None:
        """After an optimizer step: look at one parameter's gradient just before the
        next backward pass adds to it. Still holding values then means nothing zeroed
        the gradients since the step (``grads_carried_over``). The look is a tensor
        hook that returns nothing (training unchanged) and, when the old gradient is
        there, one ``amax`` on the device, read with the step's other numbers."""
        sentinel = self._sentinel
        if sentinel is None or sentinel.grad is None or not sentinel.requires_grad:
            sentinel = self._pick_sentinel()
            if sentinel is not self._sentinel:
                if self._sentinel_hook is not None:
                    self._sentinel_hook.remove()
                    self._sentinel_hook = None
                self._sentinel = sentinel
                if sentinel is not None:
                    self._sentinel_hook = sentinel.register_hook(self._probe)
        self._probe_armed = self._sentinel is not None

    def _pick_sentinel(self) -> Optional[torch.Tensor]:
        """A parameter the optimizer steps that got a gradient this step (one outside
        the optimizer is never zeroed by it, which is another alert)."""
        membership = self.registry._membership()
        for p in self.registry.params:
            t = p.tensor
            # Not a DTensor: FSDP2's sharded parameters are not in the autograd graph
            # (their unsharded copies are), so a hook on one would never fire.
            if t.requires_grad and t.grad is not None and id(t) in membership and not is_dtensor(t):
                return t
        return None

    def _probe(self, _grad: torch.Tensor) -> None:
        if not self._probe_armed:
            return
        self._probe_armed = False
        try:
            old = self._sentinel.grad if self._sentinel is not None else None
            if old is None:
                self._carried = False
            else:
                self._carried = old.detach().abs().amax().float()
        except Exception:  # never break the backward pass
            self._carried = None

    def reset(self) -> None:
        self._grads: Optional[torch.Tensor] = None
        # (slot of each module, slot of each norm weight, elements of each module)
        self._grad_meta: Optional[
            Tuple[List[Optional[int]], List[Optional[int]], List[Optional[int]]]
        ] = None
        self._before: Optional[torch.Tensor] = None
        self._stats: Optional[torch.Tensor] = None
        self._intended_slots: Dict[int, int] = {}
        self._at_backward_end = None
        self._carried = None
        self._input_absmax = None
        self._hits.clear()
        self._fresh.clear()

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
        grad_of = {i: local(params[i].tensor.grad) for i in present}
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
        position = {id(params[i].tensor) for i in order}
        for k, n in enumerate(self._norms):
            if id(n.tensor) in position:
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
            pieces.extend(self._intended(before, after, 3 * count))
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
            if first.group_index is not None and first.group_index < len(groups):
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
                        self._intended_slots[k] = slot + 4 * (k - start)
                    slot += 4 * (end - start)
        return pieces

    # -- the step record ---------------------------------------------------------

    def collect(
        self,
        step: int,
        loss: Any,
        scaler_state: Optional[torch.Tensor],
        lrs: Dict[str, float],
        amend: Optional[Dict[str, Any]],
        metrics: Optional[Dict[str, Any]],
        updates: Optional[Tuple[List[str], Optional[torch.Tensor], List[int]]] = None,
    ) -> PendingStep:
        if not self.grads_measured:
            self.measure_grads()  # gf.step without an optimizer step: what is there now
        pending = PendingStep(
            step=step, time=time.time(), lrs=lrs, amend=amend, partial=self.partial
        )
        if metrics:
            pending.metrics.update(metrics)
        pieces: List[torch.Tensor] = []
        size = 0

        def add(t: torch.Tensor) -> int:
            nonlocal size
            pieces.append(t)
            at = size
            size += t.numel()
            return at

        if isinstance(loss, torch.Tensor):
            pending.loss_slot = add(loss.detach().float().mean().reshape(1))
        elif loss is not None:
            pending.loss = float(loss)
        grad_base = add(self._grads) if self._grads is not None else 0
        stats_base = add(self._stats) if self._stats is not None else None
        if scaler_state is not None:
            pending.scaler_slot = add(scaler_state)
        if self._input_absmax is not None:
            pending.input_slot = add(self._input_absmax.reshape(1))
        if updates is not None and updates[1] is not None:
            pending.update_names = list(updates[0])
            pending.update_numels = list(updates[2])
            pending.update_slot = add(updates[1].reshape(-1))
        if isinstance(self._carried, torch.Tensor):
            pending.carried_slot = add(self._carried.reshape(1))
        elif self._carried is False:
            pending.carried = False
        nothing: List[Optional[int]] = [None] * len(self._modules)
        module_slot, norm_slot, module_numel = self._grad_meta or (nothing, [], nothing)
        hits = self._module_hits()
        trainable = self._module_trainable()
        for m, name in enumerate(self._modules):
            if not trainable[m]:
                continue
            slot = module_slot[m]
            pending.modules.append(
                (name, None if slot is None else grad_base + slot, hits[m], module_numel[m])
            )
        for k, n in enumerate(self._norms):
            grad = norm_slot[k] if k < len(norm_slot) else None
            stats = None if stats_base is None else stats_base + 3 * k
            inten = self._intended_slots.get(k)
            pending.norms.append(
                (
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

    def _module_hits(self) -> List[Optional[int]]:
        """Per module the most hits of any of its parameters; unknown (None) when a
        parameter's hook was registered after this step's backward."""
        hits: List[Optional[int]] = [0] * len(self._modules)
        for p, m in zip(self.registry.params, self._module_of):
            if not p.tensor.requires_grad:
                continue
            key = id(p.tensor)
            if key in self._fresh or key not in self._hooks or hits[m] is None:
                hits[m] = None
                continue
            hits[m] = max(hits[m], self._hits.get(key, 0))  # type: ignore[type-var]
        return hits


def _step_time(span: Tuple[Any, Any]) -> Optional[float]:
    """The seconds of a rank's own work on the step; None, never a lost record, when
    they cannot be read."""
    try:
        seconds = ranks.elapsed(*span)
    except Exception:
        return None
    return seconds if seconds is not None and math.isfinite(seconds) else None


def _wide(device: torch.device) -> torch.dtype:
    """The dtype of sums and of the vector brought to the host: f64, except on a
    device without it (Apple's MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _flat32(t: torch.Tensor) -> torch.Tensor:
    """This rank's elements of a parameter, flat, in f32."""
    return local(t).detach().reshape(-1).float()


def _root(square: float) -> Any:
    """The norm whose square a reduction produced; NaN (never a negative norm) when the
    reduction did not give a non-negative number."""
    return encode.norm(square**0.5 if square >= 0 else float("nan"))


def _intended_fields(entry: Dict[str, Any], summary: List[float]) -> None:
    """A parameter's intended-update fields from its [|u|², max ratio to the ulp,
    #u≠0, #rounded away] summary (`intended.summary`); the counts only when they are
    consistent."""
    sq, ratio, nonzero, rounded = summary
    entry["intended_update_norm"] = _root(sq)
    entry["intended_update_max_ulp"] = encode.norm(ratio)
    nz, ra = encode.count(nonzero), encode.count(rounded)
    if nz is not None and ra is not None and ra <= nz:
        entry["intended_nonzero"] = nz
        entry["rounded_away"] = ra


def float_inputs(args: Any, kwargs: Dict[str, Any]) -> List[torch.Tensor]:
    """The floating-point tensors among a forward's arguments (one level into tuples,
    lists and dicts)."""
    found: List[torch.Tensor] = []
    for value in list(args) + list(kwargs.values()):
        items = value.values() if isinstance(value, dict) else value
        if not isinstance(value, (dict, tuple, list)):
            items = [value]
        found.extend(t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point())
    return found


def _queue_at_backward_end(callback: Callable[[], None]) -> None:
    """Queues `callback` on the autograd engine's final callbacks of the running
    backward pass. It queues itself once more when it first runs, so that it comes after
    the callbacks others (DistributedDataParallel's reducer) queued after it."""
    engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]

    def again() -> None:
        engine.queue_callback(callback)

    engine.queue_callback(again)


def _norms(grads: List[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each tensor, in f32, as one vector (multi-tensor kernels)."""
    if any(g.is_sparse for g in grads):
        return torch.stack([g.coalesce().values().float().norm() for g in grads])
    try:
        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
    except (TypeError, RuntimeError):
        return torch.stack(torch._foreach_norm(grads)).float()


def _metrics(metrics: Dict[str, Any]) -> Dict[str, Any]:
    """User metrics as the protocol takes them: numbers (a 1-element tensor is read
    here, on the reporter thread), null for None; anything else is left out."""
    out: Dict[str, Any] = {}
    for name, value in metrics.items():
        if value is None:
            out[str(name)] = None
            continue
        try:
            out[str(name)] = encode.number(float(value))
        except (TypeError, ValueError, RuntimeError):
            continue
    return out
