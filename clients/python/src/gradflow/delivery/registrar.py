"""The run's standing on the server spoken to: registered there before any step
(again after a move to another server, or when the server lost the run), with the
fields an older server refuses left out, and the refusals that stop sending (a token
the server refuses: records are spooled; a registration it refuses: they are
counted as rejected)."""

from __future__ import annotations

from typing import NoReturn, Optional, cast

from .. import wire
from .._log import say
from .older_servers import refused_newer_field
from .servers import Servers
from .transport import Refused


class TokenRefused(Exception):
    """The server refused the ingest token: records are spooled, so that a run whose
    token is fixed can still be loaded (``gradflow-server import``)."""


class Registrar:
    """Registers the run where it is sent, and holds what the server refused."""

    def __init__(
        self,
        servers: Servers,
        registration: wire.RunRegistration,
        *,
        announce: bool,
    ) -> None:
        self.servers = servers
        self.run_id = servers.run_id
        self.body = registration
        # Says the run's dashboard URL when the registration is first accepted.
        self.announce = announce
        self._announced = False
        # The servers' move count when the run was registered (None: not registered).
        self._registered_at: Optional[int] = None
        self.broken: Optional[str] = None  # why nothing can be delivered any more
        # Why the server refuses this run's token: records are spooled, not sent.
        self.token_refused: Optional[str] = None
        # The server refused the registration's v1.8 `signals`: records are sent
        # without their v1.8 fields.
        self.older_server = False

    @property
    def registered(self) -> bool:
        """Whether the server spoken to now has the registration."""
        return self._registered_at == self.servers.moves

    def forget(self) -> None:
        """The server lost the run: it gets the registration again."""
        self._registered_at = None

    def register(self, timeout: Optional[float] = None) -> None:
        """Registers on the current server, or on the next ones in turn when it does
        not answer; raises Unreachable when none does, TokenRefused when the token is
        refused."""
        self.servers.in_turn(lambda: self.register_here(timeout))

    def register_here(self, timeout: Optional[float] = None) -> None:
        try:
            self._register_older_too(timeout)
        except Refused as err:
            # In a multi-rank run every rank registers: the server compares their bodies
            # without `rank` and `host`, so a conflict is a real one, said on each rank.
            if err.status in (401, 403):
                self.refuse_token(err)
            if err.status == 409:
                say(
                    f"run {self.run_id} already exists with a different registration "
                    f"({err.message}); its steps are still sent to it"
                )
            else:
                self.broken = f"the server refused the registration: {err}"
                say(self.broken)
        self._registered_at = self.servers.moves
        self.servers.answered()
        if self.announce and not self._announced:
            self._announced = True
            say(f"run {self.run_id}: {self.servers.dashboard()}")

    def _register_older_too(self, timeout: Optional[float]) -> None:
        """Registers; a server older than this client refuses a newer field (an
        unknown field is a 400): its count of mode-dependent modules (v1.9) and its
        instability signals (v1.8), when the error names them, then its wiring
        findings (v1.5) are left out in turn rather than not
        registering at all. Without `signals`, steps go without their v1.8 fields."""
        while True:
            try:
                self.servers.client.register(self.run_id, self.body, timeout)
                return
            except Refused as err:
                newer = refused_newer_field(self.body, err)
                if newer is None:
                    raise
                self.older_server = self.older_server or newer == "signals"
                self.body = cast(
                    wire.RunRegistration,
                    {k: v for k, v in self.body.items() if k != newer},
                )

    def refuse_token(self, err: Refused) -> NoReturn:
        """The server refused the ingest token: from now on records are spooled."""
        if self.token_refused is None:
            self.token_refused = str(err)
            say(
                f"the server refused the ingest token ({err}); the steps of run "
                f"{self.run_id} are spooled to {self.servers.spool_path}: set "
                "GRADFLOW_INGEST_TOKEN (or token=) to this server's ingest token, then "
                "load them with `gradflow-server import`"
            )
        raise TokenRefused(str(err))

    def closing_rank(self) -> Optional[int]:
        """This rank, in a run of several (its finish says that rank closed)."""
        if int(self.body.get("world_size", 1)) > 1 and "rank" in self.body:
            return int(self.body["rank"])
        return None
