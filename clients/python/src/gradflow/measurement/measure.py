"""Per-step measurements on the device, brought to the host in one transfer.

Gradient norms are read in the optimizer's step pre-hook (after unscaling, before
anything can zero them; on a step the scaler skips, from its ``step`` wrapper): one
``torch._foreach_norm`` per dtype, each parameter's norm kept as it is, the squares
summed per module on the host; on a CPU, under one of torch's optimizers, taken on a
worker thread while the optimizer steps (:mod:`gradflow.measurement.overlap`). The
norm weights are snapshotted there and compared in the step post-hook on the steps
the capture layer asks for (not every reported step:
``Instruments._norm_weights_due``; a record without their numbers did not measure
them), and at ``gf.step`` every piece is concatenated into one vector and
copied to the host (non-blocking into pinned memory on CUDA). The reporter thread
waits for the copy and turns the numbers into a step record (:mod:`gradflow.measurement.record`),
with the record's per-module and per-weight entries (:func:`describe`), so the
training thread never syncs and builds no per-module object. What the hooks on the
model see during the step (hook hits, the input peak, the carry-over probe) comes from
:mod:`gradflow.capture.hooks`.

In a multi-rank run (``partial``) each rank measures the elements it holds (a
DTensor's local shard) and also sends each module's sum of squares, the elements it
covers and how many are not finite, and each parameter's element count: the server
adds the partial sums of sharded parameters across ranks and compares the copies of
replicated ones. Sums are taken in f64 (the vector brought to the host is f64; f32
on Apple's MPS, which has no f64).
"""

from __future__ import annotations

import functools
import operator
import time
from collections import Counter
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    List,
    Optional,
    Protocol,
    Set,
    Tuple,
    Union,
    cast,
)

import torch

from .. import _torch_compat, wire
from . import gradless, intended, modes, step_signals, vector
from .overlap import StepWorker
from .ranks import StepClock, is_dtensor, local, param_sums
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
from .registration import Registry, StepSeen, seen_during_step
from .step_signals import StepSignals
from .updates import Updates
from .vector import Deferred, Piece


@dataclass
class _Norm:
    """A norm weight whose drift, update and intended update are reported."""

    name: str
    tensor: torch.Tensor
    init: torch.Tensor  # f32 copy at registration, for drift (of this rank's elements)
    group_index: Optional[int]  # optimizer parameter group, None when not in it
    numel: int  # elements this rank holds


# On a CPU, 1-D gradients of at most this many elements (biases, norm weights) are
# concatenated and reduced together: copying them costs less than the ~2 µs of a
# norm's own dispatch each (a CPU has no multi-tensor kernel: ``_foreach_norm`` loops
# over per-tensor norms there).
SMALL_ON_CPU = 8192

_GRAD = operator.attrgetter("grad")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_IS_NONE = functools.partial(operator.is_, None)


@dataclass(frozen=True)
class NormGroup:
    """Gradients whose norms are taken in one call: positions `members` of the step's
    gradients (None: all of them, in order), by ``_foreach_norm``, or, with `ids`
    (on a CPU), concatenated and summed by segment (`ids`: each element's segment,
    `count` of them)."""

    members: Optional[List[int]]
    ids: Optional[torch.Tensor] = None
    count: int = 0


@dataclass(frozen=True)
class GradLayout:
    """Where each parameter's gradient norm lies in `Measurer._grads`, for one set of
    parameters with gradients (built once per set, not every step)."""

    # The calls that take the norms; their results follow one another in the norms
    # vector, in this order.
    groups: List[NormGroup]
    device: Optional[torch.device]
    # Per module, the positions of its parameters' norms (None: no gradient), and the
    # gradient elements they cover.
    module_grads: List[Optional[Tuple[int, ...]]]
    module_numel: List[Optional[int]]
    norm_grad: List[Optional[int]]  # per norm weight, its norm's position
    # Every gradient on the CPU: their norms may be taken on the worker thread.
    cpu_only: bool = False


# What the worker hands back when it read the gradients itself: what the
# registration check compares, their layout and their norms.
_ReadOnWorker = Tuple[StepSeen, GradLayout, Optional[List[Piece]]]


@dataclass(frozen=True)
class Shape:
    """What a record's entries are made of between two rebuilds: the modules, which
    of them train, the hooked parameters of each, and the norm weights."""

    modules: List[str]
    trainable: List[bool]
    # Per trainable parameter: (its module, its hook key, whether it has a hook).
    hooked: List[Tuple[int, int, bool]]
    norm_names: List[str]
    norm_numels: List[int]


class StepHooks(Protocol):
    """What the measurer reads of the hooks on the model
    (:class:`gradflow.capture.hooks.ModelHooks`, which the capture layer attaches):
    backward's reach, the carry-over probe, the input peak and a multi-rank run's
    clock. Declared here so that measuring depends on this, not on the hooks."""

    @property
    def clock(self) -> Optional[StepClock]: ...

    @property
    def carried(self) -> object: ...

    @property
    def input_absmax(self) -> Optional[torch.Tensor]: ...

    @property
    def step_backwards(self) -> int: ...

    @property
    def resets_seen(self) -> int: ...

    @property
    def resets_zeroed(self) -> Optional[torch.Tensor]: ...

    @property
    def fresh(self) -> Set[int]: ...

    def rebuild(self) -> None: ...

    def hooked(self) -> Set[int]: ...

    def reset(self) -> None: ...

    def local_grads_finite(self) -> Optional[torch.Tensor]: ...

    def take_reached(self) -> List[torch.Tensor]: ...


class Measurer:
    """Everything measured on the device for one step of one watched model."""

    def __init__(self, registry: Registry, hooks: StepHooks) -> None:
        self.registry = registry
        # The model's modules that read the training flag, found again whenever the
        # registry rescans (a new list of parameters).
        self._modes_of: Optional[List[Any]] = None
        self._mode_dependent: List[Any] = []
        self.hooks = hooks
        # Set for a multi-rank run: records carry the partial sums (see the module).
        self.partial = False
        # Multi-rank: every how many steps each module's weights are summed, the
        # replicas' fingerprint (0: never).
        self.fingerprint_every = 0
        self._gradless = gradless.GradlessSums()
        self.optimizer = registry.optimizer
        self._family = intended.family(self.optimizer) if self.optimizer is not None else None
        self._norms: List[_Norm] = []
        self._norm_tensors: List[torch.Tensor] = []
        self._layouts: Dict[Tuple[int, ...], GradLayout] = {}
        self._tensors: List[torch.Tensor] = []
        self._sharded = False
        self._shape = Shape([], [], [], [], [])
        # The norm weights' element count when all hold as many (reductions by row).
        self._norm_width = 0
        self._seg_cache: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}
        self._modules: List[str] = []
        self._module_of: List[int] = []
        self._norm_init: Optional[torch.Tensor] = None
        # This step's numbers so far, on the device: the gradient norms in pieces
        # that follow one another (one stacked vector, except on a CPU: see
        # group_norms).
        self._grads: Optional[List[Piece]] = None
        self._grad_layout: Optional[GradLayout] = None
        self._before: Optional[torch.Tensor] = None
        self._stats: Optional[Piece] = None
        # Per run of norm weights with an intended update: (first, end, its slot in
        # the stats), each weight's slot then following (see describe).
        self._intended_runs: List[Tuple[int, int, int]] = []
        # Set where the optimizer leaves the gradients alone during its step: a CPU's
        # norms are then taken on a worker while it steps (measure_grads_during_step).
        self.worker: Optional[StepWorker] = None
        self._during_step = False
        # Whether the worker reads the gradients themselves this step, and what it
        # saw of them, for the registration check (measure_grads_during_step).
        self._reading_on_worker = False
        self._grads_seen: Optional[StepSeen] = None
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
        self._norm_tensors = [n.tensor for n in norms]
        self._norm_init = torch.cat([n.init for n in norms]) if norms else None
        widths = {n.numel for n in norms}
        self._norm_width = widths.pop() if len(widths) == 1 else 0
        # The runs of one optimizer group and dtype, and where each weight starts.
        self._runs = intended.runs([n.tensor for n in norms], [n.group_index for n in norms])
        self._run_states = (
            [intended.States(self.optimizer, self._norm_tensors[a:b]) for a, b in self._runs]
            if self.optimizer is not None
            else []
        )
        self._offsets = [0]
        for n in norms:
            self._offsets.append(self._offsets[-1] + n.numel)
        self._tensors = [p.tensor for p in params]
        self._every_index = list(range(len(self._tensors)))
        self._every_key = tuple(self._every_index)
        self._sharded = any(is_dtensor(t) for t in self._tensors)
        self._norms_on_cpu = not self._sharded and all(
            t.device.type == "cpu" for t in self._norm_tensors
        )
        self._params_on_cpu = not self._sharded and all(
            t.device.type == "cpu" for t in self._tensors
        )
        self._shape = self._read_shape()
        self._layouts.clear()
        self._seg_cache.clear()
        self._gradless.clear()
        # Anything measured against the old layout is dropped; collect() measures the
        # gradients again if they are still there.
        self._drop_measured()

    def _read_shape(self) -> Shape:
        trainable = [False] * len(self._modules)
        hooked = []
        handles = self.hooks.hooked()
        for p, m in zip(self.registry.params, self._module_of):
            if p.tensor.requires_grad:
                trainable[m] = True
                key = id(p.tensor)
                hooked.append((m, key, key in handles))
        return Shape(
            list(self._modules),
            trainable,
            hooked,
            [n.name for n in self._norms],
            [n.numel for n in self._norms],
        )

    def reset(self) -> None:
        """A new step: nothing measured yet."""
        self._drop_measured()
        self.hooks.reset()
        self.registry.release_signature()

    def _drop_measured(self) -> None:
        """Forgets what was measured of the step (and what the worker took of it)."""
        if self.worker is not None:
            self.worker.discard()
        self._reading_on_worker = False
        self._grads_seen = None
        self._grads = None
        self._grad_layout = None
        self._before = None
        self._stats = None
        self._intended_runs = []

    @property
    def grads_measured(self) -> bool:
        return self._grad_layout is not None or self._reading_on_worker

    # -- the optimizer step ------------------------------------------------------

    def measure_grads(self) -> None:
        """Per-parameter gradient norms (foreach, in f32) of the elements this rank
        holds, left on the device; the record sums their squares per module in f64.
        Per parameter, only a C-level ``map`` reads the gradients and one
        comprehension keeps those there; on a CPU the norms are not even stacked here
        (the reporter thread assembles the step's numbers: :mod:`gradflow.measurement.vector`)."""
        every = self.registry.take_grads(self._tensors)
        if every is None:
            every = list(map(_GRAD, self._tensors))
        layout, grads = self._present(every)
        worker = self.worker
        if grads and self._during_step and worker is not None and layout.cpu_only:
            worker.start(functools.partial(group_norms, layout), grads)
            self._grads = None
        else:
            self._grads = group_norms(layout, grads) if grads else None
        self._grad_layout = layout

    def _present(
        self, every: List[Optional[torch.Tensor]]
    ) -> Tuple[GradLayout, List[torch.Tensor]]:
        """The layout of the gradients `every` parameter holds (None: none), and the
        gradients measured: those of the trainable parameters, this rank's part."""
        trainable = self.registry.requires_grad
        if trainable is None or len(trainable) != len(every):
            trainable = tuple(map(_REQUIRES_GRAD, self._tensors))
        if self.registry.all_trainable and len(trainable) == len(every):
            if any(map(_IS_NONE, every)):
                present = [i for i, g in enumerate(every) if g is not None]
            else:
                present = self._every_index  # the usual step: a C-level check only
        else:
            present = [i for i, g in enumerate(every) if g is not None and trainable[i]]
        if not present:
            return self._no_grads(), []
        # Only gradients that are there (present).
        grads = cast(
            List[torch.Tensor],
            every if len(present) == len(every) else [every[i] for i in present],
        )
        if self._sharded:
            grads = [local(g) for g in grads]
        key = self._every_key if present is self._every_index else tuple(present)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layout(present, grads)
        return layout, grads

    def reads_grads_on_worker(self) -> bool:
        """Whether the gradients themselves can be read on the worker while the
        optimizer steps (:meth:`measure_grads_during_step`): every parameter on the
        CPU, so that their gradients' norms are the worker's to take."""
        return self.worker is not None and self._params_on_cpu

    def measure_grads_during_step(self, read_on_worker: bool = False) -> None:
        """:meth:`measure_grads` from the optimizer's pre-step hook, of an optimizer
        that leaves the gradients alone: on a CPU the norms are taken on a worker
        while the optimizer steps, and :meth:`settle_grads` (its post-step hook)
        waits for them (:mod:`gradflow.measurement.overlap`). `read_on_worker`: the
        worker reads the gradients too (see :meth:`reads_grads_on_worker`), and
        :meth:`take_grads_seen` hands what it saw to the registration check."""
        if read_on_worker and self.worker is not None:
            self._reading_on_worker = True
            self.worker.start(self._read_and_norm, self._tensors)
            return
        self._during_step = True
        try:
            self.measure_grads()
        finally:
            self._during_step = False

    def _read_and_norm(self, tensors: List[torch.Tensor]) -> _ReadOnWorker:
        """On the worker: what the registration check compares of `tensors` and the
        gradients they hold, and those gradients' layout and norms."""
        every = list(map(_GRAD, tensors))
        layout, grads = self._present(every)
        return (
            seen_during_step(tensors, every),
            layout,
            group_norms(layout, grads) if grads else None,
        )

    def take_grads_seen(self) -> Optional[StepSeen]:
        """What the worker saw of the gradients and parameters during the optimizer
        step (:func:`gradflow.measurement.registration.seen_during_step`), once, after
        :meth:`settle_grads`; None when it read none."""
        seen, self._grads_seen = self._grads_seen, None
        return seen

    def _in_training_mode(self) -> bool:
        params = self.registry.params
        if self._modes_of is not params:
            self._modes_of = params
            self._mode_dependent = modes.mode_dependent(self.registry.model)
        return modes.computes_in_training_mode(self.registry.model, self._mode_dependent)

    def settle_grads(self) -> None:
        """The norms the worker took, once it has them (the optimizer's post-step
        hook: before user code can change the gradients)."""
        if self.worker is not None and self.worker.pending:
            result = self.worker.finish()
            if self._reading_on_worker:
                self._reading_on_worker = False
                self._grads_seen, self._grad_layout, self._grads = result
            else:
                self._grads = result

    def _no_grads(self) -> GradLayout:
        """The layout of a step with no gradient measured."""
        return GradLayout(
            [],
            None,
            [None] * len(self._modules),
            [None] * len(self._modules),
            [None] * len(self._norms),
        )

    def _layout(self, present: List[int], grads: List[torch.Tensor]) -> GradLayout:
        """Where each gradient's norm goes, for this set of parameters with gradients."""
        by_kind: Dict[Tuple[torch.device, torch.dtype], List[int]] = {}
        for k, g in enumerate(grads):
            by_kind.setdefault((g.device, g.dtype), []).append(k)
        groups: List[NormGroup] = []
        cpu = grads[0].device.type == "cpu"
        for (device, _dtype), kind in by_kind.items():
            small = [k for k in kind if cpu and device.type == "cpu" and _small(grads[k])]
            if len(small) < 2:
                groups.append(NormGroup(kind))
                continue
            taken = set(small)
            rest = [k for k in kind if k not in taken]
            if rest:
                groups.append(NormGroup(rest))
            sizes = torch.tensor([grads[k].numel() for k in small])
            ids = torch.repeat_interleave(torch.arange(len(small)), sizes)
            groups.append(NormGroup(small, ids, len(small)))
        if len(groups) == 1 and groups[0].ids is None:
            groups = [NormGroup(None)]  # one call over every gradient, in order
        order = [k for g in groups for k in (g.members or range(len(grads)))]
        positions: Dict[int, int] = {present[k]: at for at, k in enumerate(order)}
        members: List[List[int]] = [[] for _ in self._modules]
        numel: List[Optional[int]] = [None] * len(self._modules)
        for at, k in enumerate(order):
            m = self._module_of[present[k]]
            members[m].append(at)
            numel[m] = (numel[m] or 0) + int(grads[k].numel())
        index = {id(self._tensors[i]): i for i in present}
        norm_grad: List[Optional[int]] = []
        for n in self._norms:
            i = index.get(id(n.tensor))
            norm_grad.append(None if i is None else positions[i])
        layout = GradLayout(
            groups,
            grads[0].device,
            [tuple(sorted(m)) if m else None for m in members],
            numel,
            norm_grad,
            all(device.type == "cpu" for device, _ in by_kind),
        )
        if len(self._layouts) > 32:
            # The set of parameters with gradients varies (mixture of experts): keep
            # the cache from growing without bound.
            self._layouts.clear()
        self._layouts[tuple(present)] = layout
        return layout

    def _gradless_sums(self) -> Tuple[FrozenSet[int], Optional[torch.Tensor]]:
        """The weights' fingerprint of the trainable modules without a gradient this
        step (:mod:`gradflow.measurement.gradless`), and which they are."""
        layout = self._grad_layout
        if layout is None:
            return frozenset(), None
        return self._gradless.take(
            layout, layout.module_grads, self._shape.trainable, self._tensors, self._module_of
        )

    def snapshot_norms(self) -> None:
        if self._norms:
            self._before = self._flat_norms()

    def _flat_norms(self) -> torch.Tensor:
        """Every norm weight's elements this rank holds, one weight after another, in
        f32: one concatenation and one cast (a copy), not three operations a weight."""
        if self._sharded:
            return torch.cat([_flat32(n.tensor) for n in self._norms])
        return intended.local_flat(self._norm_tensors, False).float()

    def after_step(self) -> None:
        """Update, drift and mean of the norm weights, and what the optimizer meant.
        Here, on the training thread: the weights after the step, copied (user code
        may change them in place before ``gf.step``), and the optimizer state they need
        (the next step overwrites it in place), copied here or by the worker. The
        arithmetic (~40 small operations) runs here on a device, and on the reporter
        thread on a CPU (:class:`Deferred`)."""
        if not self._norms or self._before is None:
            return
        before = self._before
        self._before = None
        after = self._flat_norms()
        if after.shape != before.shape or self._norm_init is None:
            return  # a norm weight was replaced or resized since the snapshot
        device = after.device
        count = len(self._norms)
        segments = None if self._norm_width else self._segments(0, count, device)
        plans, numel = self._intended_plans(width(NormStats) * count)
        compute = functools.partial(
            _norm_stats,
            before,
            after,
            self._norm_init.to(device, non_blocking=True),
            count,
            self._norm_width,
            segments,
            plans,
        )
        self._stats = Deferred(numel, device, compute) if device.type == "cpu" else compute()

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

    def _intended_plans(self, base: int) -> Tuple[List[_IntendedPlan], int]:
        """Per run of norm weights whose optimizer state allows it, what its intended
        update is computed from (copied now, or by the worker: see
        :meth:`_intended_inputs`), and where its summary goes; the stats' size with
        them."""
        plans: List[_IntendedPlan] = []
        self._intended_runs = []
        slot = base
        if self._family is None:
            return plans, slot
        offsets = self._offsets
        groups = self.optimizer.param_groups
        tensors = self._norm_tensors
        for run, (start, end) in enumerate(self._runs):
            first = self._norms[start]
            if first.group_index is None or first.group_index >= len(groups):
                continue
            given = self._intended_inputs(groups[first.group_index], tensors[start:end], run)
            if given is None:
                continue
            lengths = (
                None if self._norm_width else [self._norms[k].numel for k in range(start, end)]
            )
            plans.append(
                _IntendedPlan(
                    offsets[start], offsets[end], given, first.tensor.dtype, lengths, end - start
                )
            )
            self._intended_runs.append((start, end, slot))
            slot += width(Intended) * (end - start)
        return plans, slot

    def _intended_inputs(
        self, group: Dict[str, Any], tensors: List[torch.Tensor], run: int
    ) -> Union[intended.Inputs, Callable[[], intended.Inputs], None]:
        """A run's intended-update inputs: copied now, or, on a CPU under one of
        torch's Adams, by the worker before the next optimizer step (the moments
        change only there; :mod:`gradflow.measurement.overlap`), what gives them."""
        states = self._run_states[run]
        worker = self.worker
        if self._family == "adam" and worker is not None and self._norms_on_cpu:
            if not states.all_hold("exp_avg"):
                return None
            later = intended.adam_later(self.optimizer, group, states.get(), False, checked=True)
            return None if later is None else worker.until_next_step(later)
        assert self._family is not None
        return intended.inputs(self._family, self.optimizer, group, tensors, self._sharded, states)

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
        signals: Optional[StepSignals] = None,
    ) -> PendingStep:
        """This step's pending record: every device number in one vector, on its way
        to the host, and where each lies."""
        self.settle_grads()
        if not self.grads_measured:
            self.measure_grads()  # gf.step without an optimizer step: what is there now
        pending = PendingStep(
            step=step, time=time.time(), lrs=lrs, amend=amend, partial=self.partial
        )
        if metrics:
            pending.metrics.update(metrics)
        # Whether the model computed in training mode at gf.step (dropout on): a model
        # left in eval() after an evaluation trains without it. 1 or 0.
        pending.metrics.setdefault(TRAINING_METRIC, 1.0 if self._in_training_mode() else 0.0)
        pieces: List[Piece] = []
        slots = Slots()

        # A piece may be a device scalar: it is flattened where the vector is
        # assembled (vector.flat), on the reporter thread on a CPU, not here.
        def add(t: Piece) -> int:
            pieces.append(t)
            return slots.take(vector.numel(t))

        if isinstance(loss, torch.Tensor):
            pending.loss_at = add(_loss_piece(loss))
        elif loss is not None:
            pending.loss = float(loss)
        grad_slots = [add(piece) for piece in self._grads or ()]
        grad_base = grad_slots[0] if grad_slots else 0
        stats_base = add(self._stats) if self._stats is not None else None
        if scaler_state is not None:
            pending.scaler_at = add(scaler_state)
        if self.hooks.input_absmax is not None:
            pending.input_at = add(self.hooks.input_absmax)
        if updates is not None and updates.stats is not None:
            pending.updates = UpdatesAt(
                list(updates.names), list(updates.numels), add(updates.stats)
            )
        carried = self.hooks.carried
        if isinstance(carried, torch.Tensor):
            pending.carried_at = add(carried)
        elif carried is False:
            pending.carried = False
        local_finite = self.hooks.local_grads_finite()
        if local_finite is not None:
            pending.local_finite_at = add(local_finite)
        if self.hooks.step_backwards > 1:
            # Several backward passes before one optimizer step: how many of the later
            # ones found the gradient reset (None, or zeroed in place).
            pending.resets = self.hooks.resets_seen
            zeroed = self.hooks.resets_zeroed
            if zeroed is not None:
                pending.resets_at = add(zeroed)
        if signals is not None and not signals.empty():
            pending.signals = step_signals.place(signals, add)
        sums_at: Optional[int] = None
        summed: Optional[FrozenSet[int]] = None  # the modules summed (None: every one)
        if self.fingerprint_every and step % self.fingerprint_every == 0:
            if self.partial:
                sums = param_sums(
                    [p.tensor for p in self.registry.params], self._module_of, len(self._modules)
                )
            else:
                summed, sums = self._gradless_sums()
            if sums is not None:
                sums_at = add(sums)
        # The record's module and norm weight entries are made on the reporter thread,
        # from this step's hook hits (copied: the hooks count the next step in place).
        pending.describe = functools.partial(
            describe,
            self._shape,
            self._grad_layout,
            grad_base,
            stats_base,
            list(self._intended_runs),
            sums_at,
            summed,
            self.hooks.take_reached(),
            set(self.hooks.fresh) if self.hooks.fresh else _NONE,
        )
        if pieces:
            pending.vector, pending.event = vector.to_host(pieces)
        self.reset()
        return pending


_NONE: Set[int] = frozenset()  # type: ignore[assignment]


@dataclass(frozen=True)
class _IntendedPlan:
    """A run of norm weights' intended update: elements [start, end) of the flat
    weights, what the update is computed from, their dtype, and each weight's length
    (None: all as long)."""

    start: int
    end: int
    given: Union[intended.Inputs, Callable[[], intended.Inputs]]  # a call: copied later
    dtype: torch.dtype
    lengths: Optional[List[int]]
    count: int


def _norm_stats(
    before: torch.Tensor,
    after: torch.Tensor,
    init: torch.Tensor,
    count: int,
    rows: int,
    segments: Optional[Tuple[torch.Tensor, torch.Tensor]],
    plans: List[_IntendedPlan],
) -> torch.Tensor:
    """The norm weights' :class:`NormStats` one weight after another, then each plan's
    :class:`Intended` summaries: arithmetic on copies, on any thread. `rows`: the
    elements of every weight when all hold as many (reduced as a matrix's rows), else
    0 and `segments` (each element's weight, each weight's size)."""
    diff = after - before
    away = (after - init).abs()
    if rows:
        diff = diff.view(count, rows)
        away = away.view(count, rows)
        update_sq = (diff * diff).sum(1)
        # A NaN in a row is kept (amax over NaN is not reliable across devices).
        drift = away.amax(1) + away.sum(1) * 0.0
        mean = after.view(count, rows).mean(1)
    else:
        assert segments is not None
        ids, sizes = segments
        zeros = torch.zeros(count, device=after.device)
        update_sq = zeros.index_add(0, ids, diff * diff)
        drift = zeros.scatter_reduce(0, ids, away, "amax", include_self=False)
        drift = drift + zeros.index_add(0, ids, away) * 0.0
        mean = zeros.index_add(0, ids, after) / sizes
    pieces = [torch.stack([update_sq, drift, mean], dim=1).reshape(-1)]
    for plan in plans:
        was, now = before[plan.start : plan.end], after[plan.start : plan.end]
        given = plan.given() if callable(plan.given) else plan.given
        upd = intended.apply(given, was)
        summary = intended.summary(upd, was, now, plan.dtype, plan.lengths, plan.count)
        pieces.append(summary.reshape(-1))
    return torch.cat(pieces)


def describe(
    shape: Shape,
    layout: Optional[GradLayout],
    grad_base: int,
    stats_base: Optional[int],
    intended_runs: List[Tuple[int, int, int]],
    sums_at: Optional[int],
    summed: Optional[FrozenSet[int]],
    reached: List[Any],
    fresh: Set[int],
) -> Tuple[List[ModuleAt], List[NormAt]]:
    """A step's module and norm weight entries, and where their numbers lie (on the
    reporter thread: nothing here runs a torch operation or reads the live model).
    `reached`: the parameters backward reached, once per time (the hooks' list)."""
    hits = count_hits(reached)
    intended_slots = {
        k: slot + width(Intended) * (k - start)
        for start, end, slot in intended_runs
        for k in range(start, end)
    }
    count = len(shape.modules)
    module_hits: List[Optional[int]] = [0] * count
    for m, key, hooked in shape.hooked:
        seen = module_hits[m]
        if seen is None or not hooked or key in fresh:
            # A parameter whose hook was registered after this step's backward.
            module_hits[m] = None
            continue
        module_hits[m] = max(seen, hits.get(key, 0))
    module_grads = layout.module_grads if layout is not None else [None] * count
    module_numel = layout.module_numel if layout is not None else [None] * count
    norm_grad = layout.norm_grad if layout is not None else []
    modules = []
    for m, name in enumerate(shape.modules):
        if not shape.trainable[m]:
            continue
        grads = module_grads[m]
        modules.append(
            ModuleAt(
                name,
                None if grads is None else [grad_base + at for at in grads],
                module_hits[m],
                module_numel[m],
                None
                if sums_at is None or (summed is not None and m not in summed)
                else sums_at + m,
            )
        )
    norms = []
    for k, name in enumerate(shape.norm_names):
        grad = norm_grad[k] if k < len(norm_grad) else None
        inten = intended_slots.get(k)
        norms.append(
            NormAt(
                name,
                None if grad is None else grad_base + grad,
                None if stats_base is None else stats_base + width(NormStats) * k,
                None if inten is None or stats_base is None else stats_base + inten,
                shape.norm_numels[k],
            )
        )
    return modules, norms


def _loss_piece(loss: torch.Tensor) -> Piece:
    """The loss's mean as one number: on a CPU taken on the reporter thread, the loss
    detached there too (even a ``detach`` costs ~40 µs on the training thread right
    after the step, when torch's code is out of the caches; the graph's buffers are
    gone after backward, what it keeps until then is its nodes), elsewhere on the
    device now."""
    if loss.is_cpu:
        return Deferred(1, _CPU, functools.partial(_loss_mean, loss))
    return _loss_mean(loss)


def _loss_mean(loss: torch.Tensor) -> torch.Tensor:
    return loss.detach().float().mean().reshape(1)


_CPU = torch.device("cpu")


def _flat32(t: torch.Tensor) -> torch.Tensor:
    """This rank's elements of a parameter, flat, in f32."""
    return local(t).detach().reshape(-1).float()


def _small(g: torch.Tensor) -> bool:
    return g.dim() == 1 and g.numel() <= SMALL_ON_CPU and not g.is_sparse


def group_norms(layout: GradLayout, grads: List[torch.Tensor]) -> List[Piece]:
    """The norms of `grads` by `layout`'s groups, as pieces of the step's vector: on a
    CPU left as they come (0-dim norms, or a group's vector in f64); elsewhere
    stacked, as one f32 vector on the layout's device."""
    cpu = layout.device is not None and layout.device.type == "cpu"
    pieces: List[Piece] = []
    for group in layout.groups:
        members = grads if group.members is None else [grads[k] for k in group.members]
        if group.ids is not None:
            flat = torch.cat(members).double()
            sums = torch.zeros(group.count, dtype=flat.dtype).index_add_(0, group.ids, flat * flat)
            pieces.append(sums.sqrt())
        elif cpu:
            pieces.append(_norms(members))
        else:
            pieces.append(torch.stack(_norms(members)).to(layout.device, non_blocking=True))
    if not cpu and len(pieces) > 1:
        return [torch.cat([p for p in pieces if isinstance(p, torch.Tensor)])]
    return pieces


def _norms(grads: List[torch.Tensor]) -> List[torch.Tensor]:
    """The L2 norm of each tensor, in f32 (multi-tensor kernels): 0-dim tensors."""
    try:
        return _torch_compat.foreach_norm(grads)
    except (RuntimeError, NotImplementedError):
        if not any(g.is_sparse for g in grads):
            raise
    # A sparse gradient (an embedding's with sparse=True): its stored values' norm.
    return [(g.coalesce().values() if g.is_sparse else g).float().norm() for g in grads]


def count_hits(reached: List[Any]) -> Dict[int, int]:
    """Hook hits by parameter key (``id`` of its tensor) from the parameters the hooks
    appended: how many times backward reached each one."""
    return dict(Counter(map(id, reached)))
