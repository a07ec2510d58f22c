"""The background thread that owns all I/O: registration, batches, spool, alerts.

The training thread hands steps over through a bounded queue it never waits on
(:mod:`.step_queue`). The thread turns pending steps into records (waiting there for
their device copies) and gives them to the sender (:mod:`.sender`), which posts them
in batches to the server spoken to (:mod:`.servers`: several servers, one at a time)
after the run's registration there (:mod:`.registrar`), or spools them while no
server answers. Between batches it reads the run's open alerts for the person
running training; at close it flushes within a deadline and tells the server the run
ended. This class only connects those parts: each has one job.
"""

from __future__ import annotations

import json
import threading
import time
from typing import List, NamedTuple, Optional, Sequence

from .. import wire
from .._log import logger, swallow
from .alerts import AlertBox
from .older_servers import strip_v18
from .registrar import Registrar, TokenRefused
from .sender import Sender
from .servers import Servers
from .spool import Spool
from .step_queue import Pending, StepQueue
from .tally import DeliverySummary, Tally
from .transport import Client, Refused, Unreachable


class Backlog(NamedTuple):
    """Steps not delivered yet while the server is out of reach, said before the wait
    at close."""

    server: str
    steps: int
    spool_path: str


class Reporter:
    """One run's reporter thread and what the rest of the client asks of it."""

    def __init__(
        self,
        clients: Sequence[Client],
        run_id: str,
        registration: wire.RunRegistration,
        spool: Spool,
        alerts: Optional[AlertBox],
        queue_size: int = 1024,
        batch_size: int = 256,
        flush_interval: float = 0.5,
        alert_interval: float = 1.0,
        gather: float = 0.2,
        announce: bool = False,
    ) -> None:
        self.servers = Servers(clients, run_id, spool.path)
        self.run_id = run_id
        self.spool = spool
        self._alert_box = alerts
        self.alert_interval = alert_interval
        self.tally = Tally()
        self.queue = StepQueue(queue_size, batch_size, flush_interval, gather, self.tally)
        self.registrar = Registrar(self.servers, registration, announce=announce)
        self.sender = Sender(self.servers, self.registrar, spool, self.tally, batch_size)
        self._next_poll = 0.0
        self._deadline: Optional[float] = None
        self._thread = threading.Thread(target=self._run, name="gradflow-reporter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- training thread ---------------------------------------------------------

    def submit(self, pending: Pending) -> None:
        self.queue.put(pending)

    def register(self, timeout: Optional[float] = None) -> bool:
        """One registration attempt (on each server in turn); on failure the thread
        retries before any step."""
        try:
            self.registrar.register(timeout)
            return True
        except Unreachable as err:
            self.servers.offline(err)
            return False
        except TokenRefused:
            return False

    def dashboard(self) -> str:
        """The run's page on the server spoken to now."""
        return self.servers.dashboard()

    def open_alerts(self) -> List[wire.Alert]:
        """The run's open alerts on the server spoken to now (raises Unreachable or
        Refused)."""
        return self.servers.client.alerts(self.run_id)

    def poll_alerts(self) -> None:
        box = self._alert_box
        if box is None or self.registrar.broken or not self.registrar.registered:
            return
        try:
            box.offer(self.open_alerts())
        except (Unreachable, Refused) as err:
            logger.debug("gradflow: could not read alerts: %s", err)

    def close(self, timeout: float) -> None:
        self._deadline = time.monotonic() + timeout
        self.queue.stop(timeout)
        self._thread.join(timeout + 1.0)

    def close_spool(self) -> None:
        """After close: the spool file is left as it is, closed."""
        self.spool.close()

    @property
    def pending(self) -> int:
        return len(self.spool) + len(self.queue)

    def backlog(self) -> Optional[Backlog]:
        """What is still to deliver while the server is out of reach; None when it
        answers or nothing is left."""
        pending = self.pending
        if self.servers.outage is None or not pending:
            return None
        return Backlog(self.servers.client.server, pending, self.spool.path)

    def summary(self) -> DeliverySummary:
        t = self.tally
        return DeliverySummary(
            delivered=t.delivered,
            delivered_to=dict(t.delivered_to),
            pending=self.pending,
            dropped=t.dropped,
            rejected=t.rejected,
            broken=self.registrar.broken,
            spool_path=self.spool.path,
            token_refused=self.registrar.token_refused,
            switches=list(self.servers.switches),
            late=t.late,
        )

    # -- reporter thread ---------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not stopping:
            try:
                items, stopping = self.queue.take()
                lines = [self._encode(p) for p in items]
                self.sender.deliver([line for line in lines if line is not None])
                if time.monotonic() >= self._next_poll and not self.servers.is_offline():
                    self._next_poll = time.monotonic() + self.alert_interval
                    self.poll_alerts()
            except Exception as exc:
                swallow("reporter", exc)
        self._finish()

    def _encode(self, pending: Pending) -> Optional[str]:
        try:
            record = pending.record()
            if self.registrar.older_server:
                strip_v18(record)
            if self.tally.dropped:
                record["dropped_steps"] = self.tally.dropped
            return json.dumps(record, separators=(",", ":"), allow_nan=False)
        except Exception as exc:
            swallow("building a step record", exc)
            self.tally.rejected += 1
            return None

    def _finish(self) -> None:
        """Flush everything within the deadline, then tell the server the run ended."""
        deadline = self._deadline or time.monotonic()
        registrar = self.registrar
        while True:
            self.servers.retry_now()
            try:
                if registrar.token_refused:
                    break
                if not registrar.registered and not registrar.broken:
                    self.register()
                if registrar.registered and self.sender.drain_spool():
                    break
            except Exception as exc:
                swallow("reporter flush", exc)
                break
            if time.monotonic() + 0.5 >= deadline:
                break
            time.sleep(0.5)
        if registrar.registered and not registrar.broken and not len(self.spool):
            try:
                self.servers.client.finish(self.run_id, registrar.closing_rank())
            except (Unreachable, Refused) as err:
                logger.debug("gradflow: finish not recorded: %s", err)
            self.poll_alerts()
