"""Getting one run's records to the server: the spool, the reporter thread, and what
the person running training is told about it.

:class:`Delivery` builds the transport side of a watched run from its options
(one client per server, the spool file, the reporter), registers the run before the
first step, and at close waits for what is left (bounded), leaves a spool that
``gradflow report`` and ``gradflow-server import`` can read, and says in one line what
could not be delivered. It knows nothing of torch.
"""

from __future__ import annotations

import os
import tempfile
from typing import List, Optional, Protocol

from .. import wire
from .._log import say
from .alerts import AlertBox
from .reporter import Reporter
from .spool import Spool
from .step_queue import Pending
from .tally import DeliverySummary
from .transport import Client


class DeliveryOptions(Protocol):
    """The options delivery reads (:class:`gradflow.options.WatchOptions` has them):
    where to send, with which token, the spool's place and size, the queue's length."""

    @property
    def servers(self) -> List[str]: ...

    @property
    def token(self) -> Optional[str]: ...

    @property
    def spool_dir(self) -> Optional[str]: ...

    @property
    def spool_max_bytes(self) -> int: ...

    @property
    def queue_size(self) -> int: ...


class Delivery:
    """The transport side of one watched run."""

    def __init__(
        self,
        options: DeliveryOptions,
        run_id: str,
        registration: wire.RunRegistration,
        *,
        rank: Optional[int],
        alerts: Optional[AlertBox],
        label: str,
        announce: bool = True,
    ) -> None:
        self.options = options
        self.run_id = run_id
        self.label = label
        directory = options.spool_dir or os.path.join(tempfile.gettempdir(), "gradflow-spool")
        # Each rank spools to a file of its own.
        who = f"rank{rank}." if rank is not None else ""
        spool = Spool(
            os.path.join(directory, f"{run_id}.{who}{os.getpid()}.ndjson"),
            options.spool_max_bytes,
            sidecar={"run_id": run_id, "registration": registration},
        )
        self.reporter = Reporter(
            [Client(url, options.token) for url in options.servers],
            run_id,
            registration,
            spool,
            alerts,
            queue_size=options.queue_size,
            announce=announce,
        )

    def start(self) -> None:
        """Registers (one attempt: registration-time verdicts, a GradScaler over bf16
        parameters, come before the first step, so their alerts are read now) and
        starts the reporter thread, which retries before any step."""
        if self.reporter.register(timeout=3.0):
            self.reporter.poll_alerts()
        self.reporter.start()

    def submit(self, pending: Pending) -> None:
        self.reporter.submit(pending)

    def alerts(self) -> List[wire.Alert]:
        """The run's open alerts on the server spoken to now (raises Unreachable or
        Refused)."""
        return self.reporter.open_alerts()

    def dashboard(self) -> str:
        """The run's page on the server spoken to now."""
        return self.reporter.dashboard()

    def close(self, timeout: float) -> DeliverySummary:
        """Delivers what is left within `timeout` seconds, marks the run finished, and
        says what was not delivered and where it is kept. While the server is out of
        reach the wait is said first; Ctrl-C during it stops waiting, and what is left
        stays in the spool (whose registration was written beside it already)."""
        r = self.reporter
        backlog = r.backlog()
        if backlog is not None and timeout > 1.0:
            say(
                f"{self.label}: waiting up to {timeout:.0f} s for {backlog.server} to take "
                f"{backlog.steps} steps (Ctrl-C to stop waiting; they are kept in "
                f"{backlog.spool_path})"
            )
        try:
            r.close(timeout)
        except KeyboardInterrupt:
            # The thread may still be writing the spool: leave the file as it is (its
            # lines are flushed as written; a line delivered already is a duplicate
            # the server skips on import).
            summary = r.summary()
            say(f"{self.label}: interrupted; {describe(summary, self.options.servers)}")
            return summary
        summary = r.summary()
        r.close_spool()
        line = describe(summary, self.options.servers)
        if line is not None:
            say(f"{self.label}: {line}")
        return summary


def describe(summary: DeliverySummary, servers: List[str]) -> Optional[str]:
    """The close line for the person running training; None when every step was
    delivered to the one server."""
    s = summary
    where = ", ".join(f"{n} to {url}" for url, n in s.delivered_to.items())
    where = where or f"none to {', '.join(servers)}"
    if s.pending or s.dropped or s.rejected or s.late or s.broken:
        parts = []
        if s.pending:
            why = " because the server refused the ingest token" if s.token_refused else ""
            parts.append(
                f"{s.pending} still queued{why} (kept in {s.spool_path}; read them with "
                f"`gradflow report {s.spool_path}`, or load them into a server's database "
                f"with `gradflow-server --db gradflow.db import {s.spool_path}`)"
            )
        if s.dropped:
            parts.append(f"{s.dropped} dropped (queue or spool full)")
        if s.rejected:
            parts.append(f"{s.rejected} refused by the server")
        if s.late:
            parts.append(f"{s.late} refused as late (another writer moved the run past them)")
        return f"delivered {s.delivered} steps ({where}); NOT delivered: " + (
            ", ".join(parts) or str(s.broken)
        )
    if s.switches:
        return f"delivered all {s.delivered} steps ({where})"
    return None
