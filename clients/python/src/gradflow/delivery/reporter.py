"""The background thread that owns all I/O: registration, batches, spool, alerts.

The training thread only ``submit``s to a bounded queue and never waits: a full
queue drops the step and counts it (``dropped_steps`` in later records). The thread
sends a step at once when it was idle, and then gathers what arrives for ``gather``
seconds (or until a batch's worth is queued) before the next batch, instead of waking
on every step: each wake-up takes the interpreter's lock from the training thread and
each request costs a connection, so a fast loop's steps go out together, and a
process killed outright loses at most the last ``gather`` seconds. It
turns pending steps into records (waiting there for their device copies), posts them
in batches, and while the server is out of reach appends them to the on-disk spool,
which is replayed in order before anything newer once it answers again. A batch the
server refuses as invalid is split and resent, so only its invalid records are lost.

Given several servers (replicas of one database, or a standby started on the first's
database), it talks to one at a time. When the current one stops answering (a
refused connection, a timeout, a 5xx: ``Unreachable``) it moves to the next, round
robin, and says so once per switch; registration and the batch in hand go to the new
server. Resending is safe: the server stores a step once and counts a resent one as
a duplicate. While no server answers, records are spooled as with one server.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, NoReturn, Optional, Protocol, Sequence, Set, Tuple, cast
from urllib.parse import quote

from .. import wire
from .._log import logger, say, swallow
from .alerts import AlertBox
from .spool import Spool
from .transport import Client, Refused, Unreachable

_STOP = object()


class _TokenRefused(Exception):
    """The server refused the ingest token: records are spooled, so that a run whose
    token is fixed can still be loaded (``gradflow-server import``)."""


class Pending(Protocol):
    """A step on its way: its record is built on the reporter thread
    (``record.Pending``, whose numbers may still be on their way from the device)."""

    def record(self) -> wire.StepRecord: ...


@dataclass
class DeliverySummary:
    """What became of a run's step records, read at close."""

    delivered: int
    delivered_to: Dict[str, int]  # server -> step records it acknowledged
    pending: int  # still queued or in the spool
    dropped: int  # queue or spool full
    rejected: int  # refused by the server
    broken: Optional[str]  # why nothing could be delivered any more
    spool_path: str
    token_refused: Optional[str] = None  # why the server refused the token
    switches: List[Tuple[str, str]] = field(default_factory=list)
    late: int = 0  # refused as late: below the run's last stored step, never stored


class Reporter:
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
        if not clients:
            raise ValueError("no gradflow server to report to")
        self.clients = list(clients)
        self.current = 0  # index into clients of the server spoken to
        self.run_id = run_id
        self.registration = registration
        self.spool = spool
        self.alerts = alerts
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.alert_interval = alert_interval
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self.gather = gather
        # Set to wake the thread early: a step while it is idle, a batch's worth queued
        # (or half the queue, when smaller), or close.
        self._wake = threading.Event()
        self._wake_at = max(1, min(batch_size, queue_size // 2 if queue_size > 0 else batch_size))
        self._idle = False
        self.registered = False
        self.broken: Optional[str] = None  # why nothing can be delivered any more
        # Why the server refuses this run's token: records are spooled, not sent.
        self.token_refused: Optional[str] = None
        # Says the run's dashboard URL when the registration is first accepted.
        self.announce = announce
        self._announced = False
        self.outage: Optional[str] = None  # why the server is out of reach, while it is
        self.dropped = 0
        self.delivered = 0
        self.delivered_to: Dict[str, int] = {}  # server -> step records it acknowledged
        self.switches: List[Tuple[str, str]] = []
        self._said: Set[Tuple[str, str]] = set()  # switches said since a server answered
        self.rejected = 0
        self.late = 0
        # The server refused the registration's v1.8 `signals`: records are sent
        # without their v1.8 fields.
        self.older_server = False
        self._retry_at = 0.0
        self._backoff = 0.5
        self._next_poll = 0.0
        self._deadline: Optional[float] = None
        self._thread = threading.Thread(target=self._run, name="gradflow-reporter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def client(self) -> Client:
        """The client of the server spoken to now."""
        return self.clients[self.current]

    # -- training thread ---------------------------------------------------------

    def submit(self, pending: Pending) -> None:
        try:
            self._queue.put_nowait(pending)
        except queue.Full:
            self.dropped += 1
        if self._idle or self._queue.qsize() >= self._wake_at:
            self._idle = False
            self._wake.set()

    def register(self, timeout: Optional[float] = None) -> bool:
        """One registration attempt (on each server in turn); on failure the thread
        retries before any step."""
        try:
            self._register(timeout)
            return True
        except Unreachable as err:
            self._offline(err)
            return False
        except _TokenRefused:
            return False

    def dashboard(self) -> str:
        """The run's page on the server spoken to now."""
        return f"{self.client.server}/runs/{quote(self.run_id)}"

    def poll_alerts(self) -> None:
        if self.alerts is None or self.broken or not self.registered:
            return
        try:
            self.alerts.offer(self.client.alerts(self.run_id))
        except (Unreachable, Refused) as err:
            logger.debug("gradflow: could not read alerts: %s", err)

    def close(self, timeout: float) -> None:
        self._deadline = time.monotonic() + timeout
        self._wake.set()
        with contextlib.suppress(queue.Full):
            self._queue.put(_STOP, timeout=max(0.1, timeout))
        self._wake.set()
        self._thread.join(timeout + 1.0)

    @property
    def pending(self) -> int:
        return len(self.spool) + self._queue.qsize()

    def summary(self) -> DeliverySummary:
        return DeliverySummary(
            delivered=self.delivered,
            delivered_to=dict(self.delivered_to),
            pending=self.pending,
            dropped=self.dropped,
            rejected=self.rejected,
            broken=self.broken,
            spool_path=self.spool.path,
            token_refused=self.token_refused,
            switches=list(self.switches),
            late=self.late,
        )

    # -- reporter thread ---------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        busy = False  # the last wake-up found steps: gather before the next batch
        while not stopping:
            try:
                items: List[Pending] = []
                if self._queue.qsize() < self._wake_at:
                    if busy:
                        self._wake.wait(self.gather)
                    else:
                        self._idle = True
                        if self._queue.empty():
                            self._wake.wait(self.flush_interval)
                        self._idle = False
                self._wake.clear()
                while not stopping and len(items) < self.batch_size:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is _STOP:
                        stopping = True
                    else:
                        items.append(item)
                busy = bool(items)
                lines = [self._encode(p) for p in items]
                self._deliver([line for line in lines if line is not None])
                if time.monotonic() >= self._next_poll and not self._is_offline():
                    self._next_poll = time.monotonic() + self.alert_interval
                    self.poll_alerts()
            except Exception as exc:
                swallow("reporter", exc)
        self._finish()

    def _encode(self, pending: Pending) -> Optional[str]:
        try:
            record = pending.record()
            if self.older_server:
                strip_v18(record)
            if self.dropped:
                record["dropped_steps"] = self.dropped
            return json.dumps(record, separators=(",", ":"), allow_nan=False)
        except Exception as exc:
            swallow("building a step record", exc)
            self.rejected += 1
            return None

    def _is_offline(self) -> bool:
        return time.monotonic() < self._retry_at

    def _offline(self, err: Exception) -> None:
        """No server answered: wait before the next try, and say so once an outage."""
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, 5.0)
        if self.outage is None:
            self.outage = str(err)
            servers = ", ".join(c.server for c in self.clients)
            say(
                f"server {servers} unreachable ({err}); spooling the steps of run "
                f"{self.run_id} to {self.spool.path} until it answers"
            )

    def _online(self) -> None:
        self._retry_at = 0.0
        self._backoff = 0.5

    def _deliver(self, lines: List[str]) -> None:
        if self.broken:
            self.rejected += len(lines)
            return
        if self.token_refused:
            self.dropped += self.spool.append(lines)
            return
        if lines and (len(self.spool) or self._is_offline()):
            self.dropped += self.spool.append(lines)
            lines = []
        if self._is_offline():
            return
        if not self._drain_spool():
            if lines:
                self.dropped += self.spool.append(lines)
            return
        for start in range(0, len(lines), self.batch_size):
            chunk = lines[start : start + self.batch_size]
            try:
                self._send(chunk)
            except Unreachable as err:
                self._offline(err)
                self.dropped += self.spool.append(lines[start:])
                return
            except _TokenRefused:
                self.dropped += self.spool.append(lines[start:])
                return

    def _drain_spool(self) -> bool:
        while len(self.spool) and not self.broken:
            if self.token_refused:
                return False
            chunk = self.spool.peek(self.batch_size)
            try:
                self._send(chunk)
            except Unreachable as err:
                self._offline(err)
                return False
            except _TokenRefused:
                return False
            self.spool.advance(len(chunk))
        return True

    def _switch(self, why: str) -> bool:
        """Moves to the next server, if there is another; says so once per switch
        (a switch already said is not said again until some server has answered)."""
        if len(self.clients) < 2:
            return False
        before = self.client.server
        self.current = (self.current + 1) % len(self.clients)
        self.registered = False  # the new server gets the registration first
        switch = (before, self.client.server)
        self.switches.append(switch)
        if switch not in self._said:
            self._said.add(switch)
            say(
                f"server {before} is not answering ({why}); moving to {self.client.server} "
                "(steps are spooled meanwhile and resent there)"
            )
        return True

    def _answered(self) -> None:
        self._said.clear()
        self._online()
        if self.outage is not None:
            self.outage = None
            say(f"server {self.client.server} answers again; sending the spooled steps")

    def _register(self, timeout: Optional[float] = None) -> None:
        """Registers on the current server, or on the next ones in turn when it does
        not answer; raises Unreachable when none does."""
        for attempt in range(len(self.clients)):
            try:
                self._register_here(timeout)
                return
            except Unreachable as err:
                if attempt + 1 == len(self.clients) or not self._switch(str(err)):
                    raise

    def _register_here(self, timeout: Optional[float] = None) -> None:
        try:
            self._register_older_too(timeout)
        except Refused as err:
            # In a multi-rank run every rank registers: the server compares their bodies
            # without `rank` and `host`, so a conflict is a real one, said on each rank.
            if err.status in (401, 403):
                self._refuse_token(err)
            if err.status == 409:
                say(
                    f"run {self.run_id} already exists with a different registration "
                    f"({err.message}); its steps are still sent to it"
                )
            else:
                self.broken = f"the server refused the registration: {err}"
                say(self.broken)
        self.registered = True
        self._answered()
        if self.announce and not self._announced:
            self._announced = True
            say(f"run {self.run_id}: {self.dashboard()}")

    def _register_older_too(self, timeout: Optional[float]) -> None:
        """Registers; a server older than this client refuses a newer field (an
        unknown field is a 400): its instability signals (v1.8, when the error names
        them), then its wiring findings (v1.5) are left out in turn rather than not
        registering at all. Without `signals`, steps go without their v1.8 fields."""
        while True:
            try:
                self.client.register(self.run_id, self.registration, timeout)
                return
            except Refused as err:
                newer = _refused_newer_field(self.registration, err)
                if newer is None:
                    raise
                self.older_server = self.older_server or newer == "signals"
                self.registration = cast(
                    wire.RunRegistration,
                    {k: v for k, v in self.registration.items() if k != newer},
                )

    def _send(self, lines: List[str]) -> None:
        """Delivers lines (to the current server, or the next ones in turn when it does
        not answer) or accounts for them as rejected; raises Unreachable when no
        server answers."""
        if not lines:
            return
        for attempt in range(len(self.clients)):
            try:
                self._send_here(lines)
                return
            except Unreachable as err:
                if attempt + 1 == len(self.clients) or not self._switch(str(err)):
                    raise

    def _send_here(self, lines: List[str]) -> None:
        if not self.registered:
            self._register_here()
        if self.broken:
            self.rejected += len(lines)
            return
        try:
            answer = self.client.post_steps(self.run_id, lines)
        except Refused as err:
            if err.status == 404 and err.code == "run_not_found":
                self.registered = False  # the server lost the run: register it again
                self._register_here()
                answer = self.client.post_steps(self.run_id, lines)
            elif err.status in (400, 413) and len(lines) > 1:
                half = len(lines) // 2
                self._send(lines[:half])
                self._send(lines[half:])
                return
            elif err.status == 400 and (bare := _without_newer_fields(lines[0])) is not None:
                # A server older than this client refuses the wiring findings an
                # amendment carries (v1.5, kinds of v1.6), a graph cut's `via` (v1.6)
                # and `local_grads_nonfinite` (v1.7): the step goes without them
                # rather than not at all.
                self._send_here([bare])
                return
            else:
                if err.status in (401, 403):
                    self._refuse_token(err)
                self.rejected += len(lines)
                swallow(f"the server refused step records ({err.code})", err)
                return
        self._answered()
        late = int(answer.get("late", 0) or 0)
        if late and not self.late:
            say(
                f"the server refused {late} steps of run {self.run_id} as late: another writer "
                "of this run moved it past them, so they are not stored (told once; the "
                "count is in the summary at close)"
            )
        self.late += late
        self.delivered += len(lines) - late
        server = self.client.server
        self.delivered_to[server] = self.delivered_to.get(server, 0) + len(lines) - late

    def _refuse_token(self, err: Refused) -> NoReturn:
        """The server refused the ingest token: from now on records are spooled."""
        if self.token_refused is None:
            self.token_refused = str(err)
            say(
                f"the server refused the ingest token ({err}); the steps of run "
                f"{self.run_id} are spooled to {self.spool.path}: set GRADFLOW_INGEST_TOKEN "
                "(or token=) to this server's ingest token, then load them with "
                f"`gradflow-server import`"
            )
        raise _TokenRefused(str(err))

    def _closing_rank(self) -> Optional[int]:
        """This rank, in a run of several (its finish says that rank closed)."""
        if int(self.registration.get("world_size", 1)) > 1 and "rank" in self.registration:
            return int(self.registration["rank"])
        return None

    def _finish(self) -> None:
        """Flush everything within the deadline, then tell the server the run ended."""
        deadline = self._deadline or time.monotonic()
        while True:
            self._retry_at = 0.0
            try:
                if self.token_refused:
                    break
                if not self.registered and not self.broken:
                    self.register()
                if self.registered and self._drain_spool():
                    break
            except Exception as exc:
                swallow("reporter flush", exc)
                break
            if time.monotonic() + 0.5 >= deadline:
                break
            time.sleep(0.5)
        if self.registered and not self.broken and not len(self.spool):
            try:
                self.client.finish(self.run_id, self._closing_rank())
            except (Unreachable, Refused) as err:
                logger.debug("gradflow: finish not recorded: %s", err)
            self.poll_alerts()


def _refused_newer_field(registration: Any, err: Refused) -> Optional[str]:
    """The newer field of `registration` an older server refused with `err`, if any."""
    if err.status != 400:
        return None
    said = f"{err.message or ''} {err.path or ''}"
    if "signals" in registration and "signals" in said:
        return "signals"
    return "wiring" if "wiring" in registration else None


V18_STEP_FIELDS = ("output_logits", "moe", "batch")
V18_MODULE_FIELDS = ("attn_max_logit", "attn_min_entropy", "act_rms", "act_absmax", "adam")


def strip_v18(record: Any) -> bool:
    """Removes a record's v1.8 fields (the instability signals) in place: module
    entries that carried nothing else go; True when anything was removed."""
    changed = False
    for key in V18_STEP_FIELDS:
        changed = record.pop(key, None) is not None or changed
    modules = record.get("modules")
    if not isinstance(modules, list):
        return changed
    kept = []
    for entry in modules:
        if isinstance(entry, dict):
            removed = [entry.pop(key) for key in V18_MODULE_FIELDS if key in entry]
            changed = changed or bool(removed)
            if removed and set(entry) == {"module"}:
                continue
        kept.append(entry)
    if len(kept) != len(modules):
        record["modules"] = kept
    if not kept:
        record.pop("modules", None)
    return changed


def _without_newer_fields(line: str) -> Optional[str]:
    """The encoded step record `line` without what a server of an older protocol
    refuses (its instability signals, its amendment's wiring findings, its graph
    cuts' `via`, its `local_grads_nonfinite`), or None when it carries none of them."""
    try:
        record = json.loads(line)
        changed = strip_v18(record)
        changed = record.pop("local_grads_nonfinite", None) is not None or changed
        amend = record.get("amend")
        if isinstance(amend, dict) and "wiring" in amend:
            del amend["wiring"]
            if not amend:
                del record["amend"]
            changed = True
        for cut in record.get("graph_cuts") or []:
            if isinstance(cut, dict) and cut.pop("via", None) is not None:
                changed = True
        return json.dumps(record, separators=(",", ":")) if changed else None
    except (ValueError, AttributeError, TypeError):
        return None
