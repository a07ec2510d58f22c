"""Several servers: the client talks to one at a time and moves to the next when the
current one stops answering, losing nothing (the real server binary, killed with
SIGKILL, and a standby started on its database file)."""

from __future__ import annotations

import re
import time

import pytest
import torch
from conftest import PromptAgent, ServerProcess, free_port, new_run_id, train

import gradflow
from gradflow import _env


def test_a_killed_server_s_standby_on_its_database_gets_every_step(tmp_path, capfd):
    db = tmp_path / "shared.db"
    primary = ServerProcess(db).start()
    standby = ServerProcess(db, free_port())  # started later, on the same file
    model = PromptAgent(seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run_id = new_run_id("failover")
    gf = gradflow.watch(
        model,
        optimizer,
        server=[primary.url, standby.url],
        run_id=run_id,
        on_alert=None,
        spool_dir=str(tmp_path / "spool"),
    )
    delivered_before_kill = []

    def outage(step):
        if step == 8:
            # Mid-run: the primary has stored some steps when it dies.
            deadline = time.monotonic() + 20
            while primary.run(run_id)["step_count"] < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            delivered_before_kill.append(primary.run(run_id)["step_count"])
            primary.kill()
        elif step == 14:
            standby.start()

    try:
        losses = train(model, optimizer, gf, 24, before_step=outage)
        gf.close()
        assert delivered_before_kill[0] >= 4, "the primary stored steps before it died"
        run = standby.run(run_id)
        assert (run["step_count"], run["first_step"], run["last_step"]) == (24, 0, 23)
        points = standby.series(run_id, "loss")
        assert [step for step, _ in points] == list(range(24)), "no gap"
        assert [value for _, value in points] == pytest.approx(losses, rel=1e-6)
        assert standby.series(run_id, "dropped_steps") == []
        assert run["status"] == "finished"
    finally:
        primary.stop()
        standby.stop()
    err = capfd.readouterr().err
    moved = f"server {primary.url} is not answering"
    assert err.count(f"{moved}") >= 1 and f"moving to {standby.url}" in err, err
    assert (
        len(re.findall(rf"{re.escape(moved)} \([^)]*\); moving to {re.escape(standby.url)}", err))
        == 1
    ), "the switch is said once"
    summary = re.search(
        r"run \S+: delivered all (\d+) steps \((\d+) to (\S+), (\d+) to (\S+)\)", err
    )
    assert summary is not None, err
    total, first, first_url, second, second_url = summary.groups()
    assert (first_url, second_url) == (primary.url, standby.url)
    assert int(total) == 24 == int(first) + int(second)
    assert int(first) >= delivered_before_kill[0] and int(second) > 0
    assert "NOT delivered" not in err


def test_a_first_server_down_from_the_start_sends_every_step_to_the_second(
    gradflow_server, gradflow_env, monkeypatch, capfd
):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("GRADFLOW_SERVER", f"{down}, {gradflow_server.url}/")
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(model, optimizer, on_alert=None)
    assert gf.servers == [down, gradflow_server.url]
    losses = train(model, optimizer, gf, 6)
    gf.close()
    run = gradflow_server.run(gradflow_env)
    assert run["step_count"] == 6 and run["status"] == "finished"
    assert [v for _, v in gradflow_server.series(gradflow_env, "loss")] == pytest.approx(losses)
    err = capfd.readouterr().err
    assert f"server {down} is not answering" in err and f"moving to {gradflow_server.url}" in err
    assert f"delivered all 6 steps (6 to {gradflow_server.url})" in err, err


def test_server_lists_are_read_from_arguments_and_the_environment(monkeypatch):
    monkeypatch.setenv("GRADFLOW_SERVER", "a:7070, http://b:7070/,,a:7070")
    assert _env.servers(None) == ["http://a:7070", "http://b:7070"]
    assert _env.servers("https://c/") == ["https://c"]
    assert _env.servers(["c:1", "d:2"]) == ["http://c:1", "http://d:2"]
    monkeypatch.delenv("GRADFLOW_SERVER")
    assert _env.servers(None) == [_env.DEFAULT_SERVER]
    with pytest.raises(ValueError):
        _env.servers(" , ")
