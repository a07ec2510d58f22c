"""What became of a run's step records: counted while the run goes, summed up at close."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


@dataclass
class Tally:
    """The run's step records so far, counted by whoever settled each: the queue (full:
    dropped), the sender (acknowledged, refused as late or invalid, or the spool full)
    and the reporter thread (a record it could not build)."""

    delivered: int = 0
    delivered_to: Dict[str, int] = field(default_factory=dict)  # server -> acknowledged
    dropped: int = 0  # queue or spool full
    rejected: int = 0  # refused by the server, or not built
    late: int = 0  # refused as late: below the run's last stored step, never stored

    def acknowledged(self, server: str, lines: int, late: int) -> None:
        """`server` took `lines` records, `late` of them refused as late."""
        self.late += late
        self.delivered += lines - late
        self.delivered_to[server] = self.delivered_to.get(server, 0) + lines - late


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
