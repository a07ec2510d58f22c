"""Steps another writer of the same run got ahead of: the server refuses them as
late (never stored), and the client says so once and counts them at close."""

from __future__ import annotations

import json
import urllib.request

import torch
from conftest import PromptAgent, batches, new_run_id
from torch import nn

import gradflow


def post_step(server, run_id: str, step: int) -> dict:
    body = json.dumps([{"step": step, "loss": 1.0}]).encode()
    request = urllib.request.Request(
        f"{server.url}/api/v1/runs/{run_id}/steps",
        data=body,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())


def test_steps_refused_as_late_are_said_once_and_counted_at_close(gradflow_server, capfd):
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run_id = new_run_id("late")
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=run_id)
    # A second writer of the same run (a stale copy of the job, a resend through
    # another replica) stores step 1000 before this one sends anything.
    assert post_step(gradflow_server, run_id, 1000)["accepted"] == 1
    data = batches(6)
    for _ in range(6):
        optimizer.zero_grad()
        tokens, target = next(data)
        loss = nn.functional.cross_entropy(model(tokens), target)
        loss.backward()
        optimizer.step()
        gf.step(loss=loss)
    gf.close()
    err = capfd.readouterr().err
    assert err.count("as late") == 2, err  # once when it happens, once at close
    assert "6 refused as late" in err, err
    # Only the other writer's step is stored.
    assert gradflow_server.run(run_id)["step_count"] == 1
