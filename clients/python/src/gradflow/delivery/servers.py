"""Which of a run's servers is spoken to, and what to do when it stops answering.

Given several servers (replicas of one database, or a standby started on the first's
database), the reporter talks to one at a time. When the current one stops answering
(a refused connection, a timeout, a 5xx: ``Unreachable``) it moves to the next, round
robin, and says so once per switch; registration and the batch in hand go to the new
server. Resending is safe: the server stores a step once and counts a resent one as
a duplicate. While no server answers, the reporter waits before trying again (a
backoff up to 5 s) and records are spooled, as with one server.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence, Set, Tuple
from urllib.parse import quote

from .._log import say
from .transport import Client, Unreachable


class Servers:
    """The servers of one run, one spoken to at a time, and the outage while none
    answers."""

    def __init__(self, clients: Sequence[Client], run_id: str, spool_path: str) -> None:
        if not clients:
            raise ValueError("no gradflow server to report to")
        self.clients = list(clients)
        self.current = 0  # index into clients of the server spoken to
        self.run_id = run_id
        self.spool_path = spool_path
        self.switches: List[Tuple[str, str]] = []
        self._said: Set[Tuple[str, str]] = set()  # switches said since a server answered
        self.outage: Optional[str] = None  # why the server is out of reach, while it is
        self._retry_at = 0.0
        self._backoff = 0.5

    @property
    def client(self) -> Client:
        """The client of the server spoken to now."""
        return self.clients[self.current]

    @property
    def moves(self) -> int:
        """How many times the run moved to another server (a registration made before
        the last move is on another server)."""
        return len(self.switches)

    def dashboard(self) -> str:
        """The run's page on the server spoken to now."""
        return f"{self.client.server}/runs/{quote(self.run_id)}"

    def in_turn(self, attempt: Callable[[], None]) -> None:
        """Runs `attempt` against the current server, or the next ones in turn when it
        does not answer; raises Unreachable when none does."""
        for n in range(len(self.clients)):
            try:
                attempt()
                return
            except Unreachable as err:
                if n + 1 == len(self.clients) or not self._switch(str(err)):
                    raise

    def _switch(self, why: str) -> bool:
        """Moves to the next server, if there is another; says so once per switch
        (a switch already said is not said again until some server has answered)."""
        if len(self.clients) < 2:
            return False
        before = self.client.server
        self.current = (self.current + 1) % len(self.clients)
        switch = (before, self.client.server)
        self.switches.append(switch)
        if switch not in self._said:
            self._said.add(switch)
            say(
                f"server {before} is not answering ({why}); moving to {self.client.server} "
                "(steps are spooled meanwhile and resent there)"
            )
        return True

    # -- the outage --------------------------------------------------------------

    def is_offline(self) -> bool:
        """Whether the wait after the last unanswered try is still running."""
        return time.monotonic() < self._retry_at

    def retry_now(self) -> None:
        """The next try goes at once (the flush at close)."""
        self._retry_at = 0.0

    def offline(self, err: Exception) -> None:
        """No server answered: wait before the next try, and say so once an outage."""
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, 5.0)
        if self.outage is None:
            self.outage = str(err)
            servers = ", ".join(c.server for c in self.clients)
            say(
                f"server {servers} unreachable ({err}); spooling the steps of run "
                f"{self.run_id} to {self.spool_path} until it answers"
            )

    def answered(self) -> None:
        """The server spoken to answered: the outage, if any, is over."""
        self._said.clear()
        self._retry_at = 0.0
        self._backoff = 0.5
        if self.outage is not None:
            self.outage = None
            say(f"server {self.client.server} answers again; sending the spooled steps")
