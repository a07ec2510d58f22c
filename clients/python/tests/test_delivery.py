"""Delivery: outages, refused records, tokens, the disabled switch, and the rule that
gradflow never breaks the loop it watches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import PromptAgent, ServerProcess, free_port, new_run_id, server_binary, train
from said import alerts_said

import gradflow


def test_server_down_for_part_of_the_run_loses_nothing(tmp_path, capfd):
    """The run starts with no server, which then comes up, is stopped mid-run and
    comes back: every step arrives, in order, and training is what it would be bare."""
    server = ServerProcess(tmp_path / "outage.db", free_port())
    model = PromptAgent(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run_id = new_run_id("outage")
    gf = gradflow.watch(
        model,
        optimizer,
        server=server.url,
        run_id=run_id,
        on_alert=None,
        spool_dir=str(tmp_path / "spool"),
    )

    def outage(step):
        if step == 6:
            server.start()
        elif step == 12:
            server.stop()
        elif step == 18:
            server.start()

    try:
        losses = train(model, optimizer, gf, 24, before_step=outage)
        gf.close()
        run = server.run(run_id)
        assert run["step_count"] == 24 and run["first_step"] == 0 and run["last_step"] == 23
        points = server.series(run_id, "loss")
        assert [step for step, _ in points] == list(range(24))
        assert [value for _, value in points] == pytest.approx(losses, rel=1e-6)
        assert server.get(f"/api/v1/runs/{run_id}/series?metric=dropped_steps")["points"] == []
        assert "NOT delivered" not in capfd.readouterr().err
    finally:
        server.stop()

    bare = PromptAgent(seed=5)
    assert train(bare, torch.optim.AdamW(bare.parameters(), lr=1e-3), None, 24) == losses


def test_what_cannot_be_delivered_is_said_at_close(tmp_path, capfd):
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    spool = tmp_path / "spool"
    gf = gradflow.watch(
        model,
        optimizer,
        server=f"http://127.0.0.1:{free_port()}",
        run_id=new_run_id(),
        on_alert=None,
        close_timeout=1.0,
        spool_dir=str(spool),
    )
    train(model, optimizer, gf, 5)
    gf.close()
    err = capfd.readouterr().err
    assert "NOT delivered: 5 still queued" in err, err
    kept = spool / f"{gf.run_id}.{os.getpid()}.ndjson"
    records = [json.loads(line) for line in kept.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert f"`gradflow report {kept}`" in err
    assert f"`gradflow-server --db gradflow.db import {kept}`" in err

    # Later, the spool goes into a server's database, registration and all.
    db = tmp_path / "later.db"
    command = [str(server_binary()), "--db", str(db), "import", str(kept)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"imported 5 step records into run {gf.run_id}" in done.stdout, done.stdout
    again = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert "imported 0 step records" in again.stdout and "(5 already there)" in again.stdout
    server = ServerProcess(db).start()
    try:
        run = server.run(gf.run_id)
        assert run["step_count"] == 5 and run["config"]["client"] == "gradflow-python"
        assert [s for s, _ in server.series(gf.run_id, "loss")] == [0, 1, 2, 3, 4]
    finally:
        server.stop()

    # Or, with no server at all, a report that opens offline.
    report = tmp_path / "report.html"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradflow",
            "report",
            str(kept),
            "--out",
            str(report),
            "--server-bin",
            str(server_binary()),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"run {gf.run_id}, 5 steps" in done.stdout, done.stdout
    html = report.read_text()
    assert gf.run_id in html and "<style>" in html
    assert html.count('src="data:image/svg+xml;base64,') >= 3, "the charts are inlined"
    assert "<script" not in html and 'src="/api/' not in html, "nothing to fetch"


def test_import_refuses_a_bad_spool_and_stores_nothing(tmp_path):
    spool = tmp_path / "bad.ndjson"
    spool.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": -1, "modules": 3}\n')
    registration = tmp_path / "registration.json"
    registration.write_text('{"params": [{"name": "a.weight"}]}')
    db = tmp_path / "bad.db"
    done = subprocess.run(
        [
            str(server_binary()),
            "--db",
            str(db),
            "import",
            str(spool),
            "--run-id",
            "bad",
            "--registration",
            str(registration),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "line 2" in done.stderr and "steps[1].modules" in done.stderr, done.stderr
    assert not db.exists(), "nothing stored: not even the database is created"


def test_a_refused_batch_loses_only_its_invalid_records(gradflow_server, capfd):
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(
        model, optimizer, server=gradflow_server.url, run_id=new_run_id(), on_alert=None
    )
    for step in range(8):
        train(model, optimizer, None, 1)
        # A metric name the protocol refuses (empty) on one step only.
        gf.step(loss=1.0, metrics={"": 1.0} if step == 3 else {"reward": 0.5})
    gf.close()
    run = gradflow_server.run(gf.run_id)
    assert run["step_count"] == 7
    steps = [s for s, _ in gradflow_server.series(gf.run_id, "loss")]
    assert steps == [0, 1, 2, 4, 5, 6, 7]
    assert "1 refused by the server" in capfd.readouterr().err


def test_the_ingest_token_is_sent(tmp_path):
    server = ServerProcess(tmp_path / "token.db", None, "--ingest-token", "s3cret").start()
    try:
        model = PromptAgent()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gf = gradflow.watch(
            model, optimizer, server=server.url, run_id=new_run_id(), token="s3cret", on_alert=None
        )
        train(model, optimizer, gf, 3)
        gf.close()
        assert server.run(gf.run_id)["step_count"] == 3
    finally:
        server.stop()


def test_disabled_watch_is_a_no_op(gradflow_server, gradflow_env, monkeypatch):
    monkeypatch.setenv("GRADFLOW_DISABLED", "1")
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gradflow.watch(model, optimizer) as gf:
        assert isinstance(gf, gradflow.NoopWatcher) and gf.alerts() == []
        train(model, optimizer, gf, 3)
    assert not optimizer._optimizer_step_pre_hooks
    assert not gradflow_server.has_run(gradflow_env)


def test_environment_chooses_server_and_run_id(gradflow_server, gradflow_env):
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gradflow.watch(model, optimizer) as gf:
        assert isinstance(gf, gradflow.Watcher) and gf.run_id == gradflow_env
        train(model, optimizer, gf, 2)
    run = gradflow_server.run(gradflow_env)
    assert run["step_count"] == 2 and run["status"] == "finished"


def test_internal_failures_never_reach_the_training_loop(gradflow_server, monkeypatch):
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(
        model, optimizer, server=gradflow_server.url, run_id=new_run_id(), on_alert=None
    )

    def broken(*_args, **_kwargs):
        raise RuntimeError("measurement exploded")

    monkeypatch.setattr(gf.instruments.measurer, "measure_grads", broken)
    monkeypatch.setattr(gf.instruments.measurer, "collect", broken)
    losses = train(model, optimizer, gf, 3)  # no exception
    gf.close()
    assert len(losses) == 3


def test_alerts_are_said_once_while_training(gradflow_server):
    model = PromptAgent(detach_prompt=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(
        model,
        optimizer,
        server=gradflow_server.url,
        run_id=new_run_id(),
        detectors={"stuck_zero_steps": 5},
    )
    with alerts_said() as shown:
        train(model, optimizer, gf, 8)
        gradflow_server.wait_for_alert(gf.run_id, "grad_stuck_zero", subject="qwen")
        open_alerts = gf.alerts()
        gf.close()
    assert [a["kind"] for a in open_alerts] == ["grad_stuck_zero"]
    assert len([m for m in shown if "grad_stuck_zero on qwen" in m]) == 1, shown
    assert all("fix:" in m for m in shown)


def test_raise_mode_raises_a_critical_alert_from_step(gradflow_server):
    model = PromptAgent(detach_prompt=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(
        model,
        optimizer,
        server=gradflow_server.url,
        run_id=new_run_id(),
        detectors={"stuck_zero_steps": 5},
        on_alert="raise",
    )
    with pytest.raises(gradflow.TrainingAlert) as raised:
        # Alerts are read in the background, once a second: train until one arrives
        # (200 steps of this model can take less than that on an idle machine).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            train(model, optimizer, gf, 1)
    gf.close()
    assert raised.value.kind == "grad_stuck_zero"
    assert raised.value.alert["evidence"]["cause"] == "backward_not_reached"


def test_a_full_spool_drops_steps_and_later_records_count_them(tmp_path):
    server = ServerProcess(tmp_path / "full.db", free_port())
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(
        model,
        optimizer,
        server=server.url,
        run_id=new_run_id(),
        on_alert=None,
        spool_dir=str(tmp_path / "spool"),
        spool_max_bytes=12_000,
    )
    try:
        train(model, optimizer, gf, 6)
        server.start()
        deadline = time.monotonic() + 20
        while gf.reporter.pending and time.monotonic() < deadline:
            time.sleep(0.1)
        train(model, optimizer, gf, 2)
        gf.close()
        steps = [s for s, _ in server.series(gf.run_id, "loss")]
        kept = len(steps) - 2
        assert 0 < kept < 6 and steps == list(range(kept)) + [6, 7], steps
        dropped = server.series(gf.run_id, "dropped_steps")
        assert dropped == [[6, 6 - kept], [7, 6 - kept]], dropped
    finally:
        server.stop()
