"""``gradflow check``: run a training script under gradflow and fail when it is broken.

    gradflow check [--server URL | --listen ADDR --db PATH] [--steps N]
                   [--fail-on warning|critical] [--json]
                   -- python train.py --its --own --arguments

For a CI job: the script runs with ``GRADFLOW_SERVER`` pointed at a server (one given
with ``--server`` or ``GRADFLOW_SERVER``, where the run gets an id of its own unless
the script chooses one; or an embedded one: the ``gradflow-server`` from
``--server-bin``, ``GRADFLOW_SERVER_BIN``, the one the ``gradflow`` wheel installed, or
the PATH, on ``--listen`` (default a free port on 127.0.0.1) and ``--db`` (default a
temporary database, deleted with the server when the check ends; a ``--db`` is kept
and can be served afterwards with ``gradflow server --db PATH``). Every
``gradflow.watch`` in the script reports there and names its run in the file
``GRADFLOW_CHECK_RUNS_FILE`` (:mod:`gradflow.delivery.runs_file`): those are the runs judged.
``--steps N`` stops the script after N optimizer steps (``gf.step`` closes the
watcher and exits the script with status 0). When the script has finished, the
alerts its runs raised are printed, and the exit status says what was found:

- 0: no alert at or above ``--fail-on`` (default ``warning``) was raised;
- 1: at least one such alert was raised while the script ran, whether it is still
  open at the end or was resolved (a verdict that does not depend on when the
  script stopped);
- 2: the script failed (non-zero exit) and raised no such alert — a failure gradflow
  did not diagnose;
- 3: gradflow check itself could not run (no server binary, server did not start, the
  server is not a gradflow server);
- 4: the script ran but reported no run: it never called ``gradflow.watch``, so
  nothing was checked.

A run that reported fewer steps than a detector needs to decide (a cut graph is only
called after 50 steps of zero gradient) draws a warning: its pass says little.

``--json`` prints one JSON object on stdout, and nothing else (the script's own
output goes to stderr): ``{"verdict", "exit_code", "script_exit_code", "server",
"database", "runs": [{"run_id", "steps", "alerts": [...]}], "warnings": [...]}``,
each alert with its ``status`` (``open`` or ``resolved``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import quote

from .delivery.runs_file import RUNS_FILE_ENV, read_runs

SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}

# How many reported steps each streak detector needs before it can call a verdict:
# the server's default thresholds (docs/PROTOCOL.md; the detectors' Thresholds), which
# a run's own `detectors` override.
STREAK_STEPS = {
    "grad_stuck_zero": ("stuck_zero_steps", 50),
    "norm_weight_frozen": ("frozen_norm_steps", 20),
    "scaler_overflow_streak": ("overflow_streak_steps", 10),
}

EXE = ".exe" if sys.platform == "win32" else ""


class CheckError(Exception):
    """gradflow check could not do its job (exit status 3)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bundled_server() -> Optional[str]:
    """The ``gradflow-server`` the gradflow wheel installed beside the ``gradflow``
    command: in this interpreter's scripts folder, the user scheme's (``pip install
    --user``) or ``bin/`` beside the package (``pip install --target``)."""
    folders = [sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]
    try:
        user = sysconfig.get_preferred_scheme("user")
    except AttributeError:  # Python < 3.10
        user = "nt_user" if os.name == "nt" else "posix_user"
    with contextlib.suppress(KeyError):
        folders.append(sysconfig.get_path("scripts", user))
    folders.append(str(Path(__file__).resolve().parents[1] / "bin"))
    for folder in folders:
        path = os.path.join(folder, "gradflow-server" + EXE)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def find_server_binary(explicit: Optional[str] = None) -> Optional[str]:
    """``explicit``, ``GRADFLOW_SERVER_BIN``, the wheel's own server, the PATH's."""
    given = explicit or os.environ.get("GRADFLOW_SERVER_BIN")
    if given:
        return given if os.path.isfile(given) else None
    return bundled_server() or shutil.which("gradflow-server")


def _server_binary(
    explicit: Optional[str], also: str = "pass --server URL (or set GRADFLOW_SERVER), "
) -> str:
    found = find_server_binary(explicit)
    if found is None:
        wrong = explicit or os.environ.get("GRADFLOW_SERVER_BIN")
        raise CheckError(
            "no gradflow-server to start"
            + (f" ({wrong} does not exist)" if wrong else "")
            + ": "
            + also
            + "pass --server-bin PATH or set GRADFLOW_SERVER_BIN, or install gradflow from "
            "its wheel, which carries the server (pip install ./clients/python)"
        )
    return found


def probe(url: str, token: Optional[str] = None, timeout: float = 10.0) -> None:
    """Raises CheckError, in one line, unless `url` answers as a gradflow server does
    (a JSON error body for a run that does not exist)."""
    request = urllib.request.Request(
        f"{url}/api/v1/runs/{quote('gradflow-check-probe-' + uuid.uuid4().hex[:8])}",
        headers={"Accept": "application/json"},
    )
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    status, kind, body = 200, "", b""
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            kind, body = response.headers.get("Content-Type", ""), response.read(4096)
    except urllib.error.HTTPError as err:
        status, kind, body = err.code, err.headers.get("Content-Type", ""), err.read(4096)
    except (urllib.error.URLError, OSError) as err:
        raise CheckError(
            f"{url} cannot be reached: {getattr(err, 'reason', None) or err}"
        ) from None
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    if status not in (401, 404) or not isinstance(code, str):
        kind = kind.split(";")[0].strip() or "no content type"
        raise CheckError(
            f"{url} does not look like a gradflow server (it answered HTTP {status}, {kind})"
        )


def _reachable(listen: str) -> str:
    """The URL to reach a server listening on `listen` (HOST:PORT) from this host: a
    wildcard address is reached on the loopback."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise CheckError(f"--listen {listen!r} is not HOST:PORT (e.g. 127.0.0.1:7071)")
    host = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(host, host)
    return f"http://{host}:{port}"


class EmbeddedServer:
    """A gradflow-server child process: on 127.0.0.1 and a free port unless `listen`
    names the address, on a temporary database (deleted by `stop`) unless `db` names
    one (kept)."""

    def __init__(self, binary: str, listen: Optional[str] = None, db: Optional[str] = None) -> None:
        listen = listen or f"127.0.0.1:{_free_port()}"
        self.url = _reachable(listen)
        self.dir = tempfile.mkdtemp(prefix="gradflow-check-")
        self.kept = db is not None
        self.db = os.path.abspath(db) if db is not None else os.path.join(self.dir, "gradflow.db")
        # A database that held runs before: only the runs the script names are its own.
        self.fresh = not os.path.exists(self.db)
        self.log: List[str] = []
        self.process = subprocess.Popen(
            [binary, "--listen", listen, "--db", self.db],
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


def _get(url: str, path: str, token: Optional[str]) -> Any:
    """A JSON read; None for a 404 (a run the script never registered)."""
    request = urllib.request.Request(url + path, headers={"Accept": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        if err.code == 404:
            return None
        raise CheckError(f"could not read {path} from {url}: HTTP {err.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise CheckError(f"could not read {path} from {url}: {err}") from None


def _run_report(url: str, run_id: str, token: Optional[str]) -> Optional[Dict[str, Any]]:
    """The run, its steps and every alert it raised (open or resolved since)."""
    run = _get(url, f"/api/v1/runs/{quote(run_id)}", token)
    if run is None:
        return None
    answer = _get(url, f"/api/v1/runs/{quote(run_id)}/alerts?status=all", token) or {}
    first, last = run.get("first_step"), run.get("last_step")
    raised = [
        a
        for a in answer.get("alerts", [])
        if SEVERITY_RANK.get(a.get("severity"), 0) >= SEVERITY_RANK["warning"]
    ]
    return {
        "run_id": run_id,
        "steps": 0 if first is None or last is None else int(last) - int(first) + 1,
        "alerts": raised,
        "registration": run,
    }


def undecided(run: Dict[str, Any]) -> List[Tuple[str, int]]:
    """The streak detectors that apply to `run` and need more steps than it reported,
    with the steps each needs."""
    registration = run["registration"]
    overrides = registration.get("detectors") or {}
    roles = {p.get("role") for p in registration.get("params") or []}
    scaler = (registration.get("precision") or {}).get("loss_scaler")
    applies = {
        "grad_stuck_zero": True,
        "norm_weight_frozen": "norm" in roles,
        "scaler_overflow_streak": scaler not in (None, "none"),
    }
    out = []
    for kind, (field, default) in STREAK_STEPS.items():
        needed = int(overrides.get(field) or default)
        if applies[kind] and run["steps"] < needed:
            out.append((kind, needed))
    return out


def _step_warnings(runs: List[Dict[str, Any]], steps: Optional[int]) -> List[str]:
    warnings = []
    for run in runs:
        short = undecided(run)
        if not short:
            continue
        names = ", ".join(f"{kind} needs {n}" for kind, n in short)
        most = max(n for _, n in short)
        cause = f" (--steps {steps})" if steps is not None else ""
        warnings.append(
            f"run {run['run_id']} reported {run['steps']} step(s){cause}, too few for "
            f"every detector to decide ({names}): run at least {most} steps for a pass "
            "to mean the gradients flow"
        )
    return warnings


def run_check(
    command: Sequence[str],
    server: Optional[str] = None,
    server_bin: Optional[str] = None,
    steps: Optional[int] = None,
    fail_on: str = "warning",
    settle: float = 1.0,
    script_stdout: Any = None,
    listen: Optional[str] = None,
    db: Optional[str] = None,
) -> Dict[str, Any]:
    """Runs `command` under gradflow and returns the report (see the module's doc).
    `server` may name several servers, comma-separated (failover): the script gets them
    all, the alerts are read from the first that answers. `listen` and `db` place the
    embedded server (without `server`)."""
    if not command:
        raise CheckError("no command to run: gradflow check -- python train.py ...")
    token = os.environ.get("GRADFLOW_INGEST_TOKEN")
    read_url = None
    if server:
        urls = [u.strip().rstrip("/") for u in server.split(",") if u.strip()]
        urls = [u if "://" in u else f"http://{u}" for u in urls]
        errors = []
        for url in urls:
            try:
                probe(url, token)
                read_url = url
                break
            except CheckError as err:
                errors.append(str(err))
        if read_url is None:
            raise CheckError("; ".join(errors))
    embedded = None if server else EmbeddedServer(_server_binary(server_bin), listen=listen, db=db)
    url = read_url or embedded.url  # type: ignore[union-attr]
    notes = tempfile.mkdtemp(prefix="gradflow-check-runs-")
    try:
        env = dict(os.environ)
        env["GRADFLOW_SERVER"] = server or url
        env.pop("GRADFLOW_DISABLED", None)
        # The script's watchers name the runs they register here.
        runs_file = os.path.join(notes, "runs")
        env[RUNS_FILE_ENV] = runs_file
        run_id: Optional[str] = None
        if server:
            # A shared server holds other runs: this check's run gets its own id
            # (unless the script picks one with run_id=).
            run_id = env.get("GRADFLOW_RUN_ID") or f"check-{uuid.uuid4().hex[:12]}"
            env["GRADFLOW_RUN_ID"] = run_id
        if steps is not None:
            env["GRADFLOW_MAX_STEPS"] = str(steps)
        script_exit = subprocess.call(list(command), env=env, stdout=script_stdout)
        time.sleep(settle)  # the last batch's detectors run inside its commit; be safe
        ids = read_runs(runs_file)
        if run_id is not None:
            # A client that does not name its runs (another language's) takes the id.
            ids = list(dict.fromkeys([*ids, run_id]))
        elif embedded is not None and embedded.fresh:
            # Every run on the check's own new database is the script's.
            listed = _get(url, "/api/v1/runs", token) or {}
            ids = list(dict.fromkeys([*ids, *(r["run_id"] for r in listed.get("runs", []))]))
        found = [_run_report(url, r, token) for r in ids]
        runs = [r for r in found if r is not None]
    finally:
        shutil.rmtree(notes, ignore_errors=True)
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
    elif not runs:
        verdict, code = "no_runs", 4
    else:
        verdict, code = "ok", 0
    return {
        "verdict": verdict,
        "exit_code": code,
        "script_exit_code": script_exit,
        "server": server if server else "embedded",
        # Where the runs can be seen once the check is over: the kept database of the
        # embedded server (None: it was temporary and is gone).
        "database": embedded.db if embedded is not None and embedded.kept else None,
        "run_id": run_id,
        "runs": [{k: r[k] for k in ("run_id", "steps", "alerts")} for r in runs],
        "warnings": _step_warnings(runs, steps),
        "fail_on": fail_on,
    }


def _episodes(report: Dict[str, Any]) -> List[Tuple[str, List[Dict[str, Any]]]]:
    """The alerts by run, kind and subject, in the order they opened: an alert that
    opened and resolved again and again is one entry with its episodes."""
    grouped: Dict[Tuple[str, str, str], List[Dict[str, Any]]] = {}
    for run in report["runs"]:
        for a in run["alerts"]:
            grouped.setdefault((run["run_id"], a.get("kind"), a.get("subject")), []).append(a)
    return [(key[0], alerts) for key, alerts in grouped.items()]


def _print_report(report: Dict[str, Any], out: Any) -> None:
    episodes = _episodes(report)
    for run_id, alerts in episodes:
        a, last = alerts[0], alerts[-1]
        step = a.get("opened_step")
        when = f"step {step}" if step is not None else "registration"
        if last.get("status") == "resolved":
            resolved = last.get("resolved_step")
            state = "resolved" + (f" at step {resolved}" if resolved is not None else "")
        else:
            state = "open at the end"
        count = f"{len(alerts)} episodes, the last " if len(alerts) > 1 else ""
        print(
            f"\n[{a['severity']}] {a['kind']} on {a['subject']} ({run_id}, {when}; {count}{state})",
            file=out,
        )
        print(f"  {a['title']}", file=out)
        print(f"  {a['detail']}", file=out)
        print(f"  fix: {a['fix']}", file=out)
    for warning in report["warnings"]:
        print(f"gradflow check: warning: {warning}", file=out)
    runs = len(report["runs"])
    raised = sum(len(r["alerts"]) for r in report["runs"])
    still_open = sum(1 for r in report["runs"] for a in r["alerts"] if a.get("status") == "open")
    summary = {
        "ok": (
            f"gradflow check: OK ({runs} run(s), no alert at or above {report['fail_on']} raised)"
        ),
        "alerts": (
            f"gradflow check: FAILED: {raised} alert(s) raised in {runs} run(s) "
            f"({still_open} still open at the end)"
        ),
        "script_failed": (
            f"gradflow check: FAILED: the script exited with {report['script_exit_code']} "
            "and gradflow raised no alert about it"
        ),
        "no_runs": (
            "gradflow check: FAILED: the script reported no run, so nothing was checked: "
            "it never called gradflow.watch"
        ),
    }[report["verdict"]]
    print(("\n" if episodes or report["warnings"] else "") + summary, file=out)


def where_to_see(report: Dict[str, Any]) -> Optional[str]:
    """Where the runs can be seen now that the check is over, or that they cannot:
    the pages the script linked to were on the check's own server, which is gone."""
    ids = [r["run_id"] for r in report["runs"]]
    if not ids:
        return None
    if report["server"] != "embedded":
        base = report["server"].split(",")[0].strip().rstrip("/")
        base = base if "://" in base else f"http://{base}"
        return "the runs: " + ", ".join(f"{base}/runs/{quote(i)}" for i in ids)
    db = report.get("database")
    if db:
        return (
            f"the runs are kept in {db}: `gradflow server --db {db}` serves them at "
            + ", ".join(f"http://127.0.0.1:7070/runs/{quote(i)}" for i in ids)
        )
    return (
        "the run pages the script linked to were on this check's own server, which has "
        "stopped, and its temporary database is deleted: pass --db PATH to keep the runs "
        "(then `gradflow server --db PATH`)"
    )


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
        allow_abbrev=False,
    )
    parser.add_argument(
        "--server",
        help="a running gradflow-server (default: GRADFLOW_SERVER, or start one)",
    )
    parser.add_argument("--server-bin", help="the gradflow-server binary to start")
    parser.add_argument(
        "--listen",
        metavar="ADDR",
        help="the started server's address, HOST:PORT (default: 127.0.0.1 and a free port)",
    )
    parser.add_argument(
        "--db",
        metavar="PATH",
        help="the started server's SQLite database, kept after the check "
        "(default: a temporary one, deleted)",
    )
    parser.add_argument("--steps", type=int, help="stop the script after N optimizer steps")
    parser.add_argument("--fail-on", choices=["warning", "critical"], default="warning")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print only the report, as JSON, on stdout (the script's stdout goes to stderr)",
    )
    parser.add_argument("command", nargs="*", help="the command (or put it after --)")
    args = parser.parse_args(own)
    command = command or args.command
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")
    starts = args.server_bin or args.listen or args.db
    if args.server and (args.listen or args.db):
        parser.error("--listen and --db place the server gradflow check starts: not with --server")
    try:
        # --server-bin, --listen or --db start a server even where GRADFLOW_SERVER is set.
        server = args.server or (None if starts else os.environ.get("GRADFLOW_SERVER"))
        report = run_check(
            command,
            server=server or None,
            server_bin=args.server_bin,
            steps=args.steps,
            fail_on=args.fail_on,
            script_stdout=sys.stderr if args.json else None,
            listen=args.listen,
            db=args.db,
        )
    except CheckError as err:
        if args.json:
            print(json.dumps({"verdict": "error", "exit_code": 3, "error": str(err)}))
        else:
            print(f"gradflow check: {err}", file=sys.stderr)
        return 3
    seen = where_to_see(report)
    if args.json:
        for warning in report["warnings"]:
            print(f"gradflow check: warning: {warning}", file=sys.stderr)
        if seen:
            print(f"gradflow check: {seen}", file=sys.stderr)
        print(json.dumps(report, indent=2))
    else:
        _print_report(report, sys.stdout)
        if seen:
            print(f"gradflow check: {seen}", file=sys.stdout)
    return int(report["exit_code"])
