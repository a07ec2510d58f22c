"""``gradflow check``: run a training script under gradflow and fail when it is broken.

    gradflow check [--server URL] [--steps N] [--fail-on warning|critical] [--json]
                   -- python train.py --its --own --arguments

For a CI job: the script runs with ``GRADFLOW_SERVER`` pointed at a server (one given
with ``--server``, or an embedded one: ``gradflow-server`` from ``--server-bin``,
``GRADFLOW_SERVER_BIN`` or the PATH, on a free port and a temporary database); every
``gradflow.watch`` in it reports there. ``--steps N`` stops the script after N
optimizer steps (``gf.step`` closes the watcher and exits the script with status 0).
When the script has finished, the alerts of its runs are printed, and the exit status
says what was found:

- 0: no open alert at or above ``--fail-on`` (default ``warning``);
- 1: at least one such alert;
- 2: the script failed (non-zero exit) and raised no such alert — a failure gradflow
  did not diagnose;
- 3: gradflow check itself could not run (no server binary, server did not start).

``--json`` prints one JSON object instead: ``{"verdict", "exit_code",
"script_exit_code", "server", "runs": [{"run_id", "alerts": [...]}]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .transport import Client, Refused, Unreachable

SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}


class CheckError(Exception):
    """gradflow check could not do its job (exit status 3)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_binary(explicit: Optional[str]) -> str:
    candidate = explicit or os.environ.get("GRADFLOW_SERVER_BIN") or shutil.which("gradflow-server")
    if not candidate or not os.path.exists(candidate):
        raise CheckError(
            "no gradflow-server to start: pass --server URL, or --server-bin PATH, set "
            "GRADFLOW_SERVER_BIN, or put gradflow-server on the PATH "
            "(cargo build --release -p gradflow-server)"
        )
    return candidate


class EmbeddedServer:
    """A gradflow-server child process on 127.0.0.1 and a temporary database."""

    def __init__(self, binary: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="gradflow-check-")
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.log: List[str] = []
        self.process = subprocess.Popen(
            [
                binary,
                "--listen",
                self.url[len("http://") :],
                "--db",
                os.path.join(self.dir, "gradflow.db"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        ready = threading.Event()
        process = self.process

        def drain() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                self.log.append(line)
                if "gradflow-server listening" in line:
                    ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(30):
            self.stop()
            raise CheckError("gradflow-server did not start:\n" + "".join(self.log[-20:]))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _alerts(client: Client, run_id: str) -> List[Dict[str, Any]]:
    try:
        return client.alerts(run_id)
    except Refused as err:
        if err.status == 404:
            return []  # the script never registered this run
        raise


def run_check(
    command: Sequence[str],
    server: Optional[str] = None,
    server_bin: Optional[str] = None,
    steps: Optional[int] = None,
    fail_on: str = "warning",
    settle: float = 1.0,
) -> Dict[str, Any]:
    """Runs `command` under gradflow and returns the report (see the module's doc)."""
    if not command:
        raise CheckError("no command to run: gradflow check -- python train.py ...")
    embedded = None if server else EmbeddedServer(_server_binary(server_bin))
    url = server or embedded.url  # type: ignore[union-attr]
    try:
        env = dict(os.environ)
        env["GRADFLOW_SERVER"] = url
        env.pop("GRADFLOW_DISABLED", None)
        run_id: Optional[str] = None
        if server is not None:
            # A shared server holds other runs: this check's run gets its own id.
            run_id = env.get("GRADFLOW_RUN_ID") or f"check-{uuid.uuid4().hex[:12]}"
            env["GRADFLOW_RUN_ID"] = run_id
        if steps is not None:
            env["GRADFLOW_MAX_STEPS"] = str(steps)
        script_exit = subprocess.call(list(command), env=env)
        time.sleep(settle)  # the last batch's detectors run inside its commit; be safe
        client = Client(url, env.get("GRADFLOW_INGEST_TOKEN"))
        try:
            ids = [run_id] if run_id is not None else client.runs()
            runs = [{"run_id": r, "alerts": _alerts(client, r)} for r in ids]
        except (Unreachable, Refused) as err:
            raise CheckError(f"could not read the alerts from {url}: {err}") from None
    finally:
        if embedded is not None:
            embedded.stop()
    bar = SEVERITY_RANK[fail_on]
    failing = [
        a for r in runs for a in r["alerts"] if SEVERITY_RANK.get(a.get("severity"), 0) >= bar
    ]
    if failing:
        verdict, code = "alerts", 1
    elif script_exit != 0:
        verdict, code = "script_failed", 2
    else:
        verdict, code = "ok", 0
    return {
        "verdict": verdict,
        "exit_code": code,
        "script_exit_code": script_exit,
        "server": url if server else "embedded",
        "runs": runs,
    }


def _print_report(report: Dict[str, Any], out: Any) -> None:
    alerts = [(r["run_id"], a) for r in report["runs"] for a in r["alerts"]]
    for run_id, a in alerts:
        step = a.get("opened_step")
        when = f"step {step}" if step is not None else "registration"
        print(f"\n[{a['severity']}] {a['kind']} on {a['subject']} ({run_id}, {when})", file=out)
        print(f"  {a['title']}", file=out)
        print(f"  {a['detail']}", file=out)
        print(f"  fix: {a['fix']}", file=out)
    runs = len(report["runs"])
    summary = {
        "ok": f"gradflow check: OK ({runs} run(s), no open alert at or above the bar)",
        "alerts": f"gradflow check: FAILED: {len(alerts)} open alert(s) in {runs} run(s)",
        "script_failed": (
            f"gradflow check: FAILED: the script exited with {report['script_exit_code']} "
            "and gradflow raised no alert about it"
        ),
    }[report["verdict"]]
    print(("\n" if alerts else "") + summary, file=out)


def _split(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def main(argv: Optional[Sequence[str]] = None) -> int:
    own, command = _split(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="gradflow check",
        description="Run a training script under gradflow; exit 1 when it raises alerts.",
        epilog="Everything after -- is the command to run, e.g. -- python train.py",
    )
    parser.add_argument("--server", help="a running gradflow-server (default: start one)")
    parser.add_argument("--server-bin", help="the gradflow-server binary to start")
    parser.add_argument("--steps", type=int, help="stop the script after N optimizer steps")
    parser.add_argument("--fail-on", choices=["warning", "critical"], default="warning")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("command", nargs="*", help="the command (or put it after --)")
    args = parser.parse_args(own)
    command = command or args.command
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")
    try:
        report = run_check(
            command,
            server=args.server.rstrip("/") if args.server else None,
            server_bin=args.server_bin,
            steps=args.steps,
            fail_on=args.fail_on,
        )
    except CheckError as err:
        if args.json:
            print(json.dumps({"verdict": "error", "exit_code": 3, "error": str(err)}))
        else:
            print(f"gradflow check: {err}", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report, sys.stdout)
    return int(report["exit_code"])
