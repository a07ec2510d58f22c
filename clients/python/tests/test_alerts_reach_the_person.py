"""Alerts and delivery trouble reach the person running training: on stderr whatever
the warning filters, once each, with the run's dashboard URL (test_alerts_said_once:
in four lines, never also as a warning); a critical alert in
raise mode is never dropped at close; an unreachable server or a refused token is said
at once, and what could not be sent stays importable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
from conftest import PromptAgent, ServerProcess, free_port, new_run_id, server_binary, train

import gradflow

TESTS = os.path.dirname(os.path.abspath(__file__))

# A training script whose prompt encoder is cut from backward (the alert opens after
# 5 steps), run as a user runs it: its own process, its own stderr.
SCRIPT = """\
import sys
sys.path.insert(0, {tests!r})
import warnings
import torch
from tiny_models import PromptAgent, batches
import gradflow

{prelude}
model = PromptAgent(detach_prompt=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
gf = gradflow.watch(model, optimizer, server={url!r}, run_id={run_id!r},
                    detectors={{"stuck_zero_steps": 5}}, on_alert={mode!r})
for step, (tokens, target) in enumerate(batches({steps})):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(tokens), target)
    loss.backward()
    optimizer.step()
    gf.step(loss=loss)
    {pause}
{close}
"""


def run_script(
    tmp_path,
    url: str,
    run_id: str,
    *,
    mode: str = "warn",
    steps: int = 40,
    prelude: str = "",
    pause: str = "import time; time.sleep(0.05)",
    close: str = "gf.close()",
    flags: tuple = (),
) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(
        SCRIPT.format(
            tests=TESTS,
            prelude=prelude,
            url=url,
            run_id=run_id,
            mode=mode,
            steps=steps,
            pause=pause,
            close=close,
        )
    )
    return subprocess.run(
        [sys.executable, *flags, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )


def test_alerts_reach_stderr_under_w_ignore_with_the_dashboard_url(tmp_path, gradflow_server):
    run_id = new_run_id("ignored")
    done = run_script(tmp_path, gradflow_server.url, run_id, flags=("-W", "ignore"))
    assert done.returncode == 0, done.stderr
    page = f"{gradflow_server.url}/runs/{run_id}"
    assert f"gradflow: run {run_id}: {page}" in done.stderr, done.stderr
    shown = done.stderr.count("gradflow: [critical] grad_stuck_zero on qwen")
    assert shown == 1, done.stderr
    assert f"see: {page}" in done.stderr


def test_filterwarnings_ignore_in_the_script_hides_no_alert(tmp_path, gradflow_server):
    run_id = new_run_id("filtered")
    done = run_script(
        tmp_path, gradflow_server.url, run_id, prelude='warnings.filterwarnings("ignore")'
    )
    assert done.stderr.count("gradflow: [critical] grad_stuck_zero on qwen") == 1, done.stderr


def test_raise_mode_raises_a_critical_alert_that_arrives_during_close(tmp_path, gradflow_server):
    # Five steps, and the detector needs five: the verdict can only come from the
    # last step's record, after the loop, while close delivers it.
    run_id = new_run_id("late")
    done = run_script(tmp_path, gradflow_server.url, run_id, mode="raise", steps=5, pause="")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "gradflow.errors.TrainingAlert: [critical] grad_stuck_zero on qwen" in done.stderr
    assert "gf.close()" in done.stderr  # raised from the close call
    assert done.stderr.count("[critical] grad_stuck_zero on qwen") == 1  # raised, not also said


def test_raise_mode_without_close_exits_non_zero_at_exit(tmp_path, gradflow_server):
    run_id = new_run_id("late-exit")
    done = run_script(
        tmp_path, gradflow_server.url, run_id, mode="raise", steps=5, pause="", close=""
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "gradflow: [critical] grad_stuck_zero on qwen" in done.stderr
    assert "stopping with exit status 1" in done.stderr


def test_an_unreachable_server_is_said_at_once_and_when_it_is_back(tmp_path, capfd):
    server = ServerProcess(tmp_path / "late.db", free_port())
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(
        model,
        optimizer,
        server=server.url,
        run_id=new_run_id("late-server"),
        on_alert=None,
        spool_dir=str(tmp_path / "spool"),
    )
    said = capfd.readouterr().err
    spool = tmp_path / "spool" / f"{gf.run_id}.{os.getpid()}.ndjson"
    assert f"server {server.url} unreachable" in said and str(spool) in said, said
    try:
        train(model, optimizer, gf, 4)
        # The registration is beside the spool from the start, not only at close.
        sidecar = json.loads((spool.parent / (spool.name + ".registration.json")).read_text())
        assert sidecar["run_id"] == gf.run_id and sidecar["registration"]["params"]
        server.start()
        train(model, optimizer, gf, 4)
        deadline = time.monotonic() + 20
        while gf.reporter.pending and time.monotonic() < deadline:
            time.sleep(0.1)
        gf.close()
        err = capfd.readouterr().err
        assert f"server {server.url} answers again" in err, err
        assert "unreachable" not in err  # said once
        assert server.run(gf.run_id)["step_count"] == 8
        assert not spool.exists()
    finally:
        server.stop()


def test_steps_refused_for_a_wrong_token_are_spooled_and_import_later(tmp_path, capfd):
    server = ServerProcess(tmp_path / "token.db", None, "--ingest-token", "s3cret").start()
    spool_dir = tmp_path / "spool"
    try:
        model = PromptAgent()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gf = gradflow.watch(
            model,
            optimizer,
            server=server.url,
            run_id=new_run_id("token"),
            token="wrong",
            on_alert=None,
            close_timeout=1.0,
            spool_dir=str(spool_dir),
        )
        train(model, optimizer, gf, 5)
        gf.close()
    finally:
        server.stop()
    err = capfd.readouterr().err
    assert "refused the ingest token" in err and "GRADFLOW_INGEST_TOKEN" in err, err
    assert "5 still queued because the server refused the ingest token" in err, err
    kept = spool_dir / f"{gf.run_id}.{os.getpid()}.ndjson"
    assert [json.loads(line)["step"] for line in kept.read_text().splitlines()] == list(range(5))
    done = subprocess.run(
        [str(server_binary()), "--db", str(tmp_path / "token.db"), "import", str(kept)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert f"imported 5 step records into run {gf.run_id}" in done.stdout, done.stdout
