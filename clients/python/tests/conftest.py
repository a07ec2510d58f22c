"""Shared fixtures: a real gradflow-server on a free port, and (from ``tiny_models``,
imported on first use so that ``tests/unit`` runs without torch) a tiny Qwen2 agent.

The server binary is the workspace's ``target/debug/gradflow-server`` (built by
``scripts/python-tests.sh``), or ``GRADFLOW_SERVER_BIN``. Every test gets runs of
its own (unique run ids) on one session-wide server with a temporary database.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[3]


def server_binary() -> Path:
    explicit = os.environ.get("GRADFLOW_SERVER_BIN")
    path = Path(explicit) if explicit else REPO / "target" / "debug" / "gradflow-server"
    if not path.exists():
        pytest.fail(
            f"gradflow-server not found at {path}: build it with `cargo build -p gradflow-server` "
            "or set GRADFLOW_SERVER_BIN"
        )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """The real server binary on 127.0.0.1:`port` with its database at `db`; can be
    stopped and started again on the same port and file."""

    def __init__(self, db: Path, port: Optional[int] = None, *flags: str) -> None:
        self.db = db
        self.port = port or free_port()
        self.flags = flags
        self.process: Optional[subprocess.Popen] = None
        self.log: List[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        self.process = subprocess.Popen(
            [str(server_binary()), "--listen", f"127.0.0.1:{self.port}", "--db", str(self.db)]
            + list(self.flags),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")},
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
            raise RuntimeError("gradflow-server did not start:\n" + "".join(self.log[-20:]))
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()
        self.process = None

    def kill(self) -> None:
        """SIGKILL: the server dies mid-whatever, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.stop()

    # -- reads -------------------------------------------------------------------

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as response:
            return json.loads(response.read())

    def run(self, run_id: str) -> Dict[str, Any]:
        return self.get(f"/api/v1/runs/{run_id}")

    def has_run(self, run_id: str) -> bool:
        try:
            self.run(run_id)
            return True
        except urllib.error.HTTPError as err:
            if err.code == 404:
                return False
            raise

    def alerts(self, run_id: str, status: str = "all") -> List[Dict[str, Any]]:
        return self.get(f"/api/v1/runs/{run_id}/alerts?status={status}")["alerts"]

    def series(
        self, run_id: str, metric: str, subject: str = "", rank: Optional[int] = None
    ) -> List[List[Any]]:
        """A series' points; of the run (in a multi-rank run: its combined steps), or
        with `rank`, of that rank's own records."""
        query = f"metric={metric}" + (f"&subject={subject}" if subject else "")
        if rank is not None:
            query += f"&rank={rank}"
        return self.get(f"/api/v1/runs/{run_id}/series?{query}")["points"]

    def wait_for_alert(
        self,
        run_id: str,
        kind: str,
        subject: Optional[str] = None,
        timeout: float = 10.0,
    ) -> Dict[str, Any]:
        """The first alert of `kind` (on `subject`) of the run; fails with every alert
        the run has when none appears within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            alerts = self.alerts(run_id)
            for alert in alerts:
                if alert["kind"] == kind and (subject is None or alert["subject"] == subject):
                    return alert
            if time.monotonic() > deadline:
                seen = [(a["kind"], a["subject"], a["evidence"].get("cause")) for a in alerts]
                pytest.fail(f"no {kind} alert on {subject or 'any subject'} for {run_id}: {seen}")
            time.sleep(0.2)

    def wait_for_steps(self, run_id: str, steps: int, timeout: float = 10.0) -> None:
        """Waits until the server stored `steps` losses of the run (a silent run is only
        silent if its steps arrived); fails when they do not within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while len(self.series(run_id, "loss")) < steps:
            if time.monotonic() > deadline:
                pytest.fail(f"the server stored fewer than {steps} steps of {run_id}")
            time.sleep(0.2)

    def serious(self, run_id: str) -> List[Dict[str, Any]]:
        """The run's warning and critical alerts (what a healthy run must not have)."""
        return [a for a in self.alerts(run_id) if a["severity"] in ("warning", "critical")]


@pytest.fixture(scope="session")
def gradflow_server(tmp_path_factory: pytest.TempPathFactory):
    """A real gradflow-server for the whole session (``.url``, ``.alerts()``,
    ``.wait_for_alert()``, ``.run()``, ``.series()``)."""
    server = ServerProcess(tmp_path_factory.mktemp("server") / "gradflow.db").start()
    yield server
    server.stop()


@pytest.fixture
def gradflow_env(gradflow_server: ServerProcess, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Points GRADFLOW_* at the session server, with a fresh run id and spool folder."""
    run_id = f"test-{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("GRADFLOW_SERVER", gradflow_server.url)
    monkeypatch.setenv("GRADFLOW_RUN_ID", run_id)
    monkeypatch.setenv("GRADFLOW_SPOOL_DIR", str(tmp_path / "spool"))
    monkeypatch.delenv("GRADFLOW_DISABLED", raising=False)
    monkeypatch.delenv("GRADFLOW_INGEST_TOKEN", raising=False)
    return run_id


def new_run_id(stem: str = "t") -> str:
    return f"{stem}-{uuid.uuid4().hex[:10]}"


# The tiny models and the training loop need torch and transformers: they live in
# tiny_models.py and are imported only when a test asks for one.
_MODELS = {
    "ACTIONS",
    "AgentHead",
    "HIDDEN",
    "PROMPT",
    "PromptAgent",
    "VOCAB",
    "batches",
    "qwen_config",
    "train",
}


def __getattr__(name: str) -> Any:
    if name in _MODELS:
        import tiny_models

        return getattr(tiny_models, name)
    raise AttributeError(name)
