"""Image classification (the second set): a loop that calls `scheduler.step()` where
`optimizer.step()` belongs, a quantisation-aware CNN whose range initialisation
replaces the quantisers' scales after the optimizer took them, and a federated
client that clips its gradients after the optimizer already used them.

The images are the first set's: 8x8, one class a random pattern, drawn with noise and
a random shift.
"""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import (
    SEEDS,
    Diagnosis,
    Outcome,
    assert_caught,
    moved,
    snapshot,
    watch,
)
from .test_validation_vision import accuracy, labelled_batch
from .test_validation_vision import class_patterns as first_set_patterns

pytestmark = pytest.mark.validation

CLASSES = 4
STEPS = 300


def class_patterns(seed: int) -> torch.Tensor:
    return first_set_patterns(CLASSES, seed)


class SmallCNN(nn.Module):
    """Two conv layers with max pooling and a linear classifier: 8x8 -> 4 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 2 * 2, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


# -- pytorch#3814: scheduler.step() in place of optimizer.step() ----------------------


def train_scheduler_without_step(run_id: str, seed: int, steps: int = STEPS) -> Outcome:
    """The thread's loop: SGD with momentum and a StepLR; the user took the scheduler
    for a wrapper around the optimizer and calls `scheduler.step()` after every
    backward pass, never `optimizer.step()`. Nothing moves."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(300 + seed)
    patterns = class_patterns(seed)
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.1)
    before = snapshot(model)
    acc_before = accuracy(model, patterns, g)
    run = watch(run_id, model, optimizer)
    grad_norms: List[float] = []
    for _ in range(steps):
        images, labels = labelled_batch(patterns, 32, g)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        grad_norms.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item())
        scheduler.step()
        run.step(loss)
    run.close()
    return Outcome(
        {"model": run},
        {
            "moved": moved(before, model),
            "min_grad_norm": min(grad_norms),
            "accuracy_before": acc_before,
            "accuracy_after": accuracy(model, patterns, g),
            "lr_after": optimizer.param_groups[0]["lr"],
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_scheduler_stepped_instead_of_optimizer(gradflow_server, gradflow_env, seed):
    """https://github.com/pytorch/pytorch/issues/3814"""
    outcome = train_scheduler_without_step(gradflow_env, seed)

    facts = outcome.facts
    # Backward reaches every parameter on every step, and not one weight changes (the
    # classifier stays near chance); the schedule itself ran (the lr decayed three
    # times).
    assert facts["min_grad_norm"] > 0, facts
    assert facts["moved"] == set(), facts
    assert facts["accuracy_after"] < 0.5, facts
    assert facts["lr_after"] == pytest.approx(0.1 * 0.1**3), facts

    # The correct verdict: backward fills the gradients and the watched optimizer never
    # steps (PROTOCOL: optimizer_not_stepped, cause never_stepped; subject `optimizer`).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="optimizer_not_stepped", causes=("never_stepped",)),
    )


# -- nncf#327: range initialisation replaces the quantisers' scales -------------------


class FakeQuantize(nn.Module):
    """A symmetric 8-bit fake quantiser with a learned scale (straight-through
    rounding), as quantisation-aware training inserts before each layer."""

    LEVELS = 127

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale.abs() + 1e-6
        y = torch.clamp(x / scale, -self.LEVELS - 1, self.LEVELS)
        y = y + (torch.round(y) - y).detach()
        return y * scale

    def initialise_range(self, observed_absmax: float) -> None:
        # What the thread's initialiser did: a new Parameter in place of the old one,
        # where `self.scale.data.fill_(...)` would have kept the optimizer's tensor.
        self.scale = nn.Parameter(torch.tensor(observed_absmax / self.LEVELS))


class QuantizedCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 2 * 2, CLASSES)
        self.quantizers = nn.ModuleDict(
            {"input": FakeQuantize(), "conv1": FakeQuantize(), "conv2": FakeQuantize()}
        )
        self.observed: Dict[str, float] = {}

    def quantize(self, name: str, x: torch.Tensor) -> torch.Tensor:
        self.observed[name] = max(self.observed.get(name, 0.0), x.detach().abs().max().item())
        return self.quantizers[name](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quantize("input", x)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = self.quantize("conv1", x)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.quantize("conv2", x)
        return self.fc(x.flatten(1))


def train_range_init_after_optimizer(run_id: str, seed: int, steps: int = STEPS) -> Outcome:
    """Quantisation-aware training (Adam 1e-3): the model and its optimizer are built,
    the run is watched, then the range initialisation runs a few batches and sets each
    quantiser's scale by replacing the parameter. The optimizer steps the old scales;
    the new ones receive gradients and never change."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(400 + seed)
    patterns = class_patterns(seed)
    model = QuantizedCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    run = watch(run_id, model, optimizer)

    with torch.no_grad():
        for _ in range(4):
            model(labelled_batch(patterns, 32, g)[0])
    for name, quantizer in model.quantizers.items():
        quantizer.initialise_range(model.observed[name])

    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    scales_before = {n: q.scale.detach().clone() for n, q in model.quantizers.items()}
    weights_before = snapshot(model.conv1)
    acc_before = accuracy(model, patterns, g)
    scale_grads: List[float] = []
    for _ in range(steps):
        images, labels = labelled_batch(patterns, 32, g)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        scale_grads.append(min(q.scale.grad.abs().item() for q in model.quantizers.values()))
        optimizer.step()
        run.step(loss)
    run.close()
    return Outcome(
        {"model": run},
        {
            "scales_held": [n for n, q in model.quantizers.items() if id(q.scale) in held],
            "scales_moved": [
                n for n, q in model.quantizers.items() if not torch.equal(q.scale, scales_before[n])
            ],
            "scale_grad_steps": sum(1 for v in scale_grads if v > 0),
            "conv1_moved": moved(weights_before, model.conv1),
            "accuracy_before": acc_before,
            "accuracy_after": accuracy(model, patterns, g),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_quantizer_scales_replaced_after_the_optimizer(gradflow_server, gradflow_env, seed):
    """https://github.com/openvinotoolkit/nncf/pull/327"""
    outcome = train_range_init_after_optimizer(gradflow_env, seed)

    facts = outcome.facts
    # The scales the model uses are not the optimizer's: they get gradients on most
    # steps and never change, while the rest of the network trains.
    assert facts["scales_held"] == [], facts
    assert facts["scales_moved"] == [], facts
    assert facts["scale_grad_steps"] > STEPS // 2, facts
    assert facts["conv1_moved"], facts
    assert facts["accuracy_after"] > facts["accuracy_before"] + 0.2, facts

    # The correct verdict: trainable parameters outside the optimizer, the quantisers'
    # scales (PROTOCOL: param_not_in_optimizer; `not_in_optimizer`, or
    # `replaced_after_optimizer` where the replacement is seen as such).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="param_not_in_optimizer",
            causes=("not_in_optimizer", "replaced_after_optimizer"),
            covers=("quantizers",),
        ),
    )


# -- APPFL#197: the federated client clips after optimizer.step() ---------------------


def train_client_clipping_after_step(run_id: str, seed: int, steps: int = STEPS) -> Outcome:
    """APPFL's client optimizer as the thread found it: SGD (lr 0.01), and with
    `clip_grad` on, `clip_grad_norm_(model.parameters(), clip_value=1, norm_type=1)`
    right after `optimizer.step()`: every update uses the unclipped gradient. The
    client's local steps run in rounds of 30, starting each round from the server's
    average (one client here, so the average is its own weights)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(500 + seed)
    patterns = class_patterns(seed)
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    clip_value, clip_norm = 1.0, 1
    acc_before = accuracy(model, patterns, g)
    run = watch(run_id, model, optimizer)
    used_norms: List[float] = []
    clipped_norms: List[float] = []
    for round_start in range(0, steps, 30):
        global_state = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(global_state)
        for _ in range(min(30, steps - round_start)):
            images, labels = labelled_batch(patterns, 32, g)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            used_norms.append(
                torch.cat([p.grad.flatten() for p in model.parameters()]).norm(p=1).item()
            )
            optimizer.step()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_value, norm_type=clip_norm)
            clipped_norms.append(
                torch.cat([p.grad.flatten() for p in model.parameters()]).norm(p=1).item()
            )
            run.step(loss)
    run.close()
    return Outcome(
        {"model": run},
        {
            "steps_over_the_limit": sum(1 for n in used_norms if n > clip_value),
            "median_used_norm": sorted(used_norms)[len(used_norms) // 2],
            "max_clipped_norm": max(clipped_norms),
            "accuracy_before": acc_before,
            "accuracy_after": accuracy(model, patterns, g),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_federated_client_clips_after_step(gradflow_server, gradflow_env, seed):
    """https://github.com/APPFL/APPFL/issues/197"""
    outcome = train_client_clipping_after_step(gradflow_env, seed)

    facts = outcome.facts
    # The optimizer used gradients far over the limit on (nearly) every step; the clip
    # ran, on gradients nothing would use again.
    assert facts["steps_over_the_limit"] >= STEPS - 5, facts
    assert facts["median_used_norm"] > 3, facts
    assert facts["max_clipped_norm"] <= 1.0 + 1e-4, facts

    # The correct verdict: clip_grad_norm_ cut gradients the optimizer had already used
    # (PROTOCOL: clip_after_step; subject `gradients`).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="clip_after_step", causes=("clip_after_step",)),
    )
