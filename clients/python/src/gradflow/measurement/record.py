"""One step's numbers, brought to the host as one vector, turned into a step record.

The measuring side (:mod:`gradflow.measurement.measure`) concatenates every device number of a
step into one vector and says where each lies: a :class:`Slots` hands out the
position of every piece as it is added, and the named tuples below give the fields
of the multi-number pieces their names, so that the encoder reads ``stats.drift``
and never an offset agreed by convention. :meth:`PendingStep.record` runs on the
reporter thread and builds the wire record (:mod:`gradflow.wire`). Nothing here
imports torch: the vector only has to offer ``tolist()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Type, TypeVar

from .. import wire
from . import encode, signal_record
from .signal_record import SignalsAt

# Metrics the client adds itself: the step record's fields are closed (the server
# refuses unknown ones), its metrics are not.
RESETS_METRIC = "grads_reset_between_backwards"
TRAINING_METRIC = "model_training"


class NormStats(NamedTuple):
    """A norm weight's numbers after the optimizer step."""

    update_sq: float  # squared norm of the applied update
    drift: float  # largest |value - value at registration|
    mean: float


class Intended(NamedTuple):
    """What the optimizer meant to apply (``intended.summary``)."""

    norm_sq: float
    max_ulp: float  # largest ratio of an element's update to its ulp
    nonzero: float  # elements with a non-zero intended update
    rounded_away: float  # of those, how many the dtype rounded to no change


class LowPrecisionUpdate(NamedTuple):
    """A low-precision parameter's applied update and, after it, an :class:`Intended`
    (all NaN when the optimizer's intended update is not known)."""

    applied_sq: float
    intended_norm_sq: float
    max_ulp: float
    nonzero: float
    rounded_away: float

    def intended(self) -> Intended:
        return Intended(self.intended_norm_sq, self.max_ulp, self.nonzero, self.rounded_away)


class ScalerNumbers(NamedTuple):
    """The loss scaler before ``update()``: found_inf is NaN before any unscale."""

    scale: float
    growth_tracker: float
    found_inf: float


T = TypeVar("T", bound=Tuple[float, ...])


def width(kind: Type[Any]) -> int:
    """How many numbers a named piece takes in the vector."""
    return len(kind._fields)


def read(kind: Type[T], values: Sequence[float], at: int) -> T:
    """The named piece of `kind` that starts at `at`."""
    make: Any = kind
    piece: T = make(*values[at : at + width(kind)])
    return piece


class Slots:
    """Positions in the step's vector, handed out as pieces are added."""

    def __init__(self) -> None:
        self.size = 0

    def take(self, numel: int) -> int:
        at = self.size
        self.size += numel
        return at


@dataclass
class ModuleAt:
    """A module of the record and where its numbers are."""

    name: str
    # Its parameters' gradient norms, whose squares sum to the module's squared norm
    # (in f64, on the host); None: no gradient this step.
    grads: Optional[Sequence[int]]
    hook_hits: Optional[int]
    numel: Optional[int]  # gradient elements covered (this rank's)
    param_sum: Optional[int] = None  # multi-rank: the sum of its weights (a fingerprint)


@dataclass
class NormAt:
    """A norm weight of the record and where its numbers are."""

    name: str
    grad: Optional[int]  # its gradient norm
    stats: Optional[int]  # a NormStats
    intended: Optional[int]  # an Intended
    numel: int  # elements this rank holds


@dataclass
class UpdatesAt:
    """The low-precision parameters measured on this step: a LowPrecisionUpdate each,
    one after the other from `start`."""

    names: List[str]
    numels: List[int]
    start: int


@dataclass
class PendingStep:
    """One step's numbers (a device vector still being copied) and where each lies."""

    step: int
    time: float
    vector: Any = None  # a tensor with tolist(), or None when nothing was measured
    event: Any = None  # a CUDA event to wait for before reading the vector
    loss: Optional[float] = None
    loss_at: Optional[int] = None
    modules: List[ModuleAt] = field(default_factory=list)
    norms: List[NormAt] = field(default_factory=list)
    scaler_at: Optional[int] = None
    lrs: Dict[str, float] = field(default_factory=dict)
    amend: Optional[wire.Amendment] = None
    graph_cuts: List[wire.GraphCut] = field(default_factory=list)
    carried: Optional[bool] = None
    carried_at: Optional[int] = None
    # Several backward passes in this optimizer step: of the later ones, how many found
    # the gradient reset (host count, plus a device count of zeroed ones).
    resets: Optional[int] = None
    resets_at: Optional[int] = None
    input_at: Optional[int] = None
    # A multi-rank run: whether this rank's own gradients were finite before the
    # all-reduce (1 or 0; v1.7 `local_grads_nonfinite`).
    local_finite_at: Optional[int] = None
    updates: Optional[UpdatesAt] = None
    metrics: Dict[str, Any] = field(default_factory=dict)
    # A multi-rank run (v1.4): the partial sums, the sending rank, and how long its
    # own work on the step took (read by `step_time` on the reporter thread).
    partial: bool = False
    rank: Optional[int] = None
    step_time: Optional[Callable[[], Optional[float]]] = None
    # Optimizer steps since the previous gf.step (v1.9), when the optimizer is hooked.
    optimizer_steps: Optional[int] = None
    # The instability signals (v1.8) measured on this step, when any.
    signals: Optional[SignalsAt] = None
    # Makes `modules` and `norms` on the reporter thread, when set.
    describe: Optional[Callable[[], Tuple[List[ModuleAt], List[NormAt]]]] = None

    def values(self) -> List[float]:
        if self.vector is None:
            return []
        if self.event is not None:
            self.event.synchronize()
        return list(self.vector.tolist())

    def record(self) -> wire.StepRecord:
        """The protocol's step record (runs on the reporter thread)."""
        v = self.values()
        if self.describe is not None:
            self.modules, self.norms = self.describe()
            self.describe = None
        rec: wire.StepRecord = {"step": self.step, "time": self.time}
        if self.rank is not None:
            rec["rank"] = self.rank
        if self.step_time is not None:
            seconds = _safely(self.step_time)
            if seconds is not None:
                rec["step_time"] = seconds
        loss = v[self.loss_at] if self.loss_at is not None else self.loss
        if loss is not None:
            rec["loss"] = encode.number(loss)
        if self.lrs:
            rec["lrs"] = self.lrs
            rec["lr"] = next(iter(self.lrs.values()))
        modules = [self._module(m, v) for m in self.modules]
        if modules:
            rec["modules"] = modules
            nonfinite = sum(1 for m in modules if _nonfinite(m.get("grad_norm")))
            self.metrics.setdefault("grad_nonfinite_modules", float(nonfinite))
        params = [self._norm(n, v) for n in self.norms]
        if self.updates is not None:
            params.extend(self._low_precision(self.updates, v))
        if params:
            rec["params"] = params
        if self.scaler_at is not None:
            rec["scaler"] = _scaler(read(ScalerNumbers, v, self.scaler_at))
        if self.resets is not None:
            resets = float(self.resets)
            if self.resets_at is not None:
                resets += v[self.resets_at]
            self.metrics.setdefault(RESETS_METRIC, resets)
        if self.metrics:
            rec["metrics"] = _metrics(self.metrics)
        if self.amend:
            rec["amend"] = self.amend
        if self.graph_cuts:
            rec["graph_cuts"] = self.graph_cuts
        carried = self.carried
        if self.carried_at is not None:
            probe = v[self.carried_at]
            carried = None if math.isnan(probe) else probe > 0  # NaN: a non-finite gradient
        if carried is not None:
            rec["grads_carried_over"] = bool(carried)
        if self.input_at is not None:
            rec["input_absmax"] = encode.norm(v[self.input_at])
        if self.signals is not None:
            signal_record.apply(self.signals, rec, v)
        if self.local_finite_at is not None and not v[self.local_finite_at] > 0.5:
            # Sent only when true: a server older than v1.7 refuses the field, and
            # the client then resends the step without it (see the reporter).
            rec["local_grads_nonfinite"] = True
        if self.optimizer_steps is not None:
            rec["optimizer_steps"] = self.optimizer_steps
        return rec

    def _module(self, m: ModuleAt, v: List[float]) -> wire.ModuleStep:
        entry: wire.ModuleStep = {"module": m.name}
        if m.grads is None:
            entry["grad_norm"] = None
        else:
            sq = 0.0
            for at in m.grads:
                norm = v[at]
                sq += norm * norm
            entry["grad_norm"] = root(sq)
            if self.partial:
                entry["grad_sumsq"] = encode.norm(sq)
                if m.numel is not None:
                    entry["numel"] = m.numel
                    # A finite sum means every element is finite. A sum that is not
                    # may also be an overflow of finite elements: the count is then not
                    # known (it would take another pass over them).
                    if math.isfinite(sq):
                        entry["nonfinite"] = 0
        if m.hook_hits is not None:
            entry["hook_hits"] = m.hook_hits
        if m.param_sum is not None:
            entry["param_sum"] = encode.number(v[m.param_sum])
        return entry

    def _norm(self, n: NormAt, v: List[float]) -> wire.ParamStep:
        entry: wire.ParamStep = {"name": n.name}
        if n.grad is not None:
            entry["grad_norm"] = encode.norm(v[n.grad])
        if n.stats is not None:
            stats = read(NormStats, v, n.stats)
            entry["update_norm"] = root(stats.update_sq)
            entry["drift"] = encode.norm(stats.drift)
            if n.numel > 0:  # an empty shard has no mean
                entry["mean"] = encode.number(stats.mean)
        if n.intended is not None:
            _intended_fields(entry, read(Intended, v, n.intended))
        if self.partial:
            entry["numel"] = n.numel
        return entry

    def _low_precision(self, updates: UpdatesAt, v: List[float]) -> List[wire.ParamStep]:
        out: List[wire.ParamStep] = []
        for i, name in enumerate(updates.names):
            numbers = read(LowPrecisionUpdate, v, updates.start + width(LowPrecisionUpdate) * i)
            entry: wire.ParamStep = {"name": name, "update_norm": root(numbers.applied_sq)}
            if not math.isnan(numbers.intended_norm_sq):  # NaN: no intended update known
                _intended_fields(entry, numbers.intended())
            if self.partial and i < len(updates.numels):
                entry["numel"] = updates.numels[i]
            out.append(entry)
        return out


def root(square: float) -> Optional[encode.Number]:
    """The norm whose square a reduction produced; NaN (never a negative norm) when the
    reduction did not give a non-negative number."""
    return encode.norm(square**0.5 if square >= 0 else float("nan"))


def _nonfinite(norm: Optional[encode.Number]) -> bool:
    return isinstance(norm, str)  # "NaN" or "Infinity": how encode writes non-finite


def _safely(read_seconds: Callable[[], Optional[float]]) -> Optional[float]:
    """A rank's step time; None, never a lost record, when it cannot be read."""
    try:
        seconds = read_seconds()
    except Exception:
        return None
    return seconds if seconds is not None and math.isfinite(seconds) else None


def _scaler(numbers: ScalerNumbers) -> wire.ScalerState:
    scaler: wire.ScalerState = {"scale": encode.norm(numbers.scale)}
    tracker = encode.count(numbers.growth_tracker)
    if tracker is not None:
        scaler["growth_tracker"] = tracker
    if not math.isnan(numbers.found_inf):
        scaler["found_inf"] = numbers.found_inf > 0
        scaler["step_skipped"] = numbers.found_inf > 0
    return scaler


def _intended_fields(entry: wire.ParamStep, summary: Intended) -> None:
    """A parameter's intended-update fields; the counts only when they are consistent."""
    entry["intended_update_norm"] = root(summary.norm_sq)
    entry["intended_update_max_ulp"] = encode.norm(summary.max_ulp)
    nz, ra = encode.count(summary.nonzero), encode.count(summary.rounded_away)
    if nz is not None and ra is not None and ra <= nz:
        entry["intended_nonzero"] = nz
        entry["rounded_away"] = ra


def _metrics(metrics: Dict[str, Any]) -> Dict[str, Optional[encode.Number]]:
    """User metrics as the protocol takes them: numbers (a 1-element tensor is read
    here, on the reporter thread), null for None; anything else is left out."""
    out: Dict[str, Optional[encode.Number]] = {}
    for name, value in metrics.items():
        if value is None:
            out[str(name)] = None
            continue
        try:
            out[str(name)] = encode.number(float(value))
        except (TypeError, ValueError, RuntimeError):
            continue
    return out
