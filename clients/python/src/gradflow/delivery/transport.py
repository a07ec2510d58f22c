"""The HTTP side of the protocol, with the standard library only (urllib)."""

from __future__ import annotations

import gzip
import json
import socket
import urllib.error
import urllib.request
from typing import Any, Dict, List, Mapping, Optional, cast
from urllib.parse import quote

from .. import wire

GZIP_ABOVE = 8 * 1024


class Unreachable(Exception):
    """The server could not be reached or did not answer in time; worth retrying."""


class Refused(Exception):
    """The server answered with an error that resending the same body cannot fix."""

    def __init__(self, status: int, code: str, message: str, path: Optional[str]) -> None:
        self.status, self.code, self.message, self.path = status, code, message, path
        where = f" at {path}" if path else ""
        super().__init__(f"HTTP {status} {code}: {message}{where}")


class Client:
    def __init__(self, server: str, token: Optional[str], timeout: float = 10.0) -> None:
        self.server = server
        self.token = token
        self.timeout = timeout

    def _request(
        self,
        method: str,
        path: str,
        body: Optional[bytes] = None,
        gzipped: bool = False,
        timeout: Optional[float] = None,
    ) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
            if gzipped:
                headers["Content-Encoding"] = "gzip"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(
            self.server + path, data=body, method=method, headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                data = response.read()
                return json.loads(data) if data else None
        except urllib.error.HTTPError as err:
            raw = err.read()
            if err.code in (408, 429, 500, 502, 503, 504):
                raise Unreachable(f"HTTP {err.code}") from None
            try:
                detail = json.loads(raw)["error"]
                raise Refused(
                    err.code, detail.get("code", ""), detail.get("message", ""), detail.get("path")
                ) from None
            except (ValueError, KeyError, TypeError):
                # Not gradflow's JSON error: say so in one line, never the page itself.
                kind = err.headers.get("Content-Type", "no content type") if err.headers else ""
                raise Refused(
                    err.code,
                    "",
                    f"{self.server} answered with a {kind or 'non-JSON'} body, not a gradflow "
                    "error: is it a gradflow server?",
                    None,
                ) from None
        except (urllib.error.URLError, OSError, socket.timeout) as err:
            raise Unreachable(str(getattr(err, "reason", None) or err)) from None

    def register(
        self, run_id: str, body: Mapping[str, object], timeout: Optional[float] = None
    ) -> None:
        data = json.dumps(body, allow_nan=False).encode()
        self._request("PUT", f"/api/v1/runs/{quote(run_id)}", data, timeout=timeout)

    def post_steps(self, run_id: str, lines: List[str]) -> Dict[str, Any]:
        """Posts already-encoded step records (one JSON object each) as one batch."""
        body = ("[" + ",".join(lines) + "]").encode()
        gzipped = len(body) > GZIP_ABOVE
        if gzipped:
            body = gzip.compress(body, compresslevel=1)
        return self._request("POST", f"/api/v1/runs/{quote(run_id)}/steps", body, gzipped) or {}

    def finish(self, run_id: str, rank: Optional[int] = None) -> None:
        """Marks the run finished; with `rank` (v1.5), that rank of a multi-rank run
        closed, so the steps it did not send are completed without waiting for it."""
        query = "" if rank is None else f"?rank={int(rank)}"
        self._request("POST", f"/api/v1/runs/{quote(run_id)}/finish{query}", b"")

    def runs(self) -> List[str]:
        """The ids of every run the server has."""
        answer = self._request("GET", "/api/v1/runs") or {}
        return [run["run_id"] for run in answer.get("runs", [])]

    def alerts(self, run_id: str, status: str = "open") -> List[wire.Alert]:
        answer = self._request("GET", f"/api/v1/runs/{quote(run_id)}/alerts?status={status}")
        return cast(List[wire.Alert], list((answer or {}).get("alerts", [])))
