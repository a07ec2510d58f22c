"""``gradflow.watch``: attaches to a live model, optimizer and scaler.

:func:`watch` is the composition root. It resolves the options
(:mod:`gradflow.options`), decides whether this process reports at all, and builds a
:class:`Watcher` from three parts with one job each: the registration
(:class:`gradflow.measurement.registration.Registry`), the hooks and measurements
(:class:`gradflow.capture.instrument.Instruments`) and the delivery
(:class:`gradflow.delivery.delivery.Delivery`). The watcher only connects them: a step's
record goes from the instruments to the delivery, and the server's alerts come back
through an :class:`gradflow.delivery.alerts.AlertBox`.
"""

from __future__ import annotations

import atexit
import os
import sys
import warnings
import weakref
from typing import Any, Callable, List, Mapping, Optional, Sequence, Union

from torch import nn

from . import _env, wire
from ._log import guarded, logger, say, swallow
from .api import Watch
from .capture import zero as _zero
from .capture.instrument import Instruments
from .delivery.alerts import AlertBox
from .delivery.delivery import Delivery
from .delivery.reporter import Reporter
from .delivery.runs_file import note_run
from .delivery.transport import Refused, Unreachable
from .errors import GradflowWarning, TrainingAlert
from .measurement import layout
from .measurement import ranks as _ranks
from .measurement.ranks import Ranks
from .measurement.registration import Registry
from .options import WatchOptions
from .steplimit import StepLimit


class NoopWatcher:
    """What ``watch`` returns when gradflow is disabled or this process does not
    report: the same methods, doing nothing."""

    run_id: Optional[str] = None
    enabled = False

    def step(
        self,
        loss: Any = None,
        *,
        step: Optional[int] = None,
        metrics: Optional[Mapping[str, Any]] = None,
        batch_ids: Any = None,
        micro_losses: Optional[Sequence[Any]] = None,
        **_: Any,
    ) -> None:
        return None

    def read_grads_at_backward_end(self) -> None:
        return None

    def alerts(self) -> List[wire.Alert]:
        return []

    def close(self) -> None:
        return None

    def __enter__(self) -> NoopWatcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


StepListener = Callable[["Watcher"], None]


class Watcher:
    """Reports one training run to a gradflow server. Built by :func:`gradflow.watch`."""

    enabled = True

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any = None,
        scaler: Any = None,
        *,
        run_id: str,
        options: WatchOptions,
        generated_id: bool = False,
        ranks: Optional[Ranks] = None,
        report_alone: bool = False,
        zero: Optional[_zero.Zero] = None,
    ) -> None:
        self.run_id = run_id
        self.options = options
        self.servers = list(options.servers)
        self.every = options.every
        self.close_timeout = options.close_timeout
        # A multi-rank run: every rank reports its own record (v1.4), and the records
        # name the rank.
        multi_rank = ranks is not None and ranks.world_size > 1 and not report_alone
        self.rank = ranks.rank if ranks is not None and multi_rank else None
        self._label = f"run {run_id}" + (f" (rank {self.rank})" if self.rank is not None else "")
        self._closed = False
        self._step_listeners: List[StepListener] = []
        self.model = layout.unwrap_model(model)
        self.optimizer = layout.unwrap_optimizer(optimizer) if optimizer is not None else None
        self._alerts = AlertBox(options.on_alert)

        self.registry = Registry(self.model, self.optimizer, scaler, options.groups)
        if zero is not None:  # DeepSpeed ZeRO: gradients read from its partitions
            _zero.adapt(self.registry, zero)
        self.instruments = Instruments(
            self.registry,
            every=options.every,
            updates_every=options.updates_every,
            rank=self.rank,
            signals=options.signals,
        )
        registration = _registration(
            self.registry,
            options,
            ranks,
            report_alone,
            multi_rank,
            self.instruments.signals.registration(),
        )
        if zero is not None:
            _zero.measure(self.instruments, zero)
        # In a multi-rank run only rank 0 reads and shows the run's alerts.
        lead = self.rank in (None, 0)
        if options.on_alert is None or not lead:
            self.instruments.quiet()
        self.delivery = Delivery(
            options,
            run_id,
            registration,
            rank=self.rank,
            alerts=self._alerts if options.on_alert is not None and lead else None,
            label=self._label,
            announce=lead,
        )
        self._alerts.dashboard = self.delivery.dashboard
        if generated_id and lead:
            say(f"run id {run_id} (set GRADFLOW_RUN_ID or run_id= to choose one)")
        self.delivery.start()
        note_run(run_id)
        # Hooks on the optimizer and scaler last: nothing more is attached to the
        # user's objects unless all of the above worked.
        self.instruments.attach(self.optimizer, scaler)
        if zero is not None:
            _zero.attach(self.instruments, zero)
        atexit.register(_close_at_exit, weakref.ref(self))
        _note_interrupts()
        try:
            self._alerts.deliver()
        except TrainingAlert:
            self.close()  # the caller asked to stop: leave nothing attached
            raise

    @property
    def reporter(self) -> Reporter:
        """The reporter thread's side of the delivery."""
        return self.delivery.reporter

    def on_step(self, listener: StepListener) -> None:
        """Calls `listener(watcher)` after every ``gf.step``, once its record is on its
        way (``gradflow check --steps`` stops the script there)."""
        self._step_listeners.append(listener)

    # -- the public API ----------------------------------------------------------

    def read_grads_at_backward_end(self) -> None:
        """Reads this step's gradients as soon as the next backward pass ends, instead of
        at the optimizer step: for a loop that clips (or otherwise changes) gradients
        between its last backward and ``optimizer.step()``. Call it before the last
        backward of an optimizer step; the Hugging Face callback does. Under an enabled
        loss scaler it does nothing: gradients are read right after unscaling anyway."""
        if not self._closed:
            self.instruments.read_grads_at_backward_end()

    def step(
        self,
        loss: Any = None,
        *,
        step: Optional[int] = None,
        metrics: Optional[Mapping[str, Any]] = None,
        batch_ids: Any = None,
        micro_losses: Optional[Sequence[Any]] = None,
    ) -> None:
        """Records one optimizer step. Call it once per step, after ``optimizer.step()``
        (and ``scaler.update()``). ``loss`` may be a tensor (read without a sync) or a
        float. ``batch_ids``: your ids of the step's samples or batches (strings or
        numbers, or a tensor of them; at most 1024 are sent), named by a loss-spike
        verdict. ``micro_losses``: each micro-batch's loss when the step accumulated
        several (tensors or floats). Never raises, except
        :class:`gradflow.TrainingAlert` with ``on_alert="raise"``."""
        self._step_guarded(loss, step, metrics, batch_ids, micro_losses)
        self._alerts.deliver()
        for listener in self._step_listeners:
            listener(self)

    @guarded("gf.step")
    def _step_guarded(
        self,
        loss: Any,
        step: Optional[int],
        metrics: Optional[Mapping[str, Any]],
        batch_ids: Any = None,
        micro_losses: Optional[Sequence[Any]] = None,
    ) -> None:
        if self._closed:
            return
        micro = list(micro_losses) if micro_losses is not None else None
        pending = self.instruments.end_step(loss, step, metrics, batch_ids, micro)
        if pending is not None:
            self.delivery.submit(pending)

    def alerts(self) -> List[wire.Alert]:
        """The run's open alerts, as the server has them now (a request to the server;
        empty when it cannot be reached)."""
        try:
            return self.delivery.alerts()
        except (Unreachable, Refused) as err:
            logger.info("gradflow: could not read alerts: %s", err)
            return []
        except Exception as exc:
            swallow("gf.alerts", exc)
            return []

    def close(self) -> None:
        """Removes the hooks, delivers what is left (bounded by ``close_timeout``),
        marks the run finished and says what could not be delivered. With
        ``on_alert="raise"``, a critical alert that arrived meanwhile (the last
        steps' verdicts) raises :class:`gradflow.TrainingAlert` here."""
        self._close(self.close_timeout)

    def _close(self, timeout: float, *, raising: bool = True) -> None:
        """`close`; `raising=False` where an exception is unwinding already (the alert
        is then shown, not raised)."""
        if self._closed:
            return
        self._closed = True
        try:
            last = self.instruments.unreported()
            if last is not None:
                self.delivery.submit(last)
            self.instruments.detach()
            self.delivery.close(timeout)
        except Exception as exc:
            swallow("gf.close", exc)
        self._alerts.deliver(raising=raising)

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._close(self.close_timeout, raising=exc[0] is None)


def _registration(
    registry: Registry,
    options: WatchOptions,
    ranks: Optional[Ranks],
    report_alone: bool,
    multi_rank: bool,
    signals: Optional[Mapping[str, int]] = None,
) -> wire.RunRegistration:
    """The run's registration body, with how this process reports in the job."""
    client_config = {}
    if ranks is not None and report_alone:
        # One rank reports for the whole job: a single view, registered as such.
        client_config = {"reporting_rank": ranks.rank, "world_size": ranks.world_size}
    elif ranks is not None and multi_rank:
        registry.world_size = ranks.world_size
    per_rank = ranks is not None and not report_alone
    return registry.registration(
        name=options.name,
        detectors=options.detectors,
        config=options.config,
        train=options.train,
        rank=ranks.rank if ranks is not None and per_rank else None,
        world_size=ranks.world_size if ranks is not None and per_rank else None,
        webhooks=options.webhooks,
        client_config=client_config,
        signals=dict(signals) if signals else None,
    )


def _close_at_exit(ref: Any) -> None:
    """The interpreter is exiting with the watcher still open. After Ctrl-C the
    delivery waits a second, not ``close_timeout``. A critical alert that
    ``on_alert="raise"`` would raise cannot be raised here (Python ignores exceptions
    from exit callbacks): it is shown, and the process exits with status 1."""
    watcher = ref()
    if watcher is None:
        return
    timeout = min(watcher.close_timeout, 1.0) if _interrupted else watcher.close_timeout
    try:
        watcher._close(timeout)
    except TrainingAlert as alert:
        watcher._alerts.say(alert.alert)
        say(
            f"{watcher._label}: stopping with exit status 1: on_alert='raise' and a critical "
            f"alert arrived as the run ended ({alert.kind} on {alert.alert.get('subject')})"
        )
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(1)


# Whether the program is ending on an uncaught KeyboardInterrupt (Ctrl-C): Python
# calls sys.excepthook before the exit callbacks.
_interrupted = False


def _note_interrupts() -> None:
    previous = sys.excepthook
    if getattr(previous, "_gradflow", False):
        return

    def excepthook(kind: Any, value: Any, tb: Any) -> None:
        global _interrupted
        if isinstance(kind, type) and issubclass(kind, KeyboardInterrupt):
            _interrupted = True
        previous(kind, value, tb)

    excepthook._gradflow = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook


def _partitioned(model: nn.Module) -> Optional[str]:
    """Why the model cannot be watched: parameters DeepSpeed ZeRO partitions, given
    without the engine (or its ZeRO optimizer) that holds their gradients."""
    name = _zero.partitioned(model)
    if name is not None:
        return (
            f"{name}'s gradient is held by DeepSpeed's optimizer: pass the engine "
            "deepspeed.initialize returned (gradflow.watch(engine)) so that it can be read"
        )
    return None


def _first_sharded(model: nn.Module) -> Optional[str]:
    for name, p in model.named_parameters():
        if _ranks.is_dtensor(p):
            return name
    return None


def watch(
    model: nn.Module,
    optimizer: Any = None,
    scaler: Any = None,
    run_id: Optional[str] = None,
    server: Union[None, str, Sequence[str]] = None,
    name: Optional[str] = None,
    every: int = 1,
    token: Optional[str] = None,
    groups: layout.GroupsArg = None,
    on_alert: Optional[str] = "warn",
    *,
    detectors: Optional[Mapping[str, int]] = None,
    train: Optional[List[str]] = None,
    config: Any = None,
    rank: Optional[int] = None,
    queue_size: int = 1024,
    close_timeout: Optional[float] = None,
    spool_dir: Optional[str] = None,
    spool_max_bytes: Optional[int] = None,
    updates_every: int = 10,
    webhooks: Any = None,
    signals: Any = None,
    signal_modules: Any = None,
) -> Watch:
    """Watches a training run and reports it to a gradflow server.

    Under ``torch.distributed`` with more than one rank, call it on every rank: each
    rank reports its own record (the gradients it holds: the whole of a replicated
    parameter, its shard of an FSDP2 one, its partition under DeepSpeed ZeRO: pass
    the engine ``deepspeed.initialize`` returns, see :mod:`gradflow.capture.zero`) and the
    server combines them; see :mod:`gradflow.measurement.ranks` for how the ranks agree on the
    run id. With ``rank=k`` only rank ``k`` reports, as a single view of the job (not
    for sharded models).

    Returns a :class:`Watcher`, or a :class:`NoopWatcher` when ``GRADFLOW_DISABLED=1``,
    on a rank that ``rank=`` leaves out, or for a model whose gradients DeepSpeed ZeRO
    holds, given without its engine; both are a :class:`gradflow.api.Watch`. Never
    raises for gradflow's own failures; with ``on_alert="raise"`` a critical
    registration-time alert raises :class:`gradflow.TrainingAlert` here.
    """
    if _env.disabled():
        return NoopWatcher()
    try:
        options = WatchOptions.resolve(
            server=server,
            token=token,
            name=name,
            every=every,
            groups=groups,
            on_alert=on_alert,
            detectors=detectors,
            train=train,
            config=config,
            queue_size=queue_size,
            close_timeout=close_timeout,
            spool_dir=spool_dir,
            spool_max_bytes=spool_max_bytes,
            updates_every=updates_every,
            webhooks=webhooks,
            signals=signals,
            signal_modules=signal_modules,
        )
        here = _ranks.current()
        if here is not None and rank is not None and here.rank != rank:
            return NoopWatcher()
        alone = here is not None and rank is not None and here.world_size > 1
        zero = _zero.find(model, optimizer)
        if zero is not None:  # DeepSpeed ZeRO: its engine's model, its optimizer tapped
            model, optimizer = zero.module, None
            if alone:
                raise ValueError(
                    "rank= reports one rank alone; under DeepSpeed ZeRO every "
                    "rank holds a partition of the gradients: leave rank= out"
                )
        refused = None
        if zero is None:
            refused = _not_watchable(layout.unwrap_model(model), rank if alone else None)
        if refused is not None:
            warnings.warn(
                f"gradflow: {refused}; this run is not watched.", GradflowWarning, stacklevel=2
            )
            return NoopWatcher()
        chosen_id, generated = _ranks.agree_run_id(run_id, name, None if alone else here)
        watcher = Watcher(
            model,
            optimizer,
            scaler,
            run_id=chosen_id,
            options=options,
            generated_id=generated,
            ranks=here,
            report_alone=alone,
            zero=zero,
        )
        _limit_steps(watcher)
        return watcher
    except TrainingAlert:
        raise
    except (ValueError, TypeError) as exc:
        # A wrong argument is the user's to fix, but it must not stop training either.
        warnings.warn(f"gradflow: not watching: {exc}", GradflowWarning, stacklevel=2)
        return NoopWatcher()
    except Exception as exc:
        swallow("gradflow.watch", exc)
        return NoopWatcher()


def _not_watchable(model: nn.Module, alone_rank: Optional[int]) -> Optional[str]:
    """Why this model cannot be watched as asked, or None."""
    refused = _partitioned(model)
    if refused is None and alone_rank is not None:
        sharded = _first_sharded(model)
        if sharded is not None:
            refused = (
                f"rank={alone_rank} reports one rank alone, but {sharded} is sharded across "
                "ranks (a DTensor): leave rank= out so that every rank reports its shard"
            )
    return refused


def _limit_steps(watcher: Watcher) -> None:
    """Under ``gradflow check --steps N``: its step limit, on this watcher."""
    limit = StepLimit.from_env()
    if limit is not None:
        watcher.on_step(limit)
