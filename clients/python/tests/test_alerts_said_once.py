"""In the training process each alert is said once, short, on one channel: what, where,
the fix and the run's page, on stderr; an episode the server closes and opens again
is not said again."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import new_run_id
from test_alerts_reach_the_person import run_script


def test_an_alert_is_four_lines_once_and_never_also_a_warning(tmp_path, gradflow_server):
    run_id = new_run_id("once")
    done = run_script(tmp_path, gradflow_server.url, run_id)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("grad_stuck_zero on qwen") == 1, done.stderr
    assert "Warning" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    at = next(i for i, line in enumerate(lines) if "grad_stuck_zero on qwen" in line)
    title, where, fix, page = lines[at : at + 4]
    assert title.startswith("gradflow: [critical] grad_stuck_zero on qwen: "), title
    assert where.startswith("  where: qwen (no_grad) at "), where
    assert fix.startswith("  fix: "), fix
    assert page == f"  see: {gradflow_server.url}/runs/{run_id}"


def test_raise_mode_says_the_alert_once_in_the_traceback(tmp_path, gradflow_server):
    run_id = new_run_id("raised-once")
    done = run_script(tmp_path, gradflow_server.url, run_id, mode="raise", steps=40)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.count("[critical] grad_stuck_zero on qwen") == 1, done.stderr
    assert "gradflow.errors.TrainingAlert: [critical] grad_stuck_zero on qwen" in done.stderr
    assert f"see: {gradflow_server.url}/runs/{run_id}" in done.stderr


# A loss that jumps tenfold, comes back and jumps again: loss_divergence opens,
# its condition ends, and it holds again within the hold (one episode).
FLAPPING = textwrap.dedent(
    """
    import sys, time
    import torch
    from torch import nn
    import gradflow

    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    gf = gradflow.watch(model, optimizer, server=sys.argv[1], run_id=sys.argv[2])
    # Tenfold at once (open), back for twelve steps (the episode's condition ends),
    # tenfold again on six (the same episode, within its hold), back.
    losses = [1.0] + [20.0] * 3 + [1.0] * 12 + [20.0] * 6 + [1.0] * 3
    for loss in losses:
        optimizer.zero_grad()
        model(torch.randn(2, 4)).pow(2).mean().backward()
        optimizer.step()
        gf.step(loss=loss)
        time.sleep(0.3)  # the client polls the run's alerts every second
    gf.close()
    """
)


def test_an_episode_that_reopens_is_said_once(tmp_path, gradflow_server):
    run_id = new_run_id("flapping")
    script = tmp_path / "flapping.py"
    script.write_text(FLAPPING)
    done = subprocess.run(
        [sys.executable, str(script), gradflow_server.url, run_id],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    raised = [a for a in gradflow_server.alerts(run_id) if a["kind"] == "loss_divergence"]
    assert raised, gradflow_server.alerts(run_id)
    # One episode, which the second jump continued.
    assert len(raised) == 1 and raised[0]["last_step"] >= 20, raised
    assert done.stderr.count("loss_divergence on loss") == 1, done.stderr
