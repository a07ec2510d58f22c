"""Reinforcement learning and a VAE in the sixth set: SAC with a learned temperature
whose loss is read as if it must drive alpha to 0, and a VAE whose `zero_grad` sits
outside the accumulation branch.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, assert_silent, mean, watch

pytestmark = pytest.mark.validation


# -- rail-berkeley/softlearning#17: the temperature loss does not drive alpha to 0 -----


class PointMass:
    """A point on a line, pushed by the action in [-1, 1]; the reward is minus its
    squared distance to the origin; 20 steps an episode."""

    def __init__(self, g: torch.Generator) -> None:
        self.g = g

    def reset(self) -> torch.Tensor:
        self.t = 0
        self.x = torch.rand(1, generator=self.g) * 2 - 1
        return self.x.clone()

    def step(self, action: float):
        self.x = (self.x + 0.2 * action).clamp(-1.5, 1.5)
        self.t += 1
        return self.x.clone(), -float(self.x[0] ** 2), self.t >= 20


class Actor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 64), nn.ReLU(), nn.Linear(64, 2))

    def forward(self, s: torch.Tensor):
        mu, log_std = self.net(s).chunk(2, -1)
        return mu, log_std.clamp(-5, 2)

    def sample(self, s: torch.Tensor):
        mu, log_std = self(s)
        u = mu + log_std.exp() * torch.randn_like(mu)
        a = torch.tanh(u)
        logp = (-0.5 * ((u - mu) / log_std.exp()) ** 2 - log_std - 0.5 * math.log(2 * math.pi)).sum(
            -1
        ) - torch.log(1 - a.pow(2) + 1e-6).sum(-1)
        return a, logp


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q1 = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 1))
        self.q2 = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, s: torch.Tensor, a: torch.Tensor):
        sa = torch.cat([s, a], -1)
        return self.q1(sa).squeeze(-1), self.q2(sa).squeeze(-1)


def greedy_return(actor: Actor, g: torch.Generator) -> float:
    env, total = PointMass(g), 0.0
    for _ in range(10):
        s, done = env.reset(), False
        while not done:
            with torch.no_grad():
                a = torch.tanh(actor(s.unsqueeze(0))[0])
            s, r, done = env.step(float(a))
            total += r
    return total / 10


def train_sac(run_id: str, seed: int, updates: int = 300) -> Outcome:
    """SAC with automatic entropy tuning as softlearning: `alpha_loss =
    -(log_alpha * (log_pi + target_entropy).detach()).mean()`, target entropy -1, an
    Adam (3e-3) each for the actor, the critic and `log_alpha`, a Polyak target critic
    (tau 0.01); one environment step and one update per step after 200 random steps."""
    import copy

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9600 + seed)
    actor, critic = Actor(), Critic()
    target = copy.deepcopy(critic).requires_grad_(False)
    log_alpha = torch.zeros(1, requires_grad=True)
    opt_actor = torch.optim.Adam(actor.parameters(), lr=3e-3)
    opt_critic = torch.optim.Adam(critic.parameters(), lr=3e-3)
    opt_alpha = torch.optim.Adam([log_alpha], lr=3e-3)
    runs = {
        "actor": watch(f"{run_id}-actor", actor, opt_actor),
        "critic": watch(f"{run_id}-critic", critic, opt_critic),
    }
    before = greedy_return(actor, g)
    env = PointMass(g)
    buffer = []
    s = env.reset()
    alpha_losses, alphas = [], []
    for step in range(200 + updates):
        if step < 200:
            a = torch.rand(1, generator=g) * 2 - 1
        else:
            with torch.no_grad():
                a = actor.sample(s.unsqueeze(0))[0][0]
        s2, r, done = env.step(float(a))
        buffer.append((s, a, r, s2, float(done)))
        s = env.reset() if done else s2
        if step < 200:
            continue
        idx = torch.randint(0, len(buffer), (64,), generator=g)
        bs, ba, br, bs2, bd = (
            torch.stack([buffer[i][k] for i in idx])
            if k in (0, 1, 3)
            else torch.tensor([buffer[i][k] for i in idx])
            for k in range(5)
        )
        alpha = log_alpha.exp().detach()
        with torch.no_grad():
            a2, logp2 = actor.sample(bs2)
            q1t, q2t = target(bs2, a2)
            y = br + 0.9 * (1 - bd) * (torch.min(q1t, q2t) - alpha * logp2)
        q1, q2 = critic(bs, ba)
        critic_loss = F.mse_loss(q1, y) + F.mse_loss(q2, y)
        opt_critic.zero_grad()
        critic_loss.backward()
        opt_critic.step()
        runs["critic"].step(critic_loss)

        a_new, logp = actor.sample(bs)
        q1n, q2n = critic(bs, a_new)
        actor_loss = (alpha * logp - torch.min(q1n, q2n)).mean()
        opt_actor.zero_grad()
        actor_loss.backward()
        opt_actor.step()
        runs["actor"].step(actor_loss)

        alpha_loss = -(log_alpha * (logp.detach() - 1.0)).mean()
        opt_alpha.zero_grad()
        alpha_loss.backward()
        opt_alpha.step()
        alpha_losses.append(alpha_loss.item())
        alphas.append(log_alpha.exp().item())
        with torch.no_grad():
            for p, tp in zip(critic.parameters(), target.parameters()):
                tp.mul_(0.99).add_(0.01 * p)
    for run in runs.values():
        run.close()
    return Outcome(
        runs,
        {
            "before": before,
            "after": greedy_return(actor, g),
            "alpha_loss_signs": (
                mean([float(v > 0) for v in alpha_losses]),
                mean([float(v < 0) for v in alpha_losses]),
            ),
            "alpha_min": min(alphas),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_sac_temperature_loss_stays_negative(gradflow_server, gradflow_env, seed):
    """https://github.com/rail-berkeley/softlearning/issues/17"""
    outcome = train_sac(gradflow_env, seed)

    # The temperature's loss is negative on nearly every step, yet alpha settles well
    # above 0; the greedy policy ends far closer to the origin than at the start.
    facts = outcome.facts
    _, negative = facts["alpha_loss_signs"]
    assert negative > 0.9, facts
    assert facts["alpha_min"] > 0.1, facts
    assert facts["after"] > 0.5 * facts["before"], facts

    # The correct verdict: a healthy run.
    assert_silent(gradflow_server, outcome)


# -- gaozhihan/PreDiff#32: zero_grad outside the accumulation branch ------------------


class FrameVAE(nn.Module):
    """An MLP VAE over 64-d frames, latent 8."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 16))
        self.decoder = nn.Sequential(nn.Linear(8, 128), nn.SiLU(), nn.Linear(128, 64))

    def forward(self, x: torch.Tensor):
        mu, logvar = self.encoder(x).chunk(2, 1)
        z = mu + (0.5 * logvar).exp() * torch.randn_like(mu)
        return self.decoder(z), mu, logvar


def train_prediff_vae(run_id: str, seed: int, steps: int = 300, accumulation: int = 4) -> Outcome:
    """The VAE script's loop: `opt.zero_grad()` before every micro-batch's backward,
    outside `if (batch_idx + 1) % accumulate_grad_batches == 0: opt.step()`; MSE plus
    1e-4 x KL, Adam lr 1e-3, 4 micro-batches per step (the numbers are this case's)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9700 + seed)
    basis = torch.randn(8, 64, generator=g) / math.sqrt(8)
    model = FrameVAE()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    run = watch(run_id, model, optimizer)
    discarded = 0
    for batch_idx in range(steps * accumulation):
        x = torch.randn(16, 8, generator=g) @ basis
        recon, mu, logvar = model(x)
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1).mean()
        loss = F.mse_loss(recon, x) + 1e-4 * kl
        if batch_idx % accumulation != 0:
            # A micro-batch's gradient, meant to be accumulated, is about to be cleared.
            discarded += int(any(bool(p.grad.abs().sum() > 0) for p in model.parameters()))
        optimizer.zero_grad()
        loss.backward()
        if (batch_idx + 1) % accumulation == 0:
            optimizer.step()
            run.step(loss)
    run.close()
    return Outcome({"model": run}, {"discarded": discarded})


@pytest.mark.parametrize("seed", SEEDS)
def test_prediff_vae_zero_grad_outside_the_accumulation_branch(gradflow_server, gradflow_env, seed):
    """https://github.com/gaozhihan/PreDiff/issues/32"""
    outcome = train_prediff_vae(gradflow_env, seed)

    # 300 optimizer steps of 4 micro-batches; at every step the gradients of 3 of the
    # 4 micro-batches were cleared before the step: it uses the last one's alone.
    assert outcome.runs["model"].steps == 300
    assert outcome.facts["discarded"] == 900, outcome.facts

    # The correct verdict: the accumulation is reset between the backward passes.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="accumulation_reset",
            causes=("reset_between_backwards",),
            covers=("gradients",),
        ),
    )
