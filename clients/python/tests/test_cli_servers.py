"""The command line against servers as CI jobs and people meet them: ``gradflow check``
on ``GRADFLOW_SERVER``, a script that never watched, too few steps, ``--json`` as the
only stdout, a URL that is not a gradflow server; ``gradflow report --server``; the
offline report; ``gradflow server``."""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from conftest import free_port, new_run_id, server_binary

import gradflow

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    import gradflow

    print("the script's own output")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    gf = gradflow.watch(model, optimizer, detectors={"stuck_zero_steps": 10}, on_alert=None)
    for step in range(int(sys.argv[1])):
        optimizer.zero_grad(set_to_none=True)
        loss = (model(x) - 1.0).pow(2).mean()  # one batch: the loss only falls
        loss.backward()
        optimizer.step()
        gf.step(loss=loss)
    gf.close()
    """
)


def gradflow_cli(*args: str, env=None, timeout: float = 300) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GRADFLOW_")}
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "gradflow", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
    )


def script(tmp_path, source: str = SCRIPT):
    path = tmp_path / "train.py"
    path.write_text(source)
    return path


@pytest.fixture
def not_gradflow(tmp_path):
    """An HTTP server that is not a gradflow server (Python's file server)."""
    (tmp_path / "www").mkdir()
    handler = functools.partial(
        http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "www")
    )
    handler.log_message = lambda *args: None  # type: ignore[assignment]
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_check_reports_to_the_server_gradflow_server_names(tmp_path, gradflow_server):
    train = script(tmp_path)
    done = gradflow_cli(
        "check",
        "--json",
        "--",
        sys.executable,
        str(train),
        "12",
        env={"GRADFLOW_SERVER": gradflow_server.url},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)  # nothing but the report on stdout
    assert report["server"] == gradflow_server.url and report["verdict"] == "ok"
    (run,) = report["runs"]
    assert run["run_id"].startswith("check-") and run["steps"] == 12
    assert gradflow_server.run(run["run_id"])["step_count"] == 12
    # The script's own stdout went to stderr.
    assert "the script's own output" in done.stderr


def test_check_fails_when_the_script_never_watched(tmp_path, gradflow_server):
    quiet = script(tmp_path, "print('trained without gradflow')\n")
    embedded = gradflow_cli(
        "check", "--server-bin", str(server_binary()), "--", sys.executable, str(quiet)
    )
    assert embedded.returncode == 4, embedded.stdout + embedded.stderr
    assert "FAILED: the script reported no run, so nothing was checked" in embedded.stdout
    assert "OK" not in embedded.stdout

    shared = gradflow_cli(
        "check", "--json", "--server", gradflow_server.url, "--", sys.executable, str(quiet)
    )
    report = json.loads(shared.stdout)
    assert (shared.returncode, report["verdict"], report["runs"]) == (4, "no_runs", [])


def test_check_warns_when_the_steps_are_too_few_for_a_verdict(tmp_path):
    train = script(tmp_path)
    short = gradflow_cli(
        "check",
        "--server-bin",
        str(server_binary()),
        "--steps",
        "5",
        "--",
        sys.executable,
        str(train),
        "100",
    )
    assert short.returncode == 0, short.stdout + short.stderr
    # The script asked for stuck_zero_steps=10: that is the number it needs, not 50.
    warning = re.search(
        r"gradflow check: warning: run \S+ reported 5 step\(s\) \(--steps 5\)", short.stdout
    )
    assert warning, short.stdout
    assert "grad_stuck_zero needs 10" in short.stdout and "run at least 10 steps" in short.stdout
    assert "gradflow check: OK (1 run(s)" in short.stdout

    enough = gradflow_cli(
        "check",
        "--json",
        "--server-bin",
        str(server_binary()),
        "--steps",
        "10",
        "--",
        sys.executable,
        str(train),
        "100",
    )
    report = json.loads(enough.stdout)
    assert report["warnings"] == [] and report["verdict"] == "ok", enough.stderr
    assert "warning" not in enough.stderr


def test_a_url_that_is_not_gradflow_is_one_clear_line(tmp_path, not_gradflow):
    train = script(tmp_path)
    done = gradflow_cli("check", "--server", not_gradflow, "--", sys.executable, str(train), "3")
    assert done.returncode == 3
    assert done.stderr.strip().splitlines() == [
        f"gradflow check: {not_gradflow} does not look like a gradflow server "
        "(it answered HTTP 404, text/html)"
    ], done.stderr
    assert "the script's own output" not in done.stdout + done.stderr, "the script never ran"

    spool = tmp_path / "run.ndjson"
    spool.write_text('{"step": 0, "loss": 1.0}\n')
    (tmp_path / "run.ndjson.registration.json").write_text(
        json.dumps({"run_id": "r", "registration": {"params": []}})
    )
    report = gradflow_cli("report", str(spool), "--server", not_gradflow)
    assert report.returncode == 3
    assert report.stderr.strip().splitlines() == [
        f"gradflow report: {not_gradflow} does not look like a gradflow server "
        "(it answered HTTP 404, text/html)"
    ], report.stderr


def spooled_run(tmp_path):
    """A run whose server was never there: its spool and registration sidecar."""
    from conftest import PromptAgent, train

    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(
        model,
        optimizer,
        server=f"http://127.0.0.1:{free_port()}",
        run_id=new_run_id("offline"),
        on_alert=None,
        close_timeout=1.0,
        spool_dir=str(tmp_path / "spool"),
    )
    train(model, optimizer, gf, 6)
    gf.close()
    (spool,) = (tmp_path / "spool").glob(f"{gf.run_id}.*.ndjson")
    return gf.run_id, spool


def test_report_server_is_not_taken_for_server_bin(tmp_path, gradflow_server):
    run_id, spool = spooled_run(tmp_path)
    out = tmp_path / "report.html"
    done = gradflow_cli("report", str(spool), "--server", gradflow_server.url, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert f"run {run_id}, 6 steps" in done.stdout
    # The spool went to that server, where the run stays.
    assert gradflow_server.run(run_id)["step_count"] == 6
    assert out.exists()

    # An abbreviation is not an option: --server-b is no --server-bin.
    abbreviated = gradflow_cli("report", str(spool), "--server-b", str(server_binary()))
    assert abbreviated.returncode == 2 and "unrecognized arguments" in abbreviated.stderr
    check = gradflow_cli("check", "--ser", gradflow_server.url, "--", "true")
    assert check.returncode == 2 and "unrecognized arguments" in check.stderr


def test_the_offline_report_has_no_dead_links_or_live_controls(tmp_path):
    run_id, spool = spooled_run(tmp_path)
    out = tmp_path / "report.html"
    done = gradflow_cli(
        "report", str(spool), "--out", str(out), env={"GRADFLOW_SERVER_BIN": str(server_binary())}
    )
    assert done.returncode == 0, done.stderr
    html = out.read_text()
    assert run_id in html and html.count('src="data:image/svg+xml;base64,') >= 3
    assert "Offline report, generated " in html and spool.name in html
    # Every link stays in the file: nothing points at a server that is gone.
    links = re.findall(r'(?:href|src|action)="([^"]*)"', html)
    assert links and all(link.startswith(("#", "data:")) for link in links), links
    for live_only in ("<script", "<form", "<input", "<button", 'id="live-indicator"', "Last batch"):
        assert live_only not in html, live_only
    # The run is over: it reads finished, not live.
    assert "status status-finished" in html and "status status-live" not in html


def test_gradflow_server_is_the_server_binary(tmp_path):
    env = {"GRADFLOW_SERVER_BIN": str(server_binary())}
    version = gradflow_cli("server", "--version", env=env)
    direct = subprocess.run(
        [str(server_binary()), "--version"], capture_output=True, text=True, timeout=60
    )
    assert version.returncode == 0 and version.stdout == direct.stdout
    assert version.stdout.startswith("gradflow-server ")

    missing = gradflow_cli("server", env={"GRADFLOW_SERVER_BIN": str(tmp_path / "nope")})
    assert missing.returncode == 3 and "no gradflow-server" in missing.stderr
