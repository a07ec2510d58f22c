"""Vision (the fifth set): SETR's naive decoder, whose convolutions are built inside
`forward`; a UNet whose mixed-precision loop clips the gradients while they are still
scaled; and two healthy runs: a hyperspectral classifier whose `ReduceLROnPlateau`
(mode `min`) reads minus the validation accuracy, and Hopenet's head-pose network,
whose stem is deliberately held at lr 0.
"""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import (
    SEEDS,
    Diagnosis,
    Outcome,
    assert_caught,
    assert_silent,
    mean,
    moved,
    snapshot,
    watch,
)

pytestmark = pytest.mark.validation


def rectangles(size: int, g: torch.Generator, side: int = 16) -> Tuple[torch.Tensor, torch.Tensor]:
    """Images with a bright rectangle on noise, and its mask (class 1 inside)."""
    images = torch.randn(size, 3, side, side, generator=g) * 0.5
    masks = torch.zeros(size, side, side, dtype=torch.long)
    for i in range(size):
        y, x = torch.randint(0, side // 2, (2,), generator=g).tolist()
        h, w = torch.randint(4, side // 2 + 1, (2,), generator=g).tolist()
        masks[i, y : y + h, x : x + w] = 1
    images[:, 0] += masks.float()
    return images, masks


def pixel_accuracy(model: nn.Module, g: torch.Generator) -> Tuple[float, float]:
    """The model's pixel accuracy, and that of calling every pixel background."""
    images, masks = rectangles(128, g)
    with torch.no_grad():
        right = (model(images).argmax(1) == masks).float().mean().item()
    return right, (masks == 0).float().mean().item()


# -- gupta-abhay/setr-pytorch#4: SETR's decoder is built in forward -------------------


class SetrNaive(nn.Module):
    """SETR-Naive in small: a patch embedding, a transformer encoder, and `_decode`,
    which builds its 1x1 convolution, batch norm and classifier convolution at every
    call, as the thread shows, and upsamples to the image."""

    def __init__(self, dim: int = 32, classes: int = 2) -> None:
        super().__init__()
        self.dim, self.classes = dim, classes
        self.patch_embed = nn.Conv2d(3, dim, 4, stride=4)
        self.position = nn.Parameter(torch.zeros(1, 16, dim))
        layer = nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)

    def _decode(self, x: torch.Tensor) -> torch.Tensor:
        conv1 = nn.Conv2d(self.dim, self.dim, 1)
        bn1 = nn.BatchNorm2d(self.dim)
        conv2 = nn.Conv2d(self.dim, self.classes, 1)
        x = conv2(F.relu(bn1(conv1(x))))
        return F.interpolate(x, scale_factor=4, mode="bilinear", align_corners=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images)
        b, c, h, w = x.shape
        x = self.encoder(x.flatten(2).transpose(1, 2) + self.position)
        return self._decode(x.transpose(1, 2).reshape(b, c, h, w))


def train_setr(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """SETR's schedule in small: SGD lr 0.01, momentum 0.9, poly decay (power 0.9),
    batch 16, cross-entropy per pixel."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(6100 + seed)
    model = SetrNaive()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    poly = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: (1 - i / steps) ** 0.9)
    run = watch(run_id, model, optimizer)
    losses: List[float] = []
    for _ in range(steps):
        images, masks = rectangles(16, g)
        loss = F.cross_entropy(model(images), masks)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        poly.step()
        run.step(loss)
        losses.append(loss.item())
    run.close()
    model.eval()
    features = torch.randn(1, 32, 4, 4)
    decoded_twice = [model._decode(features) for _ in range(2)]
    accuracy, background = pixel_accuracy(model, torch.Generator().manual_seed(6190 + seed))
    return Outcome(
        {"model": run},
        {
            "decoder_parameters": [n for n, _ in model.named_parameters() if "decode" in n],
            "same_decoder": torch.equal(decoded_twice[0], decoded_twice[1]),
            "accuracy": accuracy,
            "background": background,
            "loss_first": mean(losses[:30]),
            "loss_last": mean(losses[-30:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_setr_decoder_built_in_forward(gradflow_server, gradflow_env, seed):
    """https://github.com/gupta-abhay/setr-pytorch/issues/4"""
    outcome = train_setr(gradflow_env, seed)

    # The decoder's layers are no parameters of the model and are new random layers
    # at every call: the same features decode differently, the loss hardly falls and
    # the model does no better than calling every pixel background.
    facts = outcome.facts
    assert facts["decoder_parameters"] == [], facts
    assert not facts["same_decoder"], facts
    assert facts["loss_last"] > 0.8 * facts["loss_first"], facts
    assert facts["accuracy"] < facts["background"], facts

    # The correct verdict: the model's forward builds layers with parameters
    # registered nowhere (PROTOCOL: params_created_in_forward, subject `run` for the
    # model itself).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="params_created_in_forward",
            causes=("params_created_in_forward",),
            covers=("run",),
        ),
    )


# -- milesial/Pytorch-UNet#468: the gradients are clipped while still scaled ----------


class TinyUNet(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.inc = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.down = nn.Sequential(
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
        )
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.conv = nn.Sequential(
            nn.Conv2d(2 * width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.outc = nn.Conv2d(width, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.inc(x)
        x2 = self.down(x1)
        return self.outc(self.conv(torch.cat([x1, self.up(x2)], 1)))


def train_unet_amp(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """Pytorch-UNet's train.py in small: RMSprop (lr 1e-5 scaled to 1e-3 for the tiny
    model, weight decay 1e-8, momentum 0.999), batch 4, a GradScaler under fp16
    autocast (on the CPU here), cross-entropy, and `clip_grad_norm_(model.parameters(),
    1.0)` between `scaler.scale(loss).backward()` and `scaler.step(optimizer)` with no
    `scaler.unscale_(optimizer)` before it."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(6200 + seed)
    model = TinyUNet(width=4)
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, weight_decay=1e-8, momentum=0.999)
    scaler = torch.amp.GradScaler("cpu")
    run = watch(run_id, model, optimizer, scaler=scaler)
    used, unscaled = [], []
    for _ in range(steps):
        images, masks = rectangles(4, g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(images).float(), masks)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        unscaled.append(norm.item() / scale)
        used.append(
            torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in model.parameters()])
            ).item()
            / scale
        )
        scaler.step(optimizer)
        scaler.update()
        run.step(loss)
    run.close()
    return Outcome(
        {"model": run},
        {"unscaled_norm": mean(unscaled), "used_norm": mean(used)},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_unet_clips_the_scaled_gradients(gradflow_server, gradflow_env, seed):
    """https://github.com/milesial/Pytorch-UNet/issues/468"""
    outcome = train_unet_amp(gradflow_env, seed)

    # The clip measured the scaled norm and cut it to 1: once unscaled, the steps'
    # gradients are thousands of times smaller than the gradient (itself under 1).
    facts = outcome.facts
    assert facts["used_norm"] < 1e-3 * facts["unscaled_norm"], facts

    # The correct verdict (PROTOCOL: clip_before_unscale on `gradients`).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="clip_before_unscale",
            causes=("clip_before_unscale",),
            covers=("gradients",),
        ),
    )


# -- eecn/Hyperspectral-Classification#19: the plateau scheduler reads -val_acc -------

BANDS, CLASSES = 40, 4


def spectra(size: int, g: torch.Generator, centres: torch.Tensor):
    labels = torch.randint(0, CLASSES, (size,), generator=g)
    x = centres[labels] + torch.randn(size, BANDS, generator=g) * 1.2
    return x.unsqueeze(1), labels


class SpectralCNN(nn.Module):
    """The repository's 1-D spectral CNN (`HuEtAl`) in small: one convolution over the
    bands, max pooling, a hidden layer with tanh, the classes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 12, 7)
        self.pool = nn.MaxPool1d(3)
        self.fc1 = nn.Linear(12 * 11, 32)
        self.fc2 = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.tanh(self.conv(x))).flatten(1)
        return self.fc2(torch.tanh(self.fc1(x)))


def train_hyperspectral(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The repository's `train`: Adam (lr 1e-3 here), batch 32, a validation every
    epoch (10 steps), `ReduceLROnPlateau(optimizer, factor=0.1, patience=epoch // 4)`
    in its default mode `min`, stepped with `metric = -val_acc`."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(6300 + seed)
    centres = torch.cumsum(torch.randn(CLASSES, BANDS, generator=g) * 0.3, dim=1)
    model = SpectralCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    epochs = steps // 10
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, factor=0.1, patience=epochs // 4
    )
    run = watch(run_id, model, optimizer)
    val_x, val_y = spectra(512, g, centres)
    accuracies, lrs = [], []
    for step in range(steps):
        x, y = spectra(32, g, centres)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        if step % 10 == 9:
            model.eval()
            with torch.no_grad():
                val_acc = (model(val_x).argmax(1) == val_y).float().mean().item()
            model.train()
            accuracies.append(val_acc)
            scheduler.step(-val_acc)
            lrs.append(optimizer.param_groups[0]["lr"])
    run.close()
    return Outcome(
        {"model": run},
        {"acc_first": accuracies[0], "acc_last": accuracies[-1], "lr_cuts": len(set(lrs)) - 1},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_hyperspectral_plateau_reads_minus_the_accuracy(gradflow_server, gradflow_env, seed):
    """https://github.com/eecn/Hyperspectral-Classification/issues/19"""
    outcome = train_hyperspectral(gradflow_env, seed)

    # In mode `min`, minus the accuracy improves as the accuracy does: the classifier
    # learned, and the lr was cut only where the accuracy levelled off, twice at most.
    facts = outcome.facts
    assert facts["acc_last"] > facts["acc_first"] + 0.1, facts
    assert facts["acc_last"] > 0.8, facts
    assert facts["lr_cuts"] <= 2, facts

    # The correct verdict: a healthy run.
    assert_silent(gradflow_server, outcome)


# -- stevenyangyj/deep-head-pose-lite#7: Hopenet's stem trains at lr 0 ------------------

BINS = 66


def faces(size: int, g: torch.Generator, mixing: torch.Tensor):
    """Images made from three angles in [-99, 99) degrees through a fixed mixing."""
    angles = (torch.rand(size, 3, generator=g) * 2 - 1) * 99
    images = (torch.tanh(angles / 60) @ mixing).view(size, 1, 16, 16)
    return images + torch.randn(size, 1, 16, 16, generator=g) * 0.1, angles


class Hopenet(nn.Module):
    """Hopenet in small: a stem (conv1, bn1), a body, and one 66-bin head per angle."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = nn.Sequential(
            nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU()
        )
        self.layer2 = nn.Sequential(
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU()
        )
        self.fc_yaw = nn.Linear(32 * 16, BINS)
        self.fc_pitch = nn.Linear(32 * 16, BINS)
        self.fc_roll = nn.Linear(32 * 16, BINS)

    def forward(self, x: torch.Tensor):
        x = self.layer2(self.layer1(F.relu(self.bn1(self.conv1(x))))).flatten(1)
        return self.fc_yaw(x), self.fc_pitch(x), self.fc_roll(x)


def train_hopenet(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """train_hopenet.py: Adam with three groups, `get_ignored_params` (conv1, bn1) at
    lr 0, the body at lr, the three fc heads at 5 x lr (lr 1e-3), batch 32; each head
    a cross-entropy over 66 bins of 3 degrees plus alpha 0.001 x the MSE of the
    expected angle."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(6400 + seed)
    mixing = torch.randn(3, 256, generator=g)
    model = Hopenet()
    lr = 1e-3
    heads = [*model.fc_yaw.parameters(), *model.fc_pitch.parameters(), *model.fc_roll.parameters()]
    optimizer = torch.optim.Adam(
        [
            {"params": [*model.conv1.parameters(), *model.bn1.parameters()], "lr": 0},
            {"params": [*model.layer1.parameters(), *model.layer2.parameters()], "lr": lr},
            {"params": heads, "lr": lr * 5},
        ],
        lr=lr,
    )
    run = watch(run_id, model, optimizer)
    stem = {**snapshot(model.conv1), **{f"bn.{k}": v for k, v in snapshot(model.bn1).items()}}
    idx = torch.arange(BINS, dtype=torch.float32)
    errors = []
    for _ in range(steps):
        images, angles = faces(32, g, mixing)
        bins = ((angles + 99) / 3).long().clamp(0, BINS - 1)
        loss = 0.0
        err = 0.0
        for k, logits in enumerate(model(images)):
            expected = (F.softmax(logits, 1) * idx).sum(1) * 3 - 99
            loss = (
                loss
                + F.cross_entropy(logits, bins[:, k])
                + 0.001 * F.mse_loss(expected, angles[:, k])
            )
            err += (expected - angles[:, k]).abs().mean().item() / 3
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        errors.append(err)
    run.close()
    moved_stem = moved({k: v for k, v in stem.items() if not k.startswith("bn.")}, model.conv1)
    moved_stem |= moved({k[3:]: v for k, v in stem.items() if k.startswith("bn.")}, model.bn1)
    return Outcome(
        {"model": run},
        {
            "stem_moved": sorted(moved_stem),
            "mae_first": mean(errors[:20]),
            "mae_last": mean(errors[-20:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_hopenet_stem_held_at_lr_zero(gradflow_server, gradflow_env, seed):
    """https://github.com/stevenyangyj/deep-head-pose-lite/issues/7"""
    outcome = train_hopenet(gradflow_env, seed)

    # The stem (its batch norm's weights included) gets gradients and never moves, as
    # the training script means it to; the mean angle error fell by more than half.
    facts = outcome.facts
    assert facts["stem_moved"] == [], facts
    assert facts["mae_last"] < 0.5 * facts["mae_first"], facts

    # The correct verdict: a healthy run (a stem frozen by its group's lr on purpose).
    assert_silent(gradflow_server, outcome)
