"""What the user hands gradflow, and what the user's own code raises, stay the
user's: a tensor that still carries its graph is read without torch's warning coming
from gradflow's code, and an error raised inside ``scaler.step`` reaches the user
untouched, with nothing of gradflow's printed before it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import new_run_id

# A GAN-shaped step: the discriminator's loss, still attached to its graph, passed as a
# metric, and the loss too.
GRAPH_METRICS = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch import nn
    import gradflow

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gf = gradflow.watch(model, optimizer, server=sys.argv[1], run_id=sys.argv[2])
    sent = []
    for step in range(6):
        optimizer.zero_grad()
        out = model(torch.randn(16, 4))
        loss = out.pow(2).mean()
        loss_d = torch.sigmoid(out).mean()  # requires grad: part of the graph
        loss.backward()
        optimizer.step()
        gf.step(loss=loss, metrics={"loss_d": loss_d, "real_acc": 0.5 + step / 100})
        sent.append(loss_d.item())
    gf.close()
    print(json.dumps(sent))
    """
)


def test_metrics_and_loss_that_carry_a_graph_are_read_without_a_warning(tmp_path, gradflow_server):
    run_id = new_run_id("graph-metrics")
    script = tmp_path / "gan_step.py"
    script.write_text(GRAPH_METRICS)
    done = subprocess.run(
        [sys.executable, "-W", "error", str(script), gradflow_server.url, run_id],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr and "internal error" not in done.stderr, done.stderr
    sent = json.loads(done.stdout.splitlines()[-1])
    stored = gradflow_server.series(run_id, "metric", "loss_d")
    assert [step for step, _ in stored] == list(range(6)), stored
    assert all(abs(value - v) < 1e-6 for (_, value), v in zip(stored, sent)), (stored, sent)
    assert gradflow_server.series(run_id, "metric", "real_acc")[-1] == [5, 0.55]


# A PyTorch error inside the user's scaler.step: fp16 parameters under a GradScaler
# ("Attempting to unscale FP16 gradients", as CUDA's unscale fails on bf16 ones), or
# the optimizer's own step failing inside it.
SCALER_STEP = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    import gradflow

    class Failing(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("the optimizer's own error")

    torch.manual_seed(0)
    fp16 = sys.argv[3] == "fp16"
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    if fp16:
        model = model.half()
    optimizer = (torch.optim.SGD if fp16 else Failing)(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    gf = gradflow.watch(model, optimizer, scaler=scaler, server=sys.argv[1], run_id=sys.argv[2])
    for step in range(3):
        optimizer.zero_grad()
        x = torch.randn(3, 4)
        loss = model(x.half() if fp16 else x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        gf.step(loss=loss)
    """
)


def run_scaler_step(tmp_path, server, case: str) -> subprocess.CompletedProcess:
    script = tmp_path / f"scaler_{case}.py"
    script.write_text(SCALER_STEP)
    return subprocess.run(
        [sys.executable, str(script), server.url, new_run_id(f"scaler-{case}"), case],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "case, error",
    [
        ("fp16", "ValueError: Attempting to unscale FP16 gradients."),
        ("optimizer", "RuntimeError: the optimizer's own error"),
    ],
)
def test_an_error_inside_scaler_step_is_the_users_alone(tmp_path, gradflow_server, case, error):
    done = run_scaler_step(tmp_path, gradflow_server, case)
    assert done.returncode == 1
    assert done.stderr.rstrip().endswith(error), done.stderr
    assert "internal error" not in done.stderr, done.stderr
    assert done.stderr.count("Traceback (most recent call last)") == 1, done.stderr
