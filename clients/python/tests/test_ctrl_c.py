"""Ctrl-C in a training script whose server is out of reach: the process ends within
a second or two (not after the delivery wait), a second Ctrl-C ends it at once with
no traceback from gradflow, and the spool message is still printed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = """
import time, torch, gradflow
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
gf = gradflow.watch(model, optimizer)
for _ in range(5):
    loss = model(torch.randn(3, 4)).pow(2).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    gf.step(loss=loss)
print("TRAINING", flush=True)
time.sleep(120)
"""


def dead_url() -> str:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def start(tmp_path: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "GRADFLOW_SERVER": dead_url(),
        "GRADFLOW_RUN_ID": "ctrl-c",
        "GRADFLOW_SPOOL_DIR": str(tmp_path / "spool"),
    }
    process = subprocess.Popen(
        [sys.executable, "-c", SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # As from a terminal: a suite run as a background job (`cmd &` in a script)
        # hands its children SIGINT ignored, and Python then installs no
        # KeyboardInterrupt for it, so the Ctrl-C under test would never arrive.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "TRAINING"
    return process


def test_ctrl_c_ends_the_run_at_once_and_names_the_spool(tmp_path):
    process = start(tmp_path)
    interrupted = time.monotonic()
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    took = time.monotonic() - interrupted
    assert took < 5, f"{took:.1f} s after Ctrl-C:\n{err}"
    assert "KeyboardInterrupt" in err, err  # the user's own loop was interrupted
    assert "spool" in err and "gradflow report" in err, err


def test_a_second_ctrl_c_ends_it_without_a_traceback_from_gradflow(tmp_path):
    process = start(tmp_path)
    interrupted = time.monotonic()
    process.send_signal(signal.SIGINT)
    time.sleep(0.3)  # inside gradflow's close wait
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert time.monotonic() - interrupted < 5, err
    # One traceback, the user's loop interrupted by the first Ctrl-C; after it only
    # gradflow's line, with the spool to read.
    assert err.count("Traceback") == 1, err
    after = err.split("KeyboardInterrupt", 1)[1]
    assert "Traceback" not in after and "gradflow report" in after, err
