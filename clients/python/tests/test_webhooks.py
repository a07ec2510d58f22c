"""A run's own webhooks: the alert a PyTorch loop raises reaches a real HTTP receiver
that the run named in ``gradflow.watch(webhooks=...)``."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List

import pytest
import torch
from conftest import PromptAgent, new_run_id, train

import gradflow
from gradflow.options import webhook_specs


class Receiver:
    """An HTTP server on 127.0.0.1 that keeps every JSON body POSTed to it."""

    def __init__(self) -> None:
        self.bodies: List[Dict[str, Any]] = []
        bodies = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                length = int(self.headers.get("Content-Length", "0"))
                bodies.append(json.loads(self.rfile.read(length)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def wait_for(self, predicate: Any, timeout: float = 20.0) -> List[Dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [b for b in list(self.bodies) if predicate(b)]
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"no matching body among {self.bodies}")


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.httpd.shutdown()
    r.httpd.server_close()


def test_a_cut_graph_is_posted_to_the_runs_webhook(gradflow_server, receiver):
    model = PromptAgent(detach_prompt=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(
        model,
        optimizer,
        server=gradflow_server.url,
        run_id=new_run_id(),
        on_alert=None,
        detectors={"stuck_zero_steps": 10},
        webhooks=[receiver.url],
    )
    # Readers are shown where it goes, not its path (where webhook URLs keep secrets).
    shown = gradflow_server.run(gf.run_id)["webhooks"]
    assert shown == [{"url": receiver.url.rsplit("/", 1)[0]}], shown
    train(model, optimizer, gf, 12)
    gf.close()
    opened = receiver.wait_for(
        lambda b: b["event"] == "alert.opened" and b["alert"]["kind"] == "grad_stuck_zero"
    )
    alert = opened[0]["alert"]
    assert (alert["run_id"], alert["subject"]) == (gf.run_id, "qwen")
    assert alert["evidence"]["cause"] == "backward_not_reached"
    # The hint of the first steps is info: below the default min_severity.
    assert not [b for b in receiver.bodies if b["alert"]["kind"] == "first_step_hint"]


def test_webhook_arguments_become_the_protocols_objects():
    slack = "https://hooks.slack.com/services/T0/B0/x"
    assert webhook_specs(None) is None
    assert webhook_specs(slack) == [{"url": slack, "format": "slack"}]
    assert webhook_specs(["http://h/a", {"url": "http://h/b", "min_severity": "info"}]) == [
        {"url": "http://h/a"},
        {"url": "http://h/b", "min_severity": "info"},
    ]
    with pytest.raises(TypeError, match="neither a URL"):
        webhook_specs([42])
