"""``gf.step`` where the loop calls it: before the optimizer step (every record one
step late) or after every micro-batch (step numbers multiplied) is said once, on the
client; the loops the README shows say nothing."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from conftest import PromptAgent, batches, new_run_id
from torch import nn

import gradflow


def run(server, shape: str, steps: int = 8, scaler: bool = False):
    """shape: "right" (gf.step after optimizer.step), "before_backward", "per_micro"
    (gf.step after each of 2 micro-batches), "accumulate" (2 micro-batches, gf.step
    after the step). Returns the gradflow warnings shown."""
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = torch.amp.GradScaler("cpu", init_scale=2.0**40) if scaler else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gf = gradflow.watch(model, optimizer, amp, server=server.url, run_id=new_run_id("shape"))
        micro = 2 if shape in ("per_micro", "accumulate") else 1
        data = batches(steps * micro)
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            for _ in range(micro):
                tokens, target = next(data)
                loss = nn.functional.cross_entropy(model(tokens), target) / micro
                if shape == "before_backward":
                    gf.step(loss=loss)
                (loss if amp is None else amp.scale(loss)).backward()
                if shape == "per_micro":
                    gf.step(loss=loss)
            if amp is None:
                optimizer.step()
            else:
                amp.step(optimizer)
                amp.update()
            if shape in ("right", "accumulate"):
                gf.step(loss=loss)
        gf.close()
    return [str(w.message) for w in caught if issubclass(w.category, gradflow.GradflowWarning)]


def test_gf_step_before_backward_is_said_once(gradflow_server):
    said = run(gradflow_server, "before_backward")
    assert len(said) == 1, said
    assert "before the optimizer step" in said[0] and "one step late" in said[0]


def test_gf_step_after_every_micro_batch_is_said_once(gradflow_server):
    said = run(gradflow_server, "per_micro")
    assert len(said) == 1, said
    assert "times for" in said[0] and "once per optimizer step" in said[0]


def test_the_loops_the_readme_shows_say_nothing(gradflow_server):
    assert run(gradflow_server, "right") == []
    assert run(gradflow_server, "accumulate") == []
    # A loss scale that overflows at first: the scaler skips steps (no optimizer step
    # runs), and gf.step is still where it belongs.
    assert run(gradflow_server, "right", scaler=True) == []


def test_the_model_s_training_flag_is_sent_every_step(gradflow_server):
    """A model left in eval() after an evaluation (no dropout from then on): every
    record says whether the model was in training mode, as the metric
    model_training (1 or 0)."""
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id())
    for step, (tokens, target) in enumerate(batches(6)):
        if step == 3:
            model.eval()  # ... and never model.train() again
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(tokens), target)
        loss.backward()
        optimizer.step()
        gf.step(loss=loss)
    gf.close()
    flags = gradflow_server.series(gf.run_id, "metric", "model_training")
    assert [value for _, value in flags] == [1, 1, 1, 0, 0, 0], flags


# gf.step after each of two micro-batches: the loop-shape notice, from a process of
# its own so that what reaches stderr is counted.
PER_MICRO = """
import sys
import pytest
import torch
from torch import nn
import gradflow

model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
gf = gradflow.watch(model, optimizer, server=sys.argv[1], run_id=sys.argv[2])
for _ in range(6):
    optimizer.zero_grad()
    for _ in range(2):
        model(torch.randn(2, 4)).pow(2).mean().backward()
        gf.step(loss=1.0)
    optimizer.step()
gf.close()
"""


@pytest.mark.parametrize(
    "filters",
    [[], ["-W", "ignore"], ["-W", "error::UserWarning"]],
    ids=["default", "ignore", "error"],
)
def test_a_notice_reaches_stderr_once_whatever_the_warning_filters(
    tmp_path, gradflow_server, filters
):
    script = tmp_path / "per_micro.py"
    script.write_text(PER_MICRO)
    done = subprocess.run(
        [sys.executable, *filters, str(script), gradflow_server.url, new_run_id("notice")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("gf.step was called") == 1, done.stderr
    assert "internal error" not in done.stderr, done.stderr
