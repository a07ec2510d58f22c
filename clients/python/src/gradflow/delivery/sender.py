"""Step records to the server, in batches, after what the spool holds.

While no server answers, or the server refuses the token, records are appended to
the on-disk spool, which is replayed in order before anything newer once a server
answers again, so the server always receives steps in order. A batch the server
refuses as invalid is split and resent, so only its invalid records are lost; a
record an older server refuses goes again without the fields it does not know.
"""

from __future__ import annotations

from typing import List

from .._log import say, swallow
from .older_servers import without_newer_fields
from .registrar import Registrar, TokenRefused
from .servers import Servers
from .spool import Spool
from .tally import Tally
from .transport import Refused, Unreachable


class Sender:
    """Sends encoded step records, or spools them, and counts what became of them."""

    def __init__(
        self,
        servers: Servers,
        registrar: Registrar,
        spool: Spool,
        tally: Tally,
        batch_size: int,
    ) -> None:
        self.servers = servers
        self.registrar = registrar
        self.spool = spool
        self.tally = tally
        self.batch_size = batch_size
        self.run_id = servers.run_id

    def deliver(self, lines: List[str]) -> None:
        """Sends `lines` after the spool's, or appends them to it."""
        if self.registrar.broken:
            self.tally.rejected += len(lines)
            return
        if self.registrar.token_refused:
            self.tally.dropped += self.spool.append(lines)
            return
        if lines and (len(self.spool) or self.servers.is_offline()):
            self.tally.dropped += self.spool.append(lines)
            lines = []
        if self.servers.is_offline():
            return
        if not self.drain_spool():
            if lines:
                self.tally.dropped += self.spool.append(lines)
            return
        for start in range(0, len(lines), self.batch_size):
            chunk = lines[start : start + self.batch_size]
            try:
                self._send(chunk)
            except Unreachable as err:
                self.servers.offline(err)
                self.tally.dropped += self.spool.append(lines[start:])
                return
            except TokenRefused:
                self.tally.dropped += self.spool.append(lines[start:])
                return

    def drain_spool(self) -> bool:
        """Sends what the spool holds, in order; False when some is left."""
        while len(self.spool) and not self.registrar.broken:
            if self.registrar.token_refused:
                return False
            chunk = self.spool.peek(self.batch_size)
            try:
                self._send(chunk)
            except Unreachable as err:
                self.servers.offline(err)
                return False
            except TokenRefused:
                return False
            self.spool.advance(len(chunk))
        return True

    def _send(self, lines: List[str]) -> None:
        """Delivers lines (to the current server, or the next ones in turn when it does
        not answer) or accounts for them as rejected; raises Unreachable when no
        server answers."""
        if not lines:
            return
        self.servers.in_turn(lambda: self._send_here(lines))

    def _send_here(self, lines: List[str]) -> None:
        registrar = self.registrar
        if not registrar.registered:
            registrar.register_here()
        if registrar.broken:
            self.tally.rejected += len(lines)
            return
        client = self.servers.client
        try:
            answer = client.post_steps(self.run_id, lines)
        except Refused as err:
            if err.status == 404 and err.code == "run_not_found":
                registrar.forget()  # the server lost the run: register it again
                registrar.register_here()
                answer = client.post_steps(self.run_id, lines)
            elif err.status in (400, 413) and len(lines) > 1:
                half = len(lines) // 2
                self._send(lines[:half])
                self._send(lines[half:])
                return
            elif err.status == 400 and (bare := without_newer_fields(lines[0])) is not None:
                # A server older than this client refuses the wiring findings an
                # amendment carries (v1.5, kinds of v1.6), a graph cut's `via` (v1.6)
                # and `local_grads_nonfinite` (v1.7): the step goes without them
                # rather than not at all.
                self._send_here([bare])
                return
            else:
                if err.status in (401, 403):
                    registrar.refuse_token(err)
                self.tally.rejected += len(lines)
                swallow(f"the server refused step records ({err.code})", err)
                return
        self.servers.answered()
        late = int(answer.get("late", 0) or 0)
        if late and not self.tally.late:
            say(
                f"the server refused {late} steps of run {self.run_id} as late: another writer "
                "of this run moved it past them, so they are not stored (told once; the "
                "count is in the summary at close)"
            )
        self.tally.acknowledged(self.servers.client.server, len(lines), late)
