"""A server of an older protocol version: what it refuses as unknown must not cost
the run its registration or its steps.

A release of the server can only be run as the binary of its own version, so this
file stands in for one with a small HTTP server that answers as a protocol v1.4
server does (400 `invalid_body` for an unknown field: the v1.9
`mode_dependent_modules` or the v1.5 `wiring`, in a registration, or `wiring` in an
amendment) and keeps what it accepts.
"""

from __future__ import annotations

import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from torch import nn

import gradflow


class OlderServer(ThreadingHTTPServer):
    """Keeps the registrations and step records it accepted."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.registrations: list[dict] = []
        self.steps: list[dict] = []
        self.refused = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: OlderServer

    def log_message(self, *_args) -> None:  # quiet
        pass

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refuse(self, field: str) -> None:
        self.server.refused += 1
        self._answer(
            400,
            {"error": {"code": "invalid_body", "message": f"unknown field `{field}`"}},
        )

    def _body(self) -> bytes:
        data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Content-Encoding") == "gzip":
            data = gzip.decompress(data)
        return data

    def do_PUT(self) -> None:
        body = json.loads(self._body())
        for newer in ("mode_dependent_modules", "wiring"):
            if newer in body:
                return self._refuse(newer)
        self.server.registrations.append(body)
        self._answer(201, {})

    def do_POST(self) -> None:
        data = self._body()
        if not self.path.endswith("/steps"):
            return self._answer(200, {})
        records = json.loads(data)
        if any("wiring" in (r.get("amend") or {}) for r in records):
            return self._refuse("wiring")
        self.server.steps.extend(records)
        self._answer(200, {"accepted": len(records), "duplicates": 0})

    def do_GET(self) -> None:
        self._answer(200, {"alerts": [], "runs": []})


def test_wiring_findings_an_older_server_refuses_cost_no_step(tmp_path):
    """The registration carries a wiring finding (an empty parameter group with its
    own lr) and an amendment carries another (a clip after the optimizer step): the
    older server refuses both bodies (the registration for its count of
    mode-dependent modules too), and the client sends each again without what it
    refused, so the run is registered and every step is stored."""
    server = OlderServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        optimizer = torch.optim.SGD(
            [{"params": model.parameters()}, {"params": [], "lr": 1e-5}], lr=0.05
        )
        gf = gradflow.watch(
            model,
            optimizer,
            server=server.url,
            run_id="older-server",
            on_alert=None,
            spool_dir=str(tmp_path / "spool"),
        )
        for _ in range(20):
            optimizer.zero_grad(set_to_none=True)
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            optimizer.step()
            nn.utils.clip_grad_norm_(model.parameters(), 1e-4)  # too late to act
            gf.step(loss=loss)
        gf.close()
    finally:
        server.shutdown()
        server.server_close()
    assert server.refused >= 3, "the newer fields were sent, and refused"
    assert len(server.registrations) >= 1
    assert all("wiring" not in r for r in server.registrations)
    assert all("mode_dependent_modules" not in r for r in server.registrations)
    assert sorted(r["step"] for r in server.steps) == list(range(20))
