"""Corpus: healthy runs whose loss rises, swings or overshoots while training works,
and must stay silent: a GAN's generator loss climbing while its discriminator learns
faster, a REINFORCE loss growing with the return, Adam's first steps overshooting an
fp16 regression under a `GradScaler`, the noisy loss of batches of one.

Each runs over three seeds for three times `loss_spike`'s window, checks that its
loss really did what fooled a loss rule that compares with the start (rose to 3× or
more of it), that training measurably progressed, and that the server stored every
step.
"""

from __future__ import annotations

import math
from typing import List, Tuple

import torch
from corpus_support import (
    SPIKE_WINDOW,
    Progress,
    expects_silence,
    judge,
    quickstart,
    seeded,
    three_windows,
)
from torch import nn

# Three times the longest window of the loss rules these runs could trip: loss_spike's
# 128 readings (loss_divergence looks 15 back, adam_update_spike about 20).
STEPS = three_windows(SPIKE_WINDOW)


def rose_threefold(losses: List[float], within: int = 20) -> bool:
    """Whether the loss went above 3× the lowest of its first five values: what the
    former `loss_divergence` rule opened on."""
    start = min(losses[:5])
    return any(loss > 3 * start for loss in losses[:within] + losses[within:])


@seeded
@expects_silence
def test_a_gan_generator_loss_that_rises_while_it_improves(
    request, gradflow_server, gradflow_env, seed
):
    """A GAN whose discriminator learns faster than its generator: the generator's
    loss climbs from ~0.7 to several times that while the generated samples move onto
    the data ("gLoss is increasing while dLoss is decreasing ... the generator did
    learn something"; "it's normal").

    Threads: https://github.com/uclaacmai/Generative-Adversarial-Network-Tutorial/issues/4,
    https://github.com/Vandermode/ERRNet/issues/30, https://github.com/soumith/ganhacks/issues/14
    """
    torch.manual_seed(seed)
    generator = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
    discriminator = nn.Sequential(
        nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1)
    )
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    centre = torch.tensor([2.0, -1.0])
    data = torch.Generator().manual_seed(100 + seed)
    losses: List[float] = []

    def distance() -> float:
        with torch.no_grad():
            return float((generator(torch.randn(512, 4, generator=data)).mean(0) - centre).norm())

    start = distance()

    def step(i: int) -> torch.Tensor:
        real = torch.randn(64, 2, generator=data) * 0.5 + centre
        fake = generator(torch.randn(64, 4, generator=data))
        opt_d.zero_grad()
        d_loss = bce(discriminator(real), torch.ones(64, 1)) + bce(
            discriminator(fake.detach()), torch.zeros(64, 1)
        )
        d_loss.backward()
        opt_d.step()
        opt_g.zero_grad()
        g_loss = bce(discriminator(fake), torch.ones(64, 1))
        g_loss.backward()
        opt_g.step()
        losses.append(g_loss.item())
        return g_loss

    run_id = quickstart(generator, opt_g, step, steps=STEPS)
    assert rose_threefold(losses), losses[:10] + losses[-10:]
    # The samples moved onto the data.
    moved_on = Progress("distance of the samples' mean from the data's", start, distance(), by=0.4)
    judge(request, gradflow_server, run_id, steps=STEPS, progress=moved_on)


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 32)
        self.head = nn.Linear(32, 2)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(state)))


@seeded
@expects_silence
def test_a_reinforce_loss_that_grows_with_the_return(request, gradflow_server, gradflow_env, seed):
    """REINFORCE on an episodic task that goes on while the action is right: as the
    policy learns, episodes get longer, the summed returns larger and the loss
    `-(log_prob * return).sum()` grows with them ("reward increases with increasing
    criterion"; "the losses in RL are not necessarily decreasing").

    Threads: https://github.com/kengz/SLM-Lab/issues/437,
    https://github.com/werner-duvaud/muzero-general/issues/96
    """
    torch.manual_seed(seed)
    policy = Policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    env = torch.Generator().manual_seed(100 + seed)
    losses: List[float] = []
    lengths: List[int] = []

    def step(i: int) -> torch.Tensor:
        log_probs = []
        while len(log_probs) < 50:
            state = torch.randn(4, generator=env)
            dist = torch.distributions.Categorical(logits=policy(state))
            action = dist.sample()
            log_probs.append(dist.log_prob(action))
            if int(action) != int(state[0] > 0):
                break
        returns = torch.arange(len(log_probs), 0, -1, dtype=torch.float32)  # reward-to-go
        loss = -(torch.stack(log_probs) * returns).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        lengths.append(len(log_probs))
        return loss

    run_id = quickstart(policy, optimizer, step, steps=STEPS)
    assert rose_threefold(losses), losses[:10]
    first, last = sum(lengths[:40]) / 40, sum(lengths[-40:]) / 40
    longer = Progress("mean episode length", first, last, by=1.0, higher=True)
    judge(request, gradflow_server, run_id, steps=STEPS, progress=longer)


@seeded
@expects_silence
def test_adam_overshooting_an_fp16_regression_at_first(
    request, gradflow_server, gradflow_env, seed
):
    """fp16 autocast with a `GradScaler` and Adam at lr 0.1 on a regression: the
    first steps move every weight by about the lr whatever its gradient, the loss
    overshoots to several times its start for a few steps (and the scaler skips a
    step now and then while its scale settles), then it falls by two orders of
    magnitude.

    Threads: https://github.com/huggingface/accelerate/pull/139 (skipped updates at
    the beginning of mixed precision training are expected),
    https://github.com/ArgonneCPAC/diffmah/pull/57 (Adam's early steps, tamed by a
    warm-up)
    """
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    data = torch.Generator().manual_seed(100 + seed)
    weights = torch.randn(8, 1, generator=data)
    losses: List[float] = []

    def step(i: int) -> torch.Tensor:
        x = torch.randn(32, 8, generator=data)
        y = x @ weights + 0.1 * torch.randn(32, 1, generator=data)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
        return loss

    run_id = quickstart(model, optimizer, step, steps=STEPS, scaler=scaler)
    assert rose_threefold(losses), losses[:20]
    fell = Progress("loss (the last 10 steps' mean)", losses[0], sum(losses[-10:]) / 10, by=0.98)
    judge(request, gradflow_server, run_id, steps=STEPS, progress=fell)


@seeded
@expects_silence
def test_the_noisy_loss_of_batches_of_one(request, gradflow_server, gradflow_env, seed):
    """Batch size 1 with SGD and momentum on a regression with heavy-tailed noise
    (Student's t, 3 degrees of freedom):
    the per-step loss swings by orders of magnitude from one sample to the next
    while its average falls ("batch size 1 is online update, the noise is bound to
    be large").

    Threads: https://github.com/leeyeehoo/CSRNet-pytorch/issues/83,
    https://github.com/BVLC/caffe/issues/3801
    """
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=3e-3, momentum=0.9)
    data = torch.Generator().manual_seed(100 + seed)
    weights = torch.randn(8, 1, generator=data)
    held_out = torch.randn(256, 8, generator=data)
    losses: List[float] = []

    def error() -> float:
        with torch.no_grad():
            return float(nn.functional.mse_loss(model(held_out), held_out @ weights))

    start = error()

    def step(i: int) -> torch.Tensor:
        x = torch.randn(1, 8, generator=data)
        noise = torch.distributions.StudentT(3.0).sample((1, 1)) * 0.3
        loss = nn.functional.mse_loss(model(x), x @ weights + noise)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        return loss

    run_id = quickstart(model, optimizer, step, steps=STEPS)
    assert rose_threefold(losses), losses[:20]
    spread = max(losses[-100:]) / max(min(losses[-100:]), 1e-12)
    assert spread > 100, spread  # the swings are real
    assert not any(math.isnan(loss) for loss in losses)
    fitted = Progress("error on clean held-out data", start, error(), by=0.5)
    judge(request, gradflow_server, run_id, steps=STEPS, progress=fitted)


# -- a KL weight switched on after a warm-up ---------------------------------------------

VAE_DIM = 16
VAE_LATENT = 4
# The step the KL weight starts rising at, and over how many steps it reaches 1.
WARM_UP = 150
RAMP = 10


class SmallVAE(nn.Module):
    """A Gaussian VAE: the encoder gives the posterior's mean and log-variance."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(VAE_DIM, 64), nn.ReLU(), nn.Linear(64, 2 * VAE_LATENT))
        self.dec = nn.Sequential(nn.Linear(VAE_LATENT, 64), nn.ReLU(), nn.Linear(64, VAE_DIM))

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The reconstruction error and the KL term, batch means."""
        mu, logvar = self.enc(x).chunk(2, dim=1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        recon = nn.functional.mse_loss(self.dec(z), x, reduction="none").sum(1).mean()
        kl = 0.5 * (mu.pow(2) + logvar.exp() - 1 - logvar).sum(1).mean()
        return recon, kl


def sheet_batch(size: int, basis: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Points on a curved 2-D sheet in VAE_DIM dimensions."""
    u = torch.rand(size, 2, generator=g) * 2 - 1
    return torch.cat([u, torch.sin(math.pi * u), u.prod(1, keepdim=True)], dim=1) @ basis


@seeded
@expects_silence
def test_a_kl_weight_switched_on_after_a_warm_up(request, gradflow_server, gradflow_env, seed):
    """A VAE trained on its reconstruction alone for a warm-up, then the KL term's
    weight raised from 0 to 1 over ten steps (CADA-VAE's schedule: the other terms
    join once the autoencoders have learned to reconstruct): the loss climbs about
    eightfold within those ten steps, its gradient norm about fivefold, because the
    objective gained a term, then levels off while the posterior moves to the prior.

    Threads: https://github.com/sbharadwajj/Generalized-Zero-Shot-Learning-via-Aligned-Variational-Autoencoders/issues/1
    ("the loss increased very fast after epoch 22 ... because we are including a new
    loss term using the annealing scheme"),
    https://github.com/edgarschnfld/CADA-VAE-PyTorch/issues/25 (the warm-up schedule)
    """
    torch.manual_seed(seed)
    data = torch.Generator().manual_seed(300 + seed)
    basis = torch.randn(5, VAE_DIM, generator=data)
    model = SmallVAE()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    probe = sheet_batch(512, basis, data)
    # The error of predicting the data's mean: what a collapsed posterior reconstructs.
    spread = probe.var(0).sum().item()
    losses: List[float] = []
    kls: List[float] = []

    def step(i: int) -> torch.Tensor:
        weight = min(1.0, max(0.0, (i - WARM_UP) / RAMP))
        recon, kl = model(sheet_batch(64, basis, data))
        loss = recon + weight * kl
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        kls.append(kl.item())
        return loss

    run_id = quickstart(model, optimizer, step, steps=STEPS)
    with torch.no_grad():
        recon_after, _ = model(probe)
    # Alarming: within the ramp the loss rose to several times its level before it.
    before = sorted(losses[WARM_UP - 10 : WARM_UP])[5]
    assert max(losses[WARM_UP : WARM_UP + RAMP + 5]) > 5 * before, losses[
        WARM_UP - 5 : WARM_UP + 15
    ]
    # Healthy: the reconstructions still beat the data's mean by far ...
    assert recon_after.item() < 0.2 * spread, (recon_after.item(), spread)
    # ... and the posterior moved toward the prior once its weight came in.
    moved = Progress("KL term (the last 10 steps' mean)", kls[WARM_UP], sum(kls[-10:]) / 10, by=0.5)
    judge(request, gradflow_server, run_id, steps=STEPS, progress=moved)
