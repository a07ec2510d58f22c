"""``gradflow check`` judges the runs the script registered by what they raised while
it ran, and says where they can be seen once it is over."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from conftest import ServerProcess, free_port, new_run_id, server_binary

# An encoder cut from backward for the first `cut` steps, then trained: the alert
# (after 5 steps of zero gradient) opens, and resolves once gradients flow again.
SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    import gradflow

    steps, cut, run_id = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] or None
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "encoder": nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32)),
        "agent": nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)),
    })
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(model, optimizer, run_id=run_id, detectors={"stuck_zero_steps": 5})
    for step in range(steps):
        x = torch.randn(8, 16)
        optimizer.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(step >= cut):
            prompt = model["encoder"](x)
        loss = model["agent"](prompt).pow(2).mean()
        loss.backward()
        optimizer.step()
        gf.step(loss=loss)
    gf.close()
    """
)


def check(tmp_path, *options: str, steps: int = 20, cut: int = 0, run_id: str = ""):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "gradflow", "check", *options]
    command += ["--", sys.executable, str(script), str(steps), str(cut), run_id]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_an_alert_resolved_before_the_end_still_fails_the_check(tmp_path):
    # Trained from step 12, the alert resolves once its hold (20 steps, PROTOCOL.md)
    # has passed, which a run of 40 steps reaches.
    done = check(tmp_path, "--server-bin", str(server_binary()), steps=40, cut=12)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "[critical] grad_stuck_zero on encoder" in out, out
    assert "resolved at step 12)" in out, out
    assert "FAILED: 1 alert(s) raised in 1 run(s) (0 still open at the end)" in out, out

    report = json.loads(
        check(tmp_path, "--json", "--server-bin", str(server_binary()), steps=40, cut=12).stdout
    )
    assert (report["verdict"], report["exit_code"]) == ("alerts", 1)
    (alert,) = report["runs"][0]["alerts"]
    assert (alert["kind"], alert["status"]) == ("grad_stuck_zero", "resolved")


def test_a_run_id_of_the_scripts_own_on_a_shared_server_is_the_run_checked(
    tmp_path, gradflow_server
):
    mine = new_run_id("mine")
    done = check(tmp_path, "--json", "--server", gradflow_server.url, run_id=mine)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["verdict"] == "ok"
    assert [(r["run_id"], r["steps"]) for r in report["runs"]] == [(mine, 20)]
    assert gradflow_server.run(mine)["step_count"] == 20
    # A shared server keeps the run: the check says where.
    assert f"gradflow check: the runs: {gradflow_server.url}/runs/{mine}" in done.stderr


def test_the_started_server_can_be_placed_and_its_database_kept(tmp_path):
    port, db = free_port(), tmp_path / "kept.db"
    done = check(
        tmp_path,
        "--server-bin",
        str(server_binary()),
        "--listen",
        f"127.0.0.1:{port}",
        "--db",
        str(db),
        cut=20,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    # The script reported to the address asked for.
    assert f"http://127.0.0.1:{port}/runs/" in done.stderr, done.stderr
    assert f"gradflow check: the runs are kept in {db}: `gradflow server --db {db}`" in done.stdout
    run_id = done.stderr.split(f"http://127.0.0.1:{port}/runs/")[1].split()[0]
    server = ServerProcess(db).start()
    try:
        assert server.run(run_id)["step_count"] == 20
        serious = [a["kind"] for a in server.alerts(run_id) if a["severity"] != "info"]
        assert serious == ["grad_stuck_zero"]
    finally:
        server.stop()


def test_without_a_database_to_keep_the_check_says_its_pages_are_gone(tmp_path):
    done = check(tmp_path, "--server-bin", str(server_binary()), steps=6)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "/runs/" in done.stderr  # the script linked to the check's own server...
    assert (
        "gradflow check: the run pages the script linked to were on this check's own "
        "server, which has stopped, and its temporary database is deleted: pass --db PATH"
    ) in done.stdout, done.stdout


def test_listen_and_db_are_refused_beside_a_server_url(tmp_path, gradflow_server):
    done = check(tmp_path, "--server", gradflow_server.url, "--db", str(tmp_path / "x.db"))
    assert done.returncode == 2
    assert "--listen and --db place the server gradflow check starts" in done.stderr
