"""A stand-in for the HTTP client: a server that can be switched off, or refuse."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from gradflow.delivery.transport import Refused, Unreachable


class FakeServer:
    """What `Reporter` talks to, recording what it was sent."""

    def __init__(self, server: str = "http://fake:1") -> None:
        self.server = server
        self.up = True
        self.refuse: Optional[Refused] = None  # answer every post with this
        self.registered: List[Dict[str, Any]] = []
        self.steps: List[int] = []
        self.finished = False
        self.open_alerts: List[Dict[str, Any]] = []

    def _answer(self) -> None:
        if not self.up:
            raise Unreachable("connection refused")

    def register(self, run_id: str, body: Any, timeout: Optional[float] = None) -> None:
        self._answer()
        self.registered.append(dict(body))

    def post_steps(self, run_id: str, lines: List[str]) -> Dict[str, Any]:
        self._answer()
        if self.refuse is not None:
            raise self.refuse
        self.steps.extend(json.loads(line)["step"] for line in lines)
        return {"accepted": len(lines)}

    def finish(self, run_id: str, rank: Optional[int] = None) -> None:
        self._answer()
        self.finished = True
        self.finished_rank = rank

    def alerts(self, run_id: str, status: str = "open") -> List[Dict[str, Any]]:
        self._answer()
        return list(self.open_alerts)


class Step:
    """A pending step whose record is already known."""

    def __init__(self, step: int) -> None:
        self.step = step

    def record(self) -> Dict[str, Any]:
        return {"step": self.step, "loss": 1.0}
