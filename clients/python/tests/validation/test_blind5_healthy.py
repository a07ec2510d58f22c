"""Healthy look-alikes of the fifth set beyond vision and transformers: SB3's A2C
whose losses are negative, a normalizing flow whose NLL goes below 0 and whose loop
zeroes the gradients after the forward pass, a diffusion loop that calls
`optimizer.step()` on every micro-batch under Accelerate's gradient accumulation,
SimSiam's negative cosine loss, and AutoBots-style trajectory forecasting with a
Gaussian NLL trained by Lightning.
"""

from __future__ import annotations

import math
import warnings
from typing import List

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Outcome, Run, assert_silent, dry, mean, watch
from .test_validation_rl import CartPole

pytestmark = pytest.mark.validation


# -- DLR-RM/stable-baselines3#661: A2C's losses are negative --------------------------


class ActorCritic(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.pi = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 2))
        self.vf = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def greedy_return(policy: ActorCritic, g: torch.Generator) -> float:
    env, total = CartPole(g), 0.0
    for _ in range(3):
        state, done = env.reset(), False
        while not done:
            with torch.no_grad():
                action = int(policy.pi(torch.tensor([state])).argmax(1))
            state, reward, done = env.step(action)
            total += reward
    return total / 3


def train_a2c(run_id: str, seed: int, updates: int = 300) -> Outcome:
    """SB3's A2C defaults: n_steps 5 on 8 environments, gamma 0.99, ent_coef 0.0 on the
    loss (the entropy loss is still logged), vf_coef 0.5, max_grad_norm 0.5, RMSprop
    (lr 7e-4, alpha 0.99, eps 1e-5); lr 3e-3 here for a 300-update run."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7300 + seed)
    envs = [CartPole(g) for _ in range(8)]
    states = [env.reset() for env in envs]
    model = ActorCritic()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=3e-3, alpha=0.99, eps=1e-5)
    run = watch(run_id, model, optimizer)
    before = greedy_return(model, g)
    policy_losses: List[float] = []
    entropy_losses: List[float] = []
    for _ in range(updates):
        obs, acts, rews, dones = [], [], [], []
        for _ in range(5):
            s = torch.tensor(states)
            with torch.no_grad():
                a = torch.distributions.Categorical(logits=model.pi(s)).sample()
            step = [env.step(int(x)) for env, x in zip(envs, a)]
            obs.append(s)
            acts.append(a)
            rews.append(torch.tensor([r for _, r, _ in step]))
            dones.append(torch.tensor([float(d) for _, _, d in step]))
            states = [env.reset() if d else ns for env, (ns, _, d) in zip(envs, step)]
        with torch.no_grad():
            ret = model.vf(torch.tensor(states)).squeeze(1)
        returns = []
        for r, d in zip(reversed(rews), reversed(dones)):
            ret = r + 0.99 * ret * (1 - d)
            returns.insert(0, ret)
        s, a, R = torch.cat(obs), torch.cat(acts), torch.cat(returns)
        dist = torch.distributions.Categorical(logits=model.pi(s))
        values = model.vf(s).squeeze(1)
        advantages = (R - values).detach()
        policy_loss = -(advantages * dist.log_prob(a)).mean()
        entropy_loss = -dist.entropy().mean()
        loss = policy_loss + 0.0 * entropy_loss + 0.5 * F.mse_loss(values, R)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        run.step(loss)
        policy_losses.append(policy_loss.item())
        entropy_losses.append(entropy_loss.item())
    run.close()
    return Outcome(
        {"model": run},
        {
            "before": before,
            "after": greedy_return(model, g),
            "negative_policy_share": mean([float(x < 0) for x in policy_losses]),
            "entropy_loss_max": max(entropy_losses),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_a2c_losses_are_negative(gradflow_server, gradflow_env, seed):
    """https://github.com/DLR-RM/stable-baselines3/issues/661"""
    outcome = train_a2c(gradflow_env, seed)

    # The entropy loss is negative throughout, the policy loss often; the greedy
    # policy balances the pole far longer than at the start.
    facts = outcome.facts
    assert facts["entropy_loss_max"] < 0, facts
    assert facts["negative_policy_share"] > 0.1, facts
    assert facts["after"] > 2 * facts["before"] and facts["after"] > 60, facts

    # The correct verdict: a healthy run.
    assert_silent(gradflow_server, outcome)


# -- rll/deepul#12: a flow's NLL goes negative; zero_grad follows the forward ----------


class AffineCoupling(nn.Module):
    def __init__(self, flip: bool, hidden: int = 32) -> None:
        super().__init__()
        self.flip = flip
        self.net = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, x: torch.Tensor):
        a, b = (x[:, 1:], x[:, :1]) if self.flip else (x[:, :1], x[:, 1:])
        log_s, t = self.net(a).chunk(2, 1)
        log_s = torch.tanh(log_s)
        b = b * torch.exp(log_s) + t
        out = torch.cat([b, a], 1) if self.flip else torch.cat([a, b], 1)
        return out, log_s.squeeze(1)


class RealNVP(nn.Module):
    """The lecture's 2-d RealNVP: affine couplings alternating halves, a standard
    normal base."""

    def __init__(self, layers: int = 6) -> None:
        super().__init__()
        self.couplings = nn.ModuleList(AffineCoupling(i % 2 == 1) for i in range(layers))

    def nll(self, x: torch.Tensor) -> torch.Tensor:
        log_det = torch.zeros(x.shape[0])
        for coupling in self.couplings:
            x, ld = coupling(x)
            log_det = log_det + ld
        base = -0.5 * (x**2).sum(1) - math.log(2 * math.pi)
        return -(base + log_det).mean()


def narrow_moons(size: int, g: torch.Generator) -> torch.Tensor:
    angle = torch.rand(size, generator=g) * math.pi
    upper = torch.rand(size, generator=g) < 0.5
    x = torch.stack([torch.cos(angle), torch.sin(angle)], 1) * 0.5
    x = torch.where(upper.unsqueeze(1), x, torch.stack([0.5 - x[:, 0], 0.15 - x[:, 1]], 1))
    return x + 0.03 * torch.randn(size, 2, generator=g)


def train_flow(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The demo's loop: `loss = model.nll(x)`, `optimizer.zero_grad()`,
    `loss.backward()`, `optimizer.step()`; Adam lr 5e-3, batch 128, on narrow
    two-moons data (a density far above 1 where the data lie)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7400 + seed)
    model = RealNVP()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    run = watch(run_id, model, optimizer)
    held_out = narrow_moons(1024, g)
    with torch.no_grad():
        before = model.nll(held_out).item()
    losses = []
    for _ in range(steps):
        x = narrow_moons(128, g)
        loss = model.nll(x)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        losses.append(loss.item())
    run.close()
    with torch.no_grad():
        after = model.nll(held_out).item()
    return Outcome({"model": run}, {"before": before, "after": after, "last": mean(losses[-30:])})


@pytest.mark.parametrize("seed", SEEDS)
def test_flow_nll_goes_negative(gradflow_server, gradflow_env, seed):
    """https://github.com/rll/deepul/issues/12"""
    outcome = train_flow(gradflow_env, seed)

    # The held-out NLL fell far, through 0.
    facts = outcome.facts
    assert facts["after"] < 0 < facts["before"], facts
    assert facts["last"] < 0, facts

    # The correct verdict: a healthy run.
    assert_silent(gradflow_server, outcome)


# -- huggingface/diffusers#10855: optimizer.step() on every micro-batch under accumulate


class Denoiser(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(3, hidden),
            nn.SiLU(),
            nn.Linear(hidden, hidden),
            nn.SiLU(),
            nn.Linear(hidden, 2),
        )

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, t.unsqueeze(1)], 1))


def ring(size: int, g: torch.Generator) -> torch.Tensor:
    angle = torch.rand(size, generator=g) * 2 * math.pi
    return torch.stack([torch.cos(angle), torch.sin(angle)], 1) + 0.05 * torch.randn(
        size, 2, generator=g
    )


def train_accelerate_diffusion(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The training script's loop: `with accelerator.accumulate(model):` the
    noise-prediction loss, `accelerator.backward(loss)`, a clip when
    `accelerator.sync_gradients`, then `optimizer.step()`, `lr_scheduler.step()`,
    `optimizer.zero_grad()` on every micro-batch; Accelerate's prepared optimizer only
    steps when the gradients are synchronised (4 accumulation steps). AdamW lr 1e-3,
    a constant schedule with warm-up, batch 32; `gf.step` once per optimizer step."""
    from accelerate import Accelerator

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7500 + seed)
    accelerator = Accelerator(gradient_accumulation_steps=4, cpu=True)
    model = Denoiser()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 40))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    run = watch(run_id, model, optimizer)
    betas = torch.linspace(1e-4, 0.05, 50)
    alphas_bar = torch.cumprod(1 - betas, 0)

    def diffusion_loss(x0: torch.Tensor) -> torch.Tensor:
        t = torch.randint(0, 50, (x0.shape[0],), generator=g)
        noise = torch.randn(x0.shape, generator=g)
        a = alphas_bar[t].unsqueeze(1)
        return F.mse_loss(model(a.sqrt() * x0 + (1 - a).sqrt() * noise, t / 50), noise)

    held = ring(1024, torch.Generator().manual_seed(7590 + seed))
    with torch.no_grad():
        before = diffusion_loss(held).item()
    for _ in range(steps * 4):
        with accelerator.accumulate(model):
            loss = diffusion_loss(ring(32, g))
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            run.step(loss)
    run.close()
    with torch.no_grad():
        after = diffusion_loss(held).item()
    return Outcome({"model": run}, {"before": before, "after": after})


@pytest.mark.parametrize("seed", SEEDS)
def test_accelerate_steps_every_micro_batch_under_accumulation(gradflow_server, gradflow_env, seed):
    """https://github.com/huggingface/diffusers/issues/10855"""
    outcome = train_accelerate_diffusion(gradflow_env, seed)

    # 300 optimizer steps of 4 micro-batches; the denoiser learned.
    facts = outcome.facts
    assert outcome.runs["model"].steps == 300
    assert facts["after"] < 0.8 * facts["before"], facts

    # The correct verdict: a healthy run.
    assert_silent(gradflow_server, outcome)


# -- facebookresearch/simsiam#21: the loss is a negative cosine -------------------------


class SimSiam(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(16, 64),
            nn.BatchNorm1d(64),
            nn.ReLU(),
            nn.Linear(64, dim),
            nn.BatchNorm1d(dim),
        )
        self.predictor = nn.Sequential(
            nn.Linear(dim, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, dim)
        )


def views(size: int, g: torch.Generator, prototypes: torch.Tensor):
    labels = torch.randint(0, 4, (size,), generator=g)
    base = prototypes[labels]

    def augment() -> torch.Tensor:
        mask = (torch.rand(size, 16, generator=g) > 0.2).float()
        return base * mask + 0.3 * torch.randn(size, 16, generator=g)

    return augment(), augment(), labels


def probe_accuracy(model: SimSiam, g: torch.Generator, prototypes: torch.Tensor) -> float:
    """Nearest class mean in the encoder's space, on held-out samples."""
    model.eval()
    with torch.no_grad():
        x, _, y = views(512, g, prototypes)
        z = F.normalize(model.encoder(x), dim=1)
        centres = F.normalize(torch.stack([z[y == c].mean(0) for c in range(4)]), dim=1)
        x, _, y = views(512, g, prototypes)
        z = F.normalize(model.encoder(x), dim=1)
        acc = ((z @ centres.T).argmax(1) == y).float().mean().item()
    model.train()
    return acc


def train_simsiam(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """SimSiam's main loop: `D(p1, z2) / 2 + D(p2, z1) / 2` with `D` the negative
    cosine against a stop-gradient target; SGD lr 0.05 x batch / 256 (0.1 here),
    momentum 0.9, weight decay 1e-4, a cosine schedule, the predictor at a fixed lr."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7600 + seed)
    prototypes = torch.randn(4, 16, generator=g) * 1.5
    model = SimSiam()
    optimizer = torch.optim.SGD(
        [
            {"params": model.encoder.parameters(), "fix_lr": False},
            {"params": model.predictor.parameters(), "fix_lr": True},
        ],
        lr=0.1,
        momentum=0.9,
        weight_decay=1e-4,
    )
    run = watch(run_id, model, optimizer)
    losses = []
    for step in range(steps):
        lr = 0.1 * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in optimizer.param_groups:
            group["lr"] = 0.1 if group["fix_lr"] else lr
        x1, x2, _ = views(128, g, prototypes)
        z1, z2 = model.encoder(x1), model.encoder(x2)
        p1, p2 = model.predictor(z1), model.predictor(z2)
        loss = (
            -(
                F.cosine_similarity(p1, z2.detach()).mean()
                + F.cosine_similarity(p2, z1.detach()).mean()
            )
            / 2
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        losses.append(loss.item())
    run.close()
    return Outcome(
        {"model": run},
        {
            "after": probe_accuracy(model, g, prototypes),
            "first": mean(losses[:5]),
            "last": mean(losses[-30:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_simsiam_loss_is_negative(gradflow_server, gradflow_env, seed):
    """https://github.com/facebookresearch/simsiam/issues/21"""
    outcome = train_simsiam(gradflow_env, seed)

    # The loss fell to near -1 without a collapse: the representation still separates
    # the classes.
    facts = outcome.facts
    assert facts["last"] < -0.8 and facts["first"] > facts["last"] + 0.2, facts
    assert facts["after"] > 0.9, facts

    # The correct verdict: a healthy run.
    assert_silent(gradflow_server, outcome)


# -- roggirg/AutoBots#7: a Gaussian NLL below 0, trained by Lightning ----------------


def train_forecaster(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """Trajectory forecasting with a bivariate Gaussian NLL per future step, as
    AutoBots' loss, as a `LightningModule` trained by `lightning.Trainer`
    (`max_steps=300`, `gradient_clip_val=5`, bf16-mixed autocast on the CPU, Adam lr
    3e-3 with a step decay), watched by gradflow's Lightning callback."""
    import lightning

    from gradflow.integrations.lightning import GradflowCallback

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7700 + seed)

    def tracks(size: int):
        v = torch.randn(size, 2, generator=g) * 0.2
        t = torch.arange(12, dtype=torch.float32).view(1, 12, 1)
        path = v.unsqueeze(1) * t + 0.02 * torch.randn(size, 12, 2, generator=g)
        return path[:, :6].flatten(1), path[:, 6:]

    class Forecaster(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 24)
            )

        def nll(self, past, future):
            out = self.net(past).float().view(-1, 6, 4)
            mu, log_sigma = out[..., :2], out[..., 2:].clamp(-6, 3)
            return (
                (
                    log_sigma
                    + 0.5 * ((future - mu) / log_sigma.exp()) ** 2
                    + 0.5 * math.log(2 * math.pi)
                )
                .sum(-1)
                .mean()
            )

        def training_step(self, batch, _):
            return self.nll(*batch)

        def configure_optimizers(self):
            optimizer = torch.optim.Adam(self.parameters(), lr=3e-3)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)]

    past, future = tracks(300 * 32)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(past, future), batch_size=32
    )
    model = Forecaster()
    held_past, held_future = tracks(512)
    with torch.no_grad():
        before = model.nll(held_past, held_future).item()
    if dry():
        warnings.simplefilter("ignore")
    callback = GradflowCallback(run_id=run_id, **({"on_alert": None} if dry() else {}))
    trainer = lightning.Trainer(
        max_steps=steps,
        gradient_clip_val=5.0,
        precision="bf16-mixed",
        accelerator="cpu",
        devices=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    with torch.no_grad():
        after = model.nll(held_past, held_future).item()
    return Outcome(
        {"model": Run(run_id, steps=trainer.global_step)}, {"before": before, "after": after}
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_forecaster_gaussian_nll_goes_negative(gradflow_server, gradflow_env, seed):
    """https://github.com/roggirg/AutoBots/issues/7"""
    outcome = train_forecaster(gradflow_env, seed)

    # 300 optimizer steps; the held-out NLL went from positive to well below 0.
    facts = outcome.facts
    assert outcome.runs["model"].steps == 300
    assert facts["after"] < 0 < facts["before"], facts

    # The correct verdict: a healthy run.
    assert_silent(gradflow_server, outcome)
