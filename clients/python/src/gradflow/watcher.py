"""``gradflow.watch``: attaches to a live model, optimizer and scaler."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import tempfile
import warnings
import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from torch import nn

from . import _env, layout
from . import ranks as _ranks
from ._log import guarded, logger, say, swallow
from .alerts import AlertBox
from .cuts import CutTracer
from .errors import GradflowWarning, TrainingAlert
from .measure import Measurer
from .ranks import Ranks
from .registration import Registry, webhook_specs
from .reporter import Reporter
from .scaler import ScalerTap
from .spool import Spool
from .transport import Client, Refused, Unreachable
from .updates import UpdateTracker


class NoopWatcher:
    """What ``watch`` returns when gradflow is disabled or this process does not
    report: the same methods, doing nothing."""

    run_id: Optional[str] = None
    enabled = False

    def step(self, loss: Any = None, *, step: Optional[int] = None, **_: Any) -> None:
        return None

    def alerts(self) -> List[Dict[str, Any]]:
        return []

    def close(self) -> None:
        return None

    def __enter__(self) -> NoopWatcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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
        generated_id: bool,
        servers: List[str],
        token: Optional[str],
        name: Optional[str],
        every: int,
        groups: layout.GroupsArg,
        on_alert: Optional[str],
        detectors: Optional[Mapping[str, int]],
        train: Optional[List[str]],
        config: Any,
        ranks: Optional[Ranks] = None,
        report_alone: bool = False,
        queue_size: int = 1024,
        close_timeout: float = 15.0,
        spool_dir: Optional[str] = None,
        spool_max_bytes: int = 256 * 1024 * 1024,
        updates_every: int = 10,
        webhooks: Optional[List[Dict[str, Any]]] = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self.run_id = run_id
        self.servers = list(servers)
        # A multi-rank run: every rank reports its own record (v1.4).
        self.ranks = ranks
        self.multi_rank = ranks is not None and ranks.world_size > 1 and not report_alone
        # The rank its records name (v1.4), in a multi-rank run only.
        self.rank = ranks.rank if ranks is not None and self.multi_rank else None
        self._label = f"run {run_id}" + (f" (rank {self.rank})" if self.rank is not None else "")
        self.every = every
        self.close_timeout = close_timeout
        self._closed = False
        self._step = 0
        self._steps_taken = 0
        self._max_steps = _env.max_steps()
        self.model = layout.unwrap_model(model)
        self.optimizer = layout.unwrap_optimizer(optimizer) if optimizer is not None else None
        self._alerts = AlertBox(on_alert)
        self.registry = Registry(self.model, self.optimizer, scaler, groups)
        client_config: Dict[str, Any] = {}
        if ranks is not None and report_alone:
            # One rank reports for the whole job: a single view, registered as such.
            client_config["reporting_rank"] = ranks.rank
            client_config["world_size"] = ranks.world_size
        elif ranks is not None and self.multi_rank:
            self.registry.world_size = ranks.world_size
        body = self.registry.registration(
            name,
            dict(detectors) if detectors else None,
            config,
            train,
            ranks.rank if ranks is not None and not report_alone else None,
            ranks.world_size if ranks is not None and not report_alone else None,
            webhooks,
            client_config,
        )
        self.measurer = Measurer(self.registry)
        self.measurer.partial = self.multi_rank
        if self.multi_rank:
            self.measurer.clock = _ranks.StepClock(
                _ranks.step_clock_device([p.tensor for p in self.registry.params])
            )
        self.tracer = CutTracer(self.registry)
        self.updates = UpdateTracker(self.registry, updates_every)
        self._pending_cuts: List[Dict[str, Any]] = []
        self._pending_amend: Optional[Dict[str, Any]] = None
        self._handles: List[Any] = []
        self._scaler: Optional[ScalerTap] = None
        directory = spool_dir or os.path.join(tempfile.gettempdir(), "gradflow-spool")
        # Each rank spools to a file of its own.
        who = f"rank{self.rank}." if self.rank is not None else ""
        spool = Spool(
            os.path.join(directory, f"{run_id}.{who}{os.getpid()}.ndjson"), spool_max_bytes
        )
        # In a multi-rank run only rank 0 reads and shows the run's alerts.
        lead = self.rank in (None, 0)
        self.reporter = Reporter(
            [Client(url, token) for url in self.servers],
            run_id,
            body,
            spool,
            self._alerts if on_alert is not None and lead else None,
            queue_size=queue_size,
        )
        if generated_id and lead:
            say(f"run id {run_id} (set GRADFLOW_RUN_ID or run_id= to choose one)")
        # Registration-time verdicts (a GradScaler over bf16 parameters) come before the
        # first step: register now, read the run's alerts, show them.
        if self.reporter.register(timeout=3.0):
            self.reporter.poll_alerts()
        self.reporter.start()
        # Hooks last: nothing is attached to the user's objects unless all of the above
        # worked.
        if self.optimizer is not None and hasattr(self.optimizer, "register_step_pre_hook"):
            # (An optimizer without step hooks is measured at gf.step instead.)
            self._handles.append(self.optimizer.register_step_pre_hook(self._pre_step))
            self._handles.append(self.optimizer.register_step_post_hook(self._post_step))
            if scaler is not None:
                self._scaler = ScalerTap(scaler, self.optimizer, self._measure, self._reporting)
        atexit.register(_close_at_exit, weakref.ref(self))
        try:
            self._alerts.deliver()
        except TrainingAlert:
            self.close()  # the caller asked to stop: leave nothing attached
            raise

    # -- hooks -------------------------------------------------------------------

    def _reporting(self) -> bool:
        return self._step % self.every == 0 or self._pending_amend is not None

    def _check_amend(self) -> None:
        amend = self.registry.amendment()
        if amend is None:
            return
        self.measurer.rebuild()
        self.tracer.rebuild()
        self.updates.rebuild()
        if self._pending_amend is None:
            self._pending_amend = amend
        else:  # two changes before one report: later specs win, by name
            for key in ("params", "param_groups"):
                merged = {x["name"]: x for x in self._pending_amend.get(key, [])}
                merged.update({x["name"]: x for x in amend.get(key, [])})
                if merged:
                    self._pending_amend[key] = list(merged.values())
            if "precision" in amend:
                self._pending_amend["precision"] = amend["precision"]

    @guarded("measuring gradients")
    def _measure(self) -> None:
        self._check_amend()
        if self._reporting() and not self.measurer.grads_measured:
            self.measurer.measure_grads()

    @guarded("optimizer step pre-hook")
    def _pre_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._measure()
        if self._reporting():
            self.measurer.snapshot_norms()
            if self.updates.due(self._step):
                self.updates.before_step()

    @guarded("optimizer step post-hook")
    def _post_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self.measurer.clock is not None:
            self.measurer.clock.on_optimizer_step()
        if self._reporting():
            self.measurer.after_step()
            self.updates.after_step()
        self.measurer.arm_carry_probe()

    @guarded("reading gradients at the end of backward")
    def _measure_at_backward_end(self) -> None:
        self._measure()

    def read_grads_at_backward_end(self) -> None:
        """Reads this step's gradients as soon as the next backward pass ends, instead of
        at the optimizer step: for a loop that clips (or otherwise changes) gradients
        between its last backward and ``optimizer.step()``. Call it before the last
        backward of an optimizer step; the Hugging Face callback does. Under an enabled
        loss scaler it does nothing: gradients are read right after unscaling anyway."""
        if self._closed or (self._scaler is not None and self._scaler.enabled()):
            return
        if self._reporting():
            self.measurer.arm_backward_end(self._measure_at_backward_end)

    # -- the public API ----------------------------------------------------------

    def step(
        self,
        loss: Any = None,
        *,
        step: Optional[int] = None,
        metrics: Optional[Mapping[str, Any]] = None,
    ) -> None:
        """Records one optimizer step. Call it once per step, after ``optimizer.step()``
        (and ``scaler.update()``). ``loss`` may be a tensor (read without a sync) or a
        float. Never raises, except :class:`gradflow.TrainingAlert` with
        ``on_alert="raise"``."""
        self._step_guarded(loss, step, metrics)
        self._alerts.deliver()
        self._steps_taken += 1
        if self._max_steps is not None and self._steps_taken >= self._max_steps:
            # `gradflow check --steps N`: enough of this script has run.
            self.close()
            say(f"stopping the script after {self._steps_taken} steps (GRADFLOW_MAX_STEPS)")
            raise SystemExit(0)

    @guarded("gf.step")
    def _step_guarded(
        self, loss: Any, step: Optional[int], metrics: Optional[Mapping[str, Any]]
    ) -> None:
        if self._closed:
            return
        # This rank's own work on the step (a multi-rank run): what shows a straggler.
        clock = self.measurer.clock
        step_span = clock.take() if clock is not None else None
        if step is not None:
            self._step = int(step)
        self._check_amend()
        self._pending_cuts.extend(self.tracer.take())
        if self._reporting():
            self._submit(
                loss,
                self._scaler.take() if self._scaler is not None else None,
                dict(metrics) if metrics else None,
                self.updates.take(),
                step_span,
            )
        else:
            self.measurer.reset()
            self.updates.discard()
            if self._scaler is not None:
                self._scaler.captured = None
        self._step += 1

    def _flush_unreported(self) -> None:
        """A step that never reached ``gf.step`` (training died inside it: the
        optimizer, or a GradScaler, crashing on parameters whose dtype just changed)
        may have seen an amendment or a graph cut: they are sent in a record of that
        step, with whatever of it was measured, so the cause of the crash is on the
        server."""
        self._check_amend()
        self._pending_cuts.extend(self.tracer.take())
        if self._pending_amend is None and not self._pending_cuts:
            return
        self._submit(None, None, None, None)

    def _submit(
        self,
        loss: Any,
        scaler_state: Any,
        metrics: Optional[Dict[str, Any]],
        updates: Any,
        step_span: Any = None,
    ) -> None:
        """This step's record, with the amendment and graph cuts waiting for it, handed
        to the reporter thread."""
        amend, self._pending_amend = self._pending_amend, None
        pending = self.measurer.collect(
            self._step, loss, scaler_state, self.registry.lrs(), amend, metrics, updates
        )
        pending.graph_cuts, self._pending_cuts = self._pending_cuts, []
        if self.rank is not None:
            # v1.4 fields only in a multi-rank run: a single process's records stay
            # what a v1.3 server accepts.
            pending.rank = self.rank
            pending.step_span = step_span
        self.reporter.submit(pending)

    def alerts(self) -> List[Dict[str, Any]]:
        """The run's open alerts, as the server has them now (a request to the server;
        empty when it cannot be reached)."""
        try:
            return self.reporter.client.alerts(self.run_id)
        except (Unreachable, Refused) as err:
            logger.info("gradflow: could not read alerts: %s", err)
            return []
        except Exception as exc:
            swallow("gf.alerts", exc)
            return []

    def close(self) -> None:
        """Removes the hooks, delivers what is left (bounded by ``close_timeout``),
        marks the run finished and says what could not be delivered."""
        if self._closed:
            return
        self._closed = True
        try:
            self._flush_unreported()
            for handle in self._handles:
                handle.remove()
            self.measurer.remove_hooks()
            self.tracer.remove()
            if self._scaler is not None:
                self._scaler.uninstall()
            self.reporter.close(self.close_timeout)
            r = self.reporter
            left = r.pending
            r.spool.close()
            if left:
                _write_sidecar(r.spool.path, self.run_id, r.registration)
            where = ", ".join(f"{n} to {url}" for url, n in r.delivered_to.items())
            where = where or f"none to {', '.join(self.servers)}"
            if left or r.dropped or r.rejected or r.broken:
                parts = []
                if left:
                    parts.append(
                        f"{left} still queued (kept in {r.spool.path}; load them later with "
                        f"`gradflow-server import {r.spool.path}`)"
                    )
                if r.dropped:
                    parts.append(f"{r.dropped} dropped (queue or spool full)")
                if r.rejected:
                    parts.append(f"{r.rejected} refused by the server")
                say(
                    f"{self._label}: delivered {r.delivered} steps ({where}); "
                    f"NOT delivered: {', '.join(parts) or r.broken}"
                )
            elif r.switches:
                say(f"{self._label}: delivered all {r.delivered} steps ({where})")
        except Exception as exc:
            swallow("gf.close", exc)
        # The run is over: a critical alert is not raised from close.
        with contextlib.suppress(TrainingAlert):
            self._alerts.deliver()

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _write_sidecar(spool_path: str, run_id: str, registration: Dict[str, Any]) -> None:
    """Beside an undelivered spool: the run id and registration that
    ``gradflow-server import SPOOL`` needs to load it."""
    with open(spool_path + ".registration.json", "w") as f:
        json.dump({"run_id": run_id, "registration": registration}, f)


def _close_at_exit(ref: Any) -> None:
    watcher = ref()
    if watcher is not None:
        watcher.close()


def _partitioned(model: nn.Module) -> Optional[str]:
    """Why the model cannot be watched: parameters DeepSpeed ZeRO partitions (their
    gradients are gone once its engine has stepped)."""
    for name, p in model.named_parameters():
        if hasattr(p, "ds_id") or hasattr(p, "ds_status"):
            return f"{name} is partitioned by DeepSpeed ZeRO, which is not supported yet"
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
) -> Any:
    """Watches a training run and reports it to a gradflow server.

    Under ``torch.distributed`` with more than one rank, call it on every rank: each
    rank reports its own record (the gradients it holds: the whole of a replicated
    parameter, its shard of an FSDP2 one) and the server combines them; see
    :mod:`gradflow.ranks` for how the ranks agree on the run id. With ``rank=k`` only
    rank ``k`` reports, as a single view of the job (not for sharded models).

    Returns a :class:`Watcher`, or a no-op object when ``GRADFLOW_DISABLED=1``, on a
    rank that ``rank=`` leaves out, or for a model DeepSpeed ZeRO partitions. Never
    raises for gradflow's own failures; with ``on_alert="raise"`` a critical
    registration-time alert raises :class:`gradflow.TrainingAlert` here.
    """
    if _env.disabled():
        return NoopWatcher()
    try:
        here = _ranks.current()
        if here is not None and rank is not None and here.rank != rank:
            return NoopWatcher()
        alone = here is not None and rank is not None and here.world_size > 1
        inner = layout.unwrap_model(model)
        refused = _partitioned(inner)
        if refused is None and alone:
            sharded = _first_sharded(inner)
            if sharded is not None:
                refused = (
                    f"rank={rank} reports one rank alone, but {sharded} is sharded across "
                    "ranks (a DTensor): leave rank= out so that every rank reports its shard"
                )
        if refused is not None:
            warnings.warn(
                f"gradflow: {refused}; this run is not watched.", GradflowWarning, stacklevel=2
            )
            return NoopWatcher()
        chosen_id, generated = _ranks.agree_run_id(run_id, name, None if alone else here)
        return Watcher(
            model,
            optimizer,
            scaler,
            run_id=chosen_id,
            generated_id=generated,
            servers=_env.servers(server),
            token=_env.token(token),
            name=name,
            every=int(every),
            groups=groups,
            on_alert=on_alert,
            detectors=detectors,
            train=train,
            config=config,
            ranks=here,
            report_alone=alone,
            queue_size=queue_size,
            close_timeout=close_timeout
            if close_timeout is not None
            else _env.float_env("GRADFLOW_CLOSE_TIMEOUT", 15.0),
            spool_dir=spool_dir or os.environ.get("GRADFLOW_SPOOL_DIR"),
            spool_max_bytes=spool_max_bytes
            or int(_env.float_env("GRADFLOW_SPOOL_MAX_BYTES", 256 * 1024 * 1024)),
            updates_every=int(updates_every),
            webhooks=webhook_specs(webhooks),
        )
    except TrainingAlert:
        raise
    except (ValueError, TypeError) as exc:
        # A wrong argument is the user's to fix, but it must not stop training either.
        warnings.warn(f"gradflow: not watching: {exc}", GradflowWarning, stacklevel=2)
        return NoopWatcher()
    except Exception as exc:
        swallow("gradflow.watch", exc)
        return NoopWatcher()
