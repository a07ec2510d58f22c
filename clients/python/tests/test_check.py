"""``gradflow check`` as a user's CI job runs it: a broken training script fails the
job with the alert printed, a healthy one passes, a crash gradflow cannot explain is
its own exit status."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from conftest import server_binary

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    import gradflow

    mode = sys.argv[1]
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32))
    agent = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    model = nn.ModuleDict({"encoder": encoder, "agent": agent})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(model, optimizer, detectors={"stuck_zero_steps": 10}, on_alert=None)
    for step in range(int(sys.argv[2])):
        x = torch.randn(8, 16)
        optimizer.zero_grad(set_to_none=True)
        if mode == "broken":
            with torch.no_grad():  # the seed bug
                prompt = encoder(x)
        else:
            prompt = encoder(x)
        loss = agent(prompt).pow(2).mean()
        loss.backward()
        optimizer.step()
        gf.step(loss=loss)
        if mode == "crash" and step == 3:
            raise ValueError("a bug gradflow has no verdict for")
    gf.close()
    """
)


def check(tmp_path, *args: str, mode: str, steps: int = 14, server: str = ""):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    where = ["--server", server] if server else ["--server-bin", str(server_binary())]
    command = [sys.executable, "-m", "gradflow", "check", *where, *args]
    command += ["--", sys.executable, str(script), mode, str(steps)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_a_broken_script_fails_the_job_and_prints_the_alert(tmp_path):
    done = check(tmp_path, mode="broken")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "[critical] grad_stuck_zero on encoder" in done.stdout, done.stdout
    assert "Backward never reaches encoder" in done.stdout
    assert "The client saw where: encoder's forward ran with gradients disabled" in done.stdout
    assert "fix: " in done.stdout
    summary = "gradflow check: FAILED: 1 alert(s) raised in 1 run(s) (1 still open at the end)"
    assert summary in done.stdout


def test_a_healthy_script_passes_and_steps_bound_it(tmp_path, gradflow_server):
    done = check(
        tmp_path, "--json", "--steps", "5", mode="healthy", steps=10_000, server=gradflow_server.url
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["verdict"] == "ok" and report["script_exit_code"] == 0
    (run,) = report["runs"]
    assert run["alerts"] == [] and run["run_id"].startswith("check-")
    assert gradflow_server.run(run["run_id"])["step_count"] == 5


def test_a_crash_without_a_verdict_is_exit_status_2(tmp_path):
    done = check(tmp_path, "--json", mode="crash")
    report = json.loads(done.stdout)
    assert (done.returncode, report["verdict"]) == (2, "script_failed"), done.stdout
    assert report["script_exit_code"] == 1
    assert "ValueError: a bug gradflow has no verdict for" in done.stderr


def test_without_a_server_binary_it_says_what_to_do(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradflow",
            "check",
            "--server-bin",
            str(tmp_path / "nope"),
            "--",
            sys.executable,
            "-c",
            "pass",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3
    assert "no gradflow-server to start" in done.stderr
