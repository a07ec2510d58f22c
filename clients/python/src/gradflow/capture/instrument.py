"""What gradflow attaches to the user's model, optimizer and scaler, and the step
records it makes of what they see.

:class:`Instruments` owns the measuring side of one watched run: the hooks on the
model (:mod:`gradflow.capture.hooks`), the optimizer's step pre- and post-hooks, the loss
scaler's tap, the graph-cut tracer, and the amendments that keep the registration
true. At ``gf.step`` it hands back the step's pending record, or nothing on a step
that is not reported; it never talks to the server.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .. import wire
from .._log import guarded
from ..measurement import ranks as _ranks
from ..measurement.measure import Measurer
from ..measurement.overlap import StepWorker, alone_between, leaves_grads
from ..measurement.record import PendingStep
from ..measurement.registration import Registry
from ..measurement.signals import SignalSettings
from ..measurement.updates import UpdateTracker
from .built_in_forward import BuiltInForward
from .clip_zero import METRIC as CLIPPED_TO_ZERO
from .clip_zero import ClipsToZero
from .cuts import CutTracer
from .frozen_moves import FrozenMoves
from .hooks import ModelHooks
from .instability import InstabilitySignals
from .loop_order import LoopOrder
from .loopshape import LoopShape
from .loss_shapes import LossShapes
from .plateau import PlateauWatch
from .scaler import ScalerTap

# The norm weights are measured on the first this many reported steps, then every
# this many step numbers (see Instruments._norm_weights_due).
NORM_WEIGHTS_FIRST = 4
NORM_WEIGHTS_EVERY = 4


class Instruments:
    """The hooks and measurements of one watched run."""

    def __init__(
        self,
        registry: Registry,
        *,
        every: int,
        updates_every: int,
        rank: Optional[int],
        signals: Optional[SignalSettings] = None,
    ) -> None:
        self.registry = registry
        self.every = every
        # The rank its records name (v1.4), in a multi-rank run only.
        self.rank = rank
        self.step = 0
        # Watched during the first steps only, their findings sent in an amendment:
        # layers a forward builds and registers nowhere, and the loop's order
        # (clipping, schedulers) over the first optimizer steps.
        self.built_in_forward = BuiltInForward(registry.model)
        self.loop_order = LoopOrder(registry.model, registry.optimizer, registry.scaler)
        # For the whole run: a plateau scheduler's calls, one per evaluation; and, on
        # sampled optimizer steps, frozen weights the step changes (its hooks come
        # before this instrument's, which attach() adds).
        self.plateau = PlateauWatch(registry.optimizer)
        self.frozen_moves = FrozenMoves(
            {id(p.tensor): p.name for p in registry.params}, registry.optimizer
        )
        self.loss_shapes = LossShapes()
        self.hooks = ModelHooks(registry)
        self.measurer = Measurer(registry, self.hooks)
        # Every how many steps weights are fingerprinted: every module's in a
        # multi-rank run, the modules without a gradient in any run.
        self.measurer.fingerprint_every = max(1, int(updates_every))
        if rank is not None:
            self.measurer.partial = True
            self.hooks.clock = _ranks.StepClock(
                _ranks.step_clock_device([p.tensor for p in registry.params])
            )
            self.hooks.local_sums = {}
        self.tracer = CutTracer(registry)
        self.updates = UpdateTracker(registry, updates_every)
        self.signals = InstabilitySignals(
            registry, registry.model, signals or SignalSettings(), every
        )
        self.signals.arm(self.step)
        self._pending_cuts: List[wire.GraphCut] = []
        self._pending_amend: Optional[wire.Amendment] = None
        self._handles: List[Any] = []
        # The ids of the optimizer step hooks attach() registered (None: none).
        self._step_hook_ids: Optional[Tuple[int, int]] = None
        # On a CPU under one of torch's optimizers: arithmetic beside the training
        # thread (gradflow.measurement.overlap).
        self.worker: Optional[StepWorker] = None
        self.scaler: Optional[ScalerTap] = None
        self.clips: Optional[ClipsToZero] = None
        self.shape = LoopShape(self.tracer.notify)
        # Since the last gf.step: optimizer steps taken, scaler updates, and the
        # forward count at the last optimizer step.
        self._steps_since = 0
        self._updates_seen = 0
        self._forwards_at_step = 0
        # Reported steps whose norm weights were measured.
        self._norm_weight_reads = 0

    def quiet(self) -> None:
        """What the client sees go wrong itself is not said (``on_alert=None``, or a
        rank other than the one that shows the run's alerts)."""
        self.tracer.notify = _silent
        self.shape.notify = _silent

    # -- attaching ---------------------------------------------------------------

    def attach(self, optimizer: Any, scaler: Any) -> None:
        """The optimizer's step hooks and the scaler's tap. An optimizer without step
        hooks is measured at ``gf.step`` instead."""
        if optimizer is None or not hasattr(optimizer, "register_step_pre_hook"):
            return
        pre = optimizer.register_step_pre_hook(self._pre_step)
        post = optimizer.register_step_post_hook(self._post_step)
        self._handles += [pre, post]
        self._step_hook_ids = (pre.id, post.id)
        if leaves_grads(optimizer):
            self.worker = StepWorker()
            self.measurer.worker = self.worker
            self.signals.adam.worker = self.worker
        self.clips = ClipsToZero({id(p.tensor) for p in self.registry.params})
        if scaler is not None:
            self.scaler = ScalerTap(scaler, optimizer, self._measure, self.reporting)

    def detach(self) -> None:
        """Removes every hook and wrapper gradflow installed."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._step_hook_ids = None
        if self.worker is not None:
            self.worker.close()
        self.hooks.remove()
        self.signals.remove()
        self.tracer.remove()
        self.built_in_forward.remove()
        if self.clips is not None:
            self.clips.remove()
        self.loop_order.remove()
        self.plateau.remove()
        self.frozen_moves.remove()
        self.loss_shapes.remove()
        self.registry.remove()
        if self.scaler is not None:
            self.scaler.uninstall()

    # -- the hooks ---------------------------------------------------------------

    def reporting(self) -> bool:
        """Whether the step now running is reported."""
        return self.step % self.every == 0 or self._pending_amend is not None

    def _check_amend(self) -> None:
        amend = self.registry.amendment(
            self.built_in_forward.findings()
            + self.loop_order.findings()
            + self.plateau.findings()
            + self.frozen_moves.findings()
            + self.loss_shapes.findings()
        )
        if amend is None:
            return
        self.measurer.rebuild()
        self.tracer.rebuild()
        self.updates.rebuild()
        self.signals.rebuild()
        if self._pending_amend is None:
            self._pending_amend = amend
        else:  # two changes before one report: later specs win, by name
            merged_params = {x["name"]: x for x in self._pending_amend.get("params", [])}
            merged_params.update({x["name"]: x for x in amend.get("params", [])})
            if merged_params:
                self._pending_amend["params"] = list(merged_params.values())
            merged_groups = {x["name"]: x for x in self._pending_amend.get("param_groups", [])}
            merged_groups.update({x["name"]: x for x in amend.get("param_groups", [])})
            if merged_groups:
                self._pending_amend["param_groups"] = list(merged_groups.values())
            if "precision" in amend:
                self._pending_amend["precision"] = amend["precision"]
            if "wiring" in amend:
                self._pending_amend["wiring"] = (
                    self._pending_amend.get("wiring", []) + amend["wiring"]
                )

    @guarded("measuring gradients")
    def _measure(self, during_step: bool = False, before_step: bool = False) -> None:
        """The gradients' norms; `before_step` (the optimizer's pre-step hook): the
        weights' copies before the step too, taken first: once the worker has the
        gradients, each torch call here would hand it the GIL and wait to get it
        back."""
        # The worker reads the gradients while the optimizer steps (the first read
        # after backward, which the optimizer's own loop otherwise makes), and the
        # post-step hook compares them as this check would have (_compare_read_grads).
        on_worker = (
            during_step
            and self.reporting()
            and not self.measurer.grads_measured
            and self.measurer.reads_grads_on_worker()
        )
        if on_worker:
            self.registry.leave_grads_to_worker()
        self._check_amend()
        if before_step:
            self._copy_before_step()
        if self.reporting() and not self.measurer.grads_measured:
            if during_step:
                self.measurer.measure_grads_during_step(read_on_worker=on_worker)
            else:
                self.measurer.measure_grads()

    @guarded("copying weights before the optimizer step")
    def _copy_before_step(self) -> None:
        if self.reporting():
            check_updates = self.updates.due(self.step)
            if check_updates or self._norm_weights_due():
                self.measurer.snapshot_norms()
                self._norm_weight_reads += 1
            if check_updates:
                self.updates.before_step()

    def _norm_weights_due(self) -> bool:
        """Whether this reported step measures the norm weights' update, drift and
        intended update (two flat copies of them and the optimizer state they need:
        ~0.25 ms a step at 290 tensors on a CPU): on the first reported steps, then
        on every step number that is a multiple of the reporting interval rounded up
        to ``NORM_WEIGHTS_EVERY`` steps, and on every step of the low-precision update
        check. What the detectors read of them (``norm_weight_frozen``'s streaks,
        counted in step numbers) needs no step in particular: a weight that stops
        moving is seen at most ``NORM_WEIGHTS_EVERY - 1`` steps later. Decided by the
        reported steps and their numbers alone, so that every rank of a run measures
        the same steps."""
        if self._norm_weight_reads < NORM_WEIGHTS_FIRST:
            return True
        period = self.every * -(-NORM_WEIGHTS_EVERY // self.every)
        return self.step % period == 0

    @guarded("optimizer step pre-hook")
    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.before_step()  # what it reads of the state is about to change
        # With a closure (Lightning's, L-BFGS's) the step runs backward itself: the
        # gradients may change inside it, so their norms are not taken alongside it.
        # (`args` holds the optimizer itself too, which is not callable.)
        closure = any(callable(a) for a in (*args, *kwargs.values()))
        ids = self._step_hook_ids
        alone = (
            ids is not None
            and not closure
            and alone_between(
                optimizer,
                *ids,
                readers=self.loop_order.hook_ids() + self.frozen_moves.hook_ids(),
            )
        )
        self._measure(during_step=alone, before_step=True)

    @guarded("optimizer step post-hook")
    def _post_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self.hooks.clock is not None:
            self.hooks.clock.on_optimizer_step()
        self._steps_since += 1
        self._forwards_at_step = self.hooks.forwards
        try:
            self.measurer.settle_grads()
            self._compare_read_grads()
            if self.reporting():
                self.measurer.after_step()
                self.updates.after_step()
                self.signals.after_optimizer_step(self.step)
            self.hooks.arm_carry_probe()
        finally:
            if self.worker is not None:
                # Last: the reads of the state the step left, queued above.
                self.worker.start_reads()

    def _compare_read_grads(self) -> None:
        """What the worker saw of the gradients and parameters during the step,
        compared as the pre-step check would have: a parameter that got or lost its
        gradient, or was cast, frozen or unfrozen, is amended on this step, its norms
        taken again against the amended registration."""
        seen = self.measurer.take_grads_seen()
        if seen is not None and self.registry.grads_read_later(seen):
            self._measure()

    @guarded("reading gradients at the end of backward")
    def _measure_at_backward_end(self) -> None:
        self._measure()

    def read_grads_at_backward_end(self) -> None:
        """See :meth:`gradflow.Watcher.read_grads_at_backward_end`."""
        if self.scaler is not None and self.scaler.enabled():
            return
        if self.reporting():
            self.hooks.arm_backward_end(self._measure_at_backward_end)

    # -- the step ----------------------------------------------------------------

    def end_step(
        self,
        loss: Any,
        step: Optional[int],
        metrics: Optional[Mapping[str, Any]],
        batch_ids: Any = None,
        micro_losses: Optional[List[Any]] = None,
    ) -> Optional[PendingStep]:
        """``gf.step``: this step's pending record when it is reported, else None;
        the step number moves on either way."""
        # Counted before the loop's shape consumes the count (v1.9 `optimizer_steps`).
        optimizer_steps = self._steps_since if self._handles else None
        # This rank's own work on the step (a multi-rank run): what shows a straggler.
        self._observe_shape()
        clock = self.hooks.clock
        step_span = clock.take() if clock is not None else None
        if step is not None:
            self.step = int(step)
        self._check_amend()
        self._pending_cuts.extend(self.tracer.take())
        pending = None
        if self.reporting():
            pending = self._collect(
                loss,
                self.scaler.take() if self.scaler is not None else None,
                _detached(metrics) if metrics else None,
                self.updates.take(),
                self.signals.take(batch_ids, micro_losses),
            )
            pending.optimizer_steps = optimizer_steps
            if self.rank is not None and step_span is not None:
                pending.step_time = functools.partial(_ranks.elapsed, *step_span)
        else:
            self.measurer.reset()
            self.updates.discard()
            self.signals.discard()
            if self.scaler is not None:
                self.scaler.captured = None
        self.step += 1
        self.signals.arm(self.step)
        return pending

    @guarded("checking where gf.step is called")
    def _observe_shape(self) -> None:
        if not self._handles:
            return  # no optimizer hooks: optimizer steps are not seen
        steps = self._steps_since
        if self.scaler is not None:
            updates = self.scaler.updates - self._updates_seen
            self._updates_seen = self.scaler.updates
            if updates > steps:  # steps the scaler skipped: not compared with forwards
                self._forwards_at_step = self.hooks.forwards
                steps = updates
                # A skipped step still ends the loop's step: the next backward pass
                # begins a new one, not a second micro-batch of this one (which
                # would read the next zero_grad as a reset between micro-batches).
                self.hooks.arm_carry_probe()
        self._steps_since = 0
        self.shape.observe(steps, steps > 0 and self.hooks.forwards > self._forwards_at_step)

    def unreported(self) -> Optional[PendingStep]:
        """What ``close`` still owes the server after the last ``gf.step``.

        A step that saw a backward pass but never reached ``gf.step`` (training died
        inside it: the optimizer, or a GradScaler, crashing on parameters whose dtype
        just changed) comes back as a record of that step, with whatever of it was
        measured and the amendment or graph cut it saw, so the cause of the crash is
        on the server. Without a backward pass there was no training step: forwards
        after the last ``gf.step`` are an evaluation (under ``torch.no_grad()``, the
        usual end of a loop, of the ``Trainer``'s ``eval_strategy`` and of
        Lightning's validation), and a record of them would read as a step in which
        backward reached no module. Only a registration change is sent then, alone
        in a record with no step data (a module missing from a record was not
        measured that step)."""
        self.registry.read_signature_next()  # no later step would catch a change
        self._check_amend()
        cuts = self.tracer.take()
        if self.hooks.hits:
            self._pending_cuts.extend(cuts)
            if self._pending_amend is None and not self._pending_cuts:
                return None
            return self._collect(None, None, None, None)
        self._pending_cuts = []
        amend, self._pending_amend = self._pending_amend, None
        if amend is None:
            return None
        pending = PendingStep(step=self.step, time=time.time(), amend=amend)
        pending.rank = self.rank
        return pending

    def _collect(
        self, loss: Any, scaler_state: Any, metrics: Any, updates: Any, signals: Any = None
    ) -> PendingStep:
        """This step's record, with the amendment and graph cuts waiting for it."""
        amend, self._pending_amend = self._pending_amend, None
        pending = self.measurer.collect(
            self.step, loss, scaler_state, self.registry.lrs(), amend, metrics, updates, signals
        )
        pending.graph_cuts, self._pending_cuts = self._pending_cuts, []
        clipped = self.clips.take() if self.clips is not None else None
        if clipped:
            pending.metrics.setdefault(CLIPPED_TO_ZERO, float(clipped))
        if self.rank is not None:
            # v1.4 fields only in a multi-rank run: a single process's records stay
            # what a v1.3 server accepts.
            pending.rank = self.rank
        return pending


def _silent(_message: str) -> None:
    return None


def _detached(metrics: Mapping[str, Any]) -> Dict[str, Any]:
    """The user's metrics with every tensor cut from its graph: a loss passed as a
    metric still carries one, and reading it as a number (on the reporter thread)
    would draw torch's warning about converting a tensor that requires grad, from
    gradflow's code. Detaching keeps the same storage, no copy, and lets the graph
    go now instead of when the record is built."""
    out: Dict[str, Any] = {}
    for name, value in metrics.items():
        detach = getattr(value, "detach", None)
        out[name] = detach() if callable(detach) else value
    return out
