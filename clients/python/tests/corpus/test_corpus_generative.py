"""Corpus: failures of generative training: a sketch optimized by score distillation
through a frozen diffusion denoiser, whose second optimizer never zeroes its
gradients, and a conditional GAN whose generator sees the discriminator's verdict
on a detached output, so that its adversarial term trains nothing.

Each runs at three seeds for 150 steps: three times `grad_stuck_zero`'s 50-step
window, the longest of the detectors that could see these.
"""

from __future__ import annotations

from typing import List

import pytest
import torch
from conftest import new_run_id
from corpus_support import ANY, expects, judge, not_caught
from torch import nn

import gradflow

SEEDS = [0, 1, 2]
STEPS = 150

# -- score distillation through a frozen denoiser -----------------------------------

POINTS = 16
# A DDPM schedule of 100 steps, linear betas.
ALPHAS = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 100), 0)


class Denoiser(nn.Module):
    """A frozen noise predictor ε(x_t, t) over flattened point sets."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(2 * POINTS + 1, 64), nn.SiLU(), nn.Linear(64, 2 * POINTS)
        )

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, t[:, None].float() / 100], 1))


class GlobalTransform(nn.Module):
    """The sketch's global scale and translation (live_sketch's global deltas)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.shift = nn.Parameter(torch.zeros(2))

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        return points * self.scale + self.shift


class Painter(nn.Module):
    """Control points moved by per-point deltas, then by a global transform."""

    def __init__(self) -> None:
        super().__init__()
        self.points_delta = nn.Parameter(torch.zeros(POINTS, 2))
        self.global_transform = GlobalTransform()
        self.register_buffer("base", torch.randn(POINTS, 2))

    def forward(self) -> torch.Tensor:
        return self.global_transform(self.base + self.points_delta).reshape(1, -1)


@expects("grads_not_zeroed", "gradients", "not_zeroed")
@pytest.mark.parametrize("seed", SEEDS)
def test_score_distillation_whose_global_optimizer_is_never_zeroed(
    request, gradflow_server, gradflow_env, seed
):
    """live_sketch optimizes a sketch's points with score distillation through a
    frozen diffusion model, with two optimizers: the points' and the global
    transform's. Only `points_delta_optimizer.zero_grad()` is called, so the global
    transform steps on the sum of every gradient so far ("Seems like a bug ... this
    exists in all of our experiments as well").

    Thread: https://github.com/yael-vinker/live_sketch/issues/3
    """
    torch.manual_seed(seed)
    denoiser = Denoiser().requires_grad_(False)
    painter = Painter()
    points_optimizer = torch.optim.Adam([painter.points_delta], lr=1e-2)
    global_optimizer = torch.optim.Adam(painter.global_transform.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + seed)
    run_id = new_run_id("sketch-global")
    gf = gradflow.watch(painter.global_transform, global_optimizer, run_id=run_id)
    sums: List[float] = []
    for _ in range(STEPS):
        points_optimizer.zero_grad()  # the global optimizer's zero_grad is missing
        x = painter()
        t = torch.randint(20, 98, (1,), generator=g)
        noise = torch.randn(x.shape, generator=g)
        a = ALPHAS[t][:, None]
        with torch.no_grad():
            eps = denoiser(a.sqrt() * x + (1 - a).sqrt() * noise, t)
        # The SDS gradient (1 - ᾱ)(ε̂ - ε) pushed into the rendered points.
        loss = ((1 - a) * (eps - noise) * x).sum()
        loss.backward()
        points_optimizer.step()
        global_optimizer.step()
        gf.step(loss=loss)
        sums.append(float(painter.global_transform.shift.grad.norm()))
    gf.close()
    # The global transform's gradient is the sum of every step's: far above the first.
    assert sums[-1] > 10 * min(sums[:5]), sums[:5] + sums[-5:]
    judge(request, gradflow_server, run_id)


# -- a conditional GAN whose adversarial term is detached ---------------------------


@not_caught("missed: the adversarial term carries no gradient; the L1 term trains the generator")
@expects(ANY, "run", ANY)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_generator_whose_adversarial_term_sees_a_detached_output(
    request, gradflow_server, gradflow_env, seed
):
    """image2reverb's generator step passes `fake_spec.detach()` to the
    discriminator: `G_loss1 = mse(D(fake.detach(), f), 1)` adds nothing to the
    generator's gradient, only the L1 term `G_loss2` trains it ("that .detach()
    should not be there for the generator step and is a bug"). Adam 4e-4, β 0.0 and
    0.99 for both networks; L1 weighted 100.

    Thread: https://github.com/nikhilsinghmus/image2reverb/issues/37
    """
    torch.manual_seed(seed)
    generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
    discriminator = nn.Sequential(nn.Linear(16 + 8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt_g = torch.optim.Adam(generator.parameters(), lr=4e-4, betas=(0.0, 0.99))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=4e-4, betas=(0.0, 0.99))
    g = torch.Generator().manual_seed(100 + seed)
    mapping = torch.randn(8, 16, generator=g)
    run_id = new_run_id("gan-g")
    gf = gradflow.watch(generator, opt_g, run_id=run_id)
    for _ in range(STEPS):
        features = torch.randn(16, 8, generator=g)
        real = torch.tanh(features @ mapping)
        fake = generator(features)
        opt_g.zero_grad()
        g_adversarial = nn.functional.mse_loss(
            discriminator(torch.cat([fake.detach(), features], 1)), torch.ones(16, 1)
        )
        g_l1 = 100 * nn.functional.l1_loss(fake, real)
        (g_adversarial + g_l1).backward()
        opt_g.step()
        gf.step(loss=g_adversarial + g_l1)
        opt_d.zero_grad()
        d_real = discriminator(torch.cat([real, features], 1))
        d_fake = discriminator(torch.cat([fake.detach(), features], 1))
        d_loss = nn.functional.mse_loss(d_real, torch.ones(16, 1)) + nn.functional.mse_loss(
            d_fake, torch.zeros(16, 1)
        )
        d_loss.backward()
        opt_d.step()
    gf.close()
    # The adversarial term, as the loop builds it, does not reach the generator's
    # weights: its gradient with respect to each of them is None.
    fake = generator(torch.randn(4, 8, generator=g))
    term = nn.functional.mse_loss(
        discriminator(torch.cat([fake.detach(), torch.zeros(4, 8)], 1)), torch.ones(4, 1)
    )
    grads = torch.autograd.grad(term, list(generator.parameters()), allow_unused=True)
    assert all(grad is None for grad in grads)
    judge(request, gradflow_server, run_id)
