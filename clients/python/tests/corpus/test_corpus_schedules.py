"""Corpus: failures of image and video models where the learning-rate scheduler and
the optimizer are mixed up: a super-resolution network whose per-epoch StepLR is
stepped at every iteration, a depth network whose loop calls `scheduler.step()`
instead of `optimizer.step()`, and a classifier whose ReduceLROnPlateau watches the
accuracy in "min" mode.

Each runs at three seeds for 150 steps: three times `grad_stuck_zero`'s 50-step
window, the longest of the detectors that could see these.
"""

from __future__ import annotations

from typing import Any, Callable, List

import pytest
import torch
from corpus_support import Classifier, expects, judge, moved, quickstart, snapshot
from torch import nn

SEEDS = [0, 1, 2]
STEPS = 150


def images(seed: int) -> Callable[[int], torch.Tensor]:
    """`draw(n)`: n smooth one-channel 8x8 images (upsampled 4x4 noise)."""
    g = torch.Generator().manual_seed(100 + seed)

    def draw(n: int) -> torch.Tensor:
        coarse = torch.randn(n, 1, 4, 4, generator=g)
        return nn.functional.interpolate(coarse, scale_factor=2, mode="bilinear")

    return draw


class SuperResolution(nn.Module):
    """SRResNet in small: conv features, a sub-pixel (PixelShuffle) upsampling by 2."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.PReLU())
        self.upsample = nn.Sequential(nn.Conv2d(16, 4, 3, padding=1), nn.PixelShuffle(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.upsample(self.features(x))


@expects("lr_vanished", "run", "lr_decayed")
@pytest.mark.parametrize("seed", SEEDS)
def test_a_per_epoch_step_schedule_stepped_at_every_iteration(
    request, gradflow_server, gradflow_env, seed
):
    """SRGAN's schedulers (`StepLR(step_size=epochs // 2, gamma=0.1)`, Adam 1e-4)
    are meant per epoch and stepped after every batch: "the learning rate is quickly
    becoming zero after a few training steps. The SRGAN does not seem to train."
    Twenty epochs: step size 10.

    Thread: https://github.com/Lornatang/SRGAN-PyTorch/issues/1
    """
    torch.manual_seed(seed)
    model = SuperResolution()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20 // 2, gamma=0.1)
    draw = images(seed)
    late: List[Any] = []

    def step(i: int) -> torch.Tensor:
        high = draw(16)
        loss = nn.functional.mse_loss(model(nn.functional.avg_pool2d(high, 2)), high)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()  # per batch, as the loop has it
        if i == 100:
            late.append(snapshot(model))
        return loss

    run_id = quickstart(model, optimizer, step, steps=STEPS)
    assert optimizer.param_groups[0]["lr"] < 1e-18
    # The last 50 steps moved no weight by more than a part in 10^12.
    (then,) = late
    shift = max(float((p - then[n]).abs().max()) for n, p in model.named_parameters())
    assert shift < 1e-12, shift
    judge(request, gradflow_server, run_id)


class DepthNet(nn.Module):
    """A disparity network in small: conv encoder, conv decoder, one output channel."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU())
        self.decoder = nn.Conv2d(8, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


@expects("optimizer_not_stepped", "optimizer", "never_stepped")
@pytest.mark.parametrize("seed", SEEDS)
def test_scheduler_stepped_instead_of_the_optimizer(request, gradflow_server, gradflow_env, seed):
    """SfmLearner with a scheduler added (Adam 2e-4, `--scheduler step`): the loop
    reads `if scheduler: scheduler.step() else: optimizer.step()`, so with a
    scheduler the optimizer never steps and "the loss doesn't come down"
    ("scheduler.step() only changes learning rate, but does not perform optimizer
    step").

    Thread: https://github.com/ClementPinard/SfmLearner-Pytorch/issues/5
    """
    torch.manual_seed(seed)
    model = DepthNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-4, betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.5)
    draw = images(seed)

    def step(i: int) -> torch.Tensor:
        image = draw(8)
        loss = nn.functional.l1_loss(model(image), image.flip(3))  # a learnable target
        optimizer.zero_grad()
        loss.backward()
        if scheduler:
            scheduler.step()
        else:
            optimizer.step()
        return loss

    before = snapshot(model)
    with pytest.warns(UserWarning, match="lr_scheduler.step"):
        run_id = quickstart(model, optimizer, step, steps=STEPS)
    assert not moved(before, model)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    judge(request, gradflow_server, run_id)


@expects("plateau_mode_mismatch", "ReduceLROnPlateau", "plateau_mode_mismatch")
@pytest.mark.parametrize("seed", SEEDS)
def test_a_plateau_schedule_watching_accuracy_in_min_mode(
    request, gradflow_server, gradflow_env, seed
):
    """ViS4mer's `ReduceLROnPlateau(optimizer, patience=..., factor=0.2)` in its
    default "min" mode, stepped with the validation accuracy: every evaluation whose
    accuracy rose counts as no improvement, so the lr falls while the model gets
    better ("ReduceLROnPlateau by default assumes a min metric ... In LVU tasks it is
    used for accuracy"; "I guess it was not intended"). AdamW 1e-3, an evaluation
    every 10 steps, patience 1.

    Thread: https://github.com/md-mohaiminul/ViS4mer/issues/4
    """
    torch.manual_seed(seed)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=1, factor=0.2)
    g = torch.Generator().manual_seed(100 + seed)
    held_out = torch.randn(512, 16, generator=torch.Generator().manual_seed(999))
    labels = ((held_out[:, 0] > 0).long() + 2 * (held_out[:, 1] > 0).long()) % 4
    accuracies: List[float] = []

    def step(i: int) -> torch.Tensor:
        x = torch.randn(8, 16, generator=g)
        y = ((x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()) % 4
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if i % 10 == 9:
            with torch.no_grad():
                accuracies.append(float((model(held_out).argmax(1) == labels).float().mean()))
            scheduler.step(accuracies[-1])
        return loss

    run_id = quickstart(model, optimizer, step, steps=STEPS)
    assert accuracies[4] > accuracies[0], accuracies  # it was learning
    assert optimizer.param_groups[0]["lr"] < 1e-3 * 0.2**3, optimizer.param_groups[0]["lr"]
    judge(request, gradflow_server, run_id)
