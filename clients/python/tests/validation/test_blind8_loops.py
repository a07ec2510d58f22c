"""Failures of the eighth set in the order of a loop's calls: an actor-critic that
zeroes its gradients inside its accumulation, a super-resolution GAN whose
discriminator is stepped by the generator's optimizer, a VRNN that clips after the
step, a weather model that clips the scaled gradients, and a classifier whose
plateau scheduler reads the loss in mode `max`."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, mean, moved, snapshot, watch

pytestmark = pytest.mark.validation


# -- HorizonRobotics/alf#1788: zero_grad before every micro-batch of an accumulation ----


class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 64), nn.Tanh())
        self.policy = nn.Linear(64, 4)
        self.value = nn.Linear(64, 1)

    def forward(self, s: torch.Tensor):
        h = self.body(s)
        return self.policy(h), self.value(h).squeeze(-1)


def bandit_batch(n: int, g: torch.Generator, w: torch.Tensor):
    s = torch.randn(n, 6, generator=g)
    return s, (s @ w).argmax(-1)


def actor_critic_loss(model: ActorCritic, s, best, g: torch.Generator) -> torch.Tensor:
    logits, v = model(s)
    dist = torch.distributions.Categorical(logits=logits)
    a = torch.multinomial(dist.probs.detach(), 1, generator=g).squeeze(-1)
    r = (a == best).float()
    adv = (r - v).detach()
    return -(dist.log_prob(a) * adv).mean() + 0.5 * F.mse_loss(v, r) - 0.01 * dist.entropy().mean()


def train_alf_accumulation(run_id: str, seed: int, steps: int = 300, k: int = 4) -> Outcome:
    """An actor-critic on a contextual bandit (4 actions, reward 1 for the best one),
    Adam 1e-3, gradients accumulated over 4 micro-batches of 32 per update; the loop
    calls `optimizer.zero_grad()` before each micro-batch's backward, so the update
    carries the last micro-batch's gradient alone."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(8800 + seed)
    w = torch.randn(6, 4, generator=g)
    model = ActorCritic()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    run = watch(run_id, model, optimizer)
    only_last = []
    for step in range(steps):
        total = 0.0
        last = None
        for i in range(k):
            s, best = bandit_batch(32, g, w)
            optimizer.zero_grad()
            loss = actor_critic_loss(model, s, best, g) / k
            if step < 5 and i == k - 1:
                last = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
            loss.backward()
            total = total + loss.detach()
        if last is not None:
            # The update's gradient is exactly the last micro-batch's.
            only_last.append(
                all(torch.allclose(p.grad, x) for p, x in zip(model.parameters(), last))
            )
        optimizer.step()
        run.step(total)
    run.close()
    return Outcome({"model": run}, {"only_last": only_last})


@pytest.mark.parametrize("seed", SEEDS)
def test_alf_zero_grad_inside_the_accumulation(gradflow_server, gradflow_env, seed):
    """https://github.com/HorizonRobotics/alf/pull/1788"""
    outcome = train_alf_accumulation(gradflow_env, seed)

    # Each update holds one micro-batch's gradient: the others were zeroed.
    assert all(outcome.facts["only_last"]), outcome.facts

    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="accumulation_reset", causes=("reset_between_backwards",)),
    )


# -- Lornatang/SRGAN-PyTorch#85: the discriminator's step is the generator's optimizer ---


class Upsampler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Conv2d(1, 16, 3, padding=1)
        self.body = nn.Sequential(nn.PReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.PReLU())
        self.up = nn.Sequential(nn.Conv2d(16, 4, 3, padding=1), nn.PixelShuffle(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.body(self.head(x)))


def patches(n: int, g: torch.Generator):
    """Smooth 16x16 images (sums of a few sinusoids) and their 8x8 averages."""
    yy, xx = torch.meshgrid(torch.linspace(0, 1, 16), torch.linspace(0, 1, 16), indexing="ij")
    f = torch.rand(n, 3, 2, generator=g) * 4 + 1
    ph = torch.rand(n, 3, generator=g) * 6.28
    hr = (
        sum(
            torch.sin(
                6.28 * (f[:, i, 0, None, None] * xx + f[:, i, 1, None, None] * yy)
                + ph[:, i, None, None]
            )
            for i in range(3)
        ).unsqueeze(1)
        / 3
    )
    return F.avg_pool2d(hr, 2), hr


def train_srgan(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """SRGAN's adversarial stage: the generator on a content MSE plus 1e-3 of the
    adversarial BCE, the discriminator on real against detached fakes; an Adam 1e-4
    each. The generator's block comes first; the discriminator's block zeroes the
    discriminator and then calls `g_optimizer.step()`: `d_optimizer` is never
    stepped, and the generator takes a second step on its own stale gradient."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(8900 + seed)
    generator = Upsampler()
    discriminator = nn.Sequential(
        nn.Conv2d(1, 16, 3, stride=2, padding=1),
        nn.LeakyReLU(0.2),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.LeakyReLU(0.2),
        nn.Flatten(),
        nn.Linear(32 * 16, 1),
    )
    g_optimizer = torch.optim.Adam(generator.parameters(), lr=1e-4)
    d_optimizer = torch.optim.Adam(discriminator.parameters(), lr=1e-4)
    runs = {
        "generator": watch(f"{run_id}-g", generator, g_optimizer),
        "discriminator": watch(f"{run_id}-d", discriminator, d_optimizer),
    }
    d_before = snapshot(discriminator)
    g_before = snapshot(generator)
    lr_val, hr_val = patches(256, g)
    with torch.no_grad():
        first = F.mse_loss(generator(lr_val), hr_val).item()
    ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)
    for _ in range(steps):
        lr_img, hr_img = patches(32, g)
        # the generator
        for p in discriminator.parameters():
            p.requires_grad_(False)
        generator.zero_grad()
        sr = generator(lr_img)
        g_loss = F.mse_loss(sr, hr_img) + 1e-3 * F.binary_cross_entropy_with_logits(
            discriminator(sr), ones
        )
        g_loss.backward()
        g_optimizer.step()
        runs["generator"].step(g_loss)
        for p in discriminator.parameters():
            p.requires_grad_(True)
        # the discriminator
        discriminator.zero_grad()
        d_loss = F.binary_cross_entropy_with_logits(
            discriminator(hr_img), ones
        ) + F.binary_cross_entropy_with_logits(discriminator(sr.detach()), zeros)
        d_loss.backward()
        g_optimizer.step()
        runs["discriminator"].step(d_loss)
    for run in runs.values():
        run.close()
    with torch.no_grad():
        last = F.mse_loss(generator(lr_val), hr_val).item()
    return Outcome(
        runs,
        {
            "d_moved": moved(d_before, discriminator),
            "g_moved": moved(g_before, generator),
            "first": first,
            "last": last,
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_srgan_discriminator_stepped_by_the_generator_optimizer(
    gradflow_server, gradflow_env, seed
):
    """https://github.com/Lornatang/SRGAN-PyTorch/issues/85"""
    outcome = train_srgan(gradflow_env, seed)

    # The discriminator gets gradients on every step and never changes.
    facts = outcome.facts
    assert not facts["d_moved"], facts
    assert facts["g_moved"] and facts["last"] < facts["first"], facts

    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="discriminator", kind="optimizer_not_stepped", causes=("never_stepped",)),
    )


# -- emited/VariationalRecurrentNeuralNetwork#3: the clip comes after the step -----------


class VRNN(nn.Module):
    """A variational RNN: feature extractors for x and z, an encoder, a prior and a
    Bernoulli decoder conditioned on a GRU state."""

    def __init__(self, x_dim: int = 8, h_dim: int = 32, z_dim: int = 4) -> None:
        super().__init__()
        self.phi_x = nn.Sequential(nn.Linear(x_dim, h_dim), nn.ReLU())
        self.phi_z = nn.Sequential(nn.Linear(z_dim, h_dim), nn.ReLU())
        self.enc = nn.Linear(2 * h_dim, 2 * z_dim)
        self.prior = nn.Linear(h_dim, 2 * z_dim)
        self.dec = nn.Sequential(nn.Linear(2 * h_dim, h_dim), nn.ReLU(), nn.Linear(h_dim, x_dim))
        self.rnn = nn.GRUCell(2 * h_dim, h_dim)
        self.h_dim = h_dim

    def forward(self, x: torch.Tensor):
        h = x.new_zeros(x.shape[1], self.h_dim)
        kld, nll = 0.0, 0.0
        for t in range(x.shape[0]):
            fx = self.phi_x(x[t])
            mu_q, logvar_q = self.enc(torch.cat([fx, h], -1)).chunk(2, -1)
            mu_p, logvar_p = self.prior(h).chunk(2, -1)
            z = mu_q + torch.randn_like(mu_q) * (0.5 * logvar_q).exp()
            fz = self.phi_z(z)
            logits = self.dec(torch.cat([fz, h], -1))
            kld = (
                kld
                + 0.5
                * (
                    logvar_p - logvar_q + (logvar_q.exp() + (mu_q - mu_p) ** 2) / logvar_p.exp() - 1
                ).sum()
            )
            nll = nll + F.binary_cross_entropy_with_logits(logits, x[t], reduction="sum")
            h = self.rnn(torch.cat([fx, fz], -1), h)
        return kld, nll


def binary_sequences(n: int, g: torch.Generator, length: int = 12) -> torch.Tensor:
    """Bit patterns that shift one place a step: (T, N, 8)."""
    start = (torch.rand(n, 8, generator=g) < 0.4).float()
    return torch.stack([start.roll(t, -1) for t in range(length)])


def train_vrnn(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The thread's loop: `optimizer.zero_grad()`, the summed KLD and NLL, backward,
    `optimizer.step()`, and then `clip_grad_norm_(model.parameters(), clip=10)`; Adam
    1e-3, batches of 32."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9000 + seed)
    model = VRNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    run = watch(run_id, model, optimizer)
    norms, losses = [], []
    for _ in range(steps):
        x = binary_sequences(32, g)
        optimizer.zero_grad()
        kld, nll = model(x)
        loss = kld + nll
        loss.backward()
        optimizer.step()
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), 10.0).item())
        run.step(loss)
        losses.append(loss.item())
    run.close()
    return Outcome(
        {"model": run},
        {
            "above_bound": mean([float(n > 10.0) for n in norms]),
            "first": mean(losses[:20]),
            "last": mean(losses[-20:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_vrnn_clips_after_the_step(gradflow_server, gradflow_env, seed):
    """https://github.com/emited/VariationalRecurrentNeuralNetwork/issues/3"""
    outcome = train_vrnn(gradflow_env, seed)

    # The gradients the optimizer used were above the bound on most steps: the clip,
    # after the step, cut none of them.
    assert outcome.facts["above_bound"] > 0.8, outcome.facts

    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="clip_after_step", causes=("clip_after_step",)),
    )


# -- NCAR/miles-credit#141: the clip reads the scaled gradients ---------------------------


def advected_fields(n: int, g: torch.Generator):
    """Two smooth 16x16 fields and the same fields one step later (shifted by a
    wind of one cell and damped)."""
    base = torch.randn(n, 2, 4, 4, generator=g)
    x = F.interpolate(base, size=(16, 16), mode="bilinear", align_corners=False)
    return x, 0.9 * x.roll(1, -1)


def train_credit(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """A small forecaster of the next state (an MLP over the flattened fields), fp16
    autocast (on the CPU here) with a GradScaler, AdamW 1e-3; `scaler.scale(loss).backward()`, then
    `clip_grad_norm_(model.parameters(), 1.0)` on the scaled gradients, then
    `scaler.step(optimizer)`."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9100 + seed)
    model = nn.Sequential(
        nn.Flatten(),
        nn.Linear(2 * 16 * 16, 256),
        nn.GELU(),
        nn.Linear(256, 256),
        nn.GELU(),
        nn.Linear(256, 2 * 16 * 16),
        nn.Unflatten(1, (2, 16, 16)),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    run = watch(run_id, model, optimizer, scaler=scaler)
    cut_under_bound = []
    for _ in range(steps):
        x, y = advected_fields(16, g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        cut_under_bound.append(norm > 1.0 and norm / scale < 1.0)
        scaler.step(optimizer)
        scaler.update()
        run.step(loss)
    run.close()
    return Outcome({"model": run}, {"cut_under_bound": mean([float(c) for c in cut_under_bound])})


@pytest.mark.parametrize("seed", SEEDS)
def test_credit_clips_the_scaled_gradients(gradflow_server, gradflow_env, seed):
    """https://github.com/NCAR/miles-credit/pull/141"""
    outcome = train_credit(gradflow_env, seed)

    # The clip cuts gradients whose true norm is under its bound on most steps.
    assert outcome.facts["cut_under_bound"] > 0.8, outcome.facts

    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="clip_before_unscale", causes=("clip_before_unscale",)),
    )


# -- IntelLabs/distiller#240: ReduceLROnPlateau in mode `max` reads the loss ------------


def train_distiller_plateau(
    run_id: str, seed: int, epochs: int = 16, per_epoch: int = 20
) -> Outcome:
    """An image classifier (a small CNN with batch norm) with SGD 0.1 momentum 0.9; a
    `ReduceLROnPlateau(mode="max", factor=0.5, patience=2)` meant for the top-1
    accuracy is stepped, as the classifier does, with the validation loss after each
    epoch of 20 batches."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9200 + seed)
    protos = torch.randn(4, 1, 8, 8, generator=g)

    def images(n: int):
        y = torch.randint(0, 4, (n,), generator=g)
        return protos[y] + 0.8 * torch.randn(n, 1, 8, 8, generator=g), y

    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 4),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, mode="max", factor=0.5, patience=2
    )
    run = watch(run_id, model, optimizer)
    val_x, val_y = images(512)
    val_losses, lrs = [], []
    for _ in range(epochs):
        model.train()
        for _ in range(per_epoch):
            x, y = images(32)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.step(loss)
        model.eval()
        with torch.no_grad():
            val_loss = F.cross_entropy(model(val_x), val_y).item()
        val_losses.append(val_loss)
        scheduler.step(val_loss)
        lrs.append(optimizer.param_groups[0]["lr"])
    run.close()
    return Outcome(
        {"model": run},
        {"val_losses": val_losses, "cuts": sum(1 for a, b in zip([0.1] + lrs, lrs) if b < a)},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_distiller_plateau_in_mode_max_reads_the_loss(gradflow_server, gradflow_env, seed):
    """https://github.com/IntelLabs/distiller/issues/240"""
    outcome = train_distiller_plateau(gradflow_env, seed)

    # The lr is cut again and again while the validation loss falls.
    facts = outcome.facts
    assert facts["cuts"] >= 2, facts
    assert facts["val_losses"][-1] < 0.7 * facts["val_losses"][0], facts

    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="plateau_mode_mismatch", causes=("plateau_mode_mismatch",)),
    )
