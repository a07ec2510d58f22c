"""Healthy look-alikes of the seventh set: an offline actor whose Q loss climbs, a
Gaussian VAE whose NLL goes negative, a score model that
trains in eval mode without harm, a frozen message decoder held by the optimizer, and a
Lightning classifier whose training loss stays above its validation loss."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Outcome, Run, assert_silent, dry, mean, moved, snapshot, watch

pytestmark = pytest.mark.validation


# -- seohongpark/fql#10: the actor's q_loss keeps increasing -----------------------------


def train_offline_actor_critic(run_id: str, seed: int, updates: int = 300) -> Outcome:
    """Offline actor-critic as FQL's one-step policy: a critic fitted by TD (discount
    0.99, a Polyak target), an actor trained on `q_loss = -Q(s, pi(s)).mean()` plus a
    behaviour-cloning term (alpha 10); an Adam 3e-4 each. The reward is minus the
    squared distance to the origin, so Q falls as the critic learns and `q_loss`
    climbs."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(8100 + seed)
    s = torch.rand(4096, 1, generator=g) * 2 - 1
    a = (-s + 0.5 * torch.randn(4096, 1, generator=g)).clamp(-1, 1)
    s2 = (s + 0.2 * a).clamp(-1.5, 1.5)
    r = -(s2**2).squeeze(-1)
    actor = nn.Sequential(nn.Linear(1, 64), nn.ReLU(), nn.Linear(64, 1), nn.Tanh())
    critic = nn.Sequential(
        nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    target = copy.deepcopy(critic).requires_grad_(False)
    opt_actor = torch.optim.Adam(actor.parameters(), lr=3e-4)
    opt_critic = torch.optim.Adam(critic.parameters(), lr=3e-4)
    runs = {
        "actor": watch(f"{run_id}-actor", actor, opt_actor),
        "critic": watch(f"{run_id}-critic", critic, opt_critic),
    }

    def rollout() -> float:
        x, total = torch.linspace(-1, 1, 16).unsqueeze(-1), 0.0
        with torch.no_grad():
            for _ in range(20):
                x = (x + 0.2 * actor(x)).clamp(-1.5, 1.5)
                total += -(x**2).mean().item()
        return total

    before = rollout()
    q_losses = []
    for _ in range(updates):
        i = torch.randint(0, 4096, (256,), generator=g)
        with torch.no_grad():
            y = r[i] + 0.99 * target(torch.cat([s2[i], actor(s2[i])], -1)).squeeze(-1)
        critic_loss = F.mse_loss(critic(torch.cat([s[i], a[i]], -1)).squeeze(-1), y)
        opt_critic.zero_grad()
        critic_loss.backward()
        opt_critic.step()
        runs["critic"].step(critic_loss)
        with torch.no_grad():
            for p, t in zip(critic.parameters(), target.parameters()):
                t.mul_(0.995).add_(0.005 * p)
        pi = actor(s[i])
        q_loss = -critic(torch.cat([s[i], pi], -1)).mean()
        actor_loss = q_loss + 10 * F.mse_loss(pi, a[i])
        opt_actor.zero_grad()
        actor_loss.backward()
        opt_actor.step()
        runs["actor"].step(actor_loss)
        q_losses.append(q_loss.item())
    for run in runs.values():
        run.close()
    return Outcome(
        runs,
        {
            "q_first": mean(q_losses[:20]),
            "q_last": mean(q_losses[-20:]),
            "before": before,
            "after": rollout(),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_offline_actor_q_loss_keeps_increasing(gradflow_server, gradflow_env, seed):
    """https://github.com/seohongpark/fql/issues/10"""
    outcome = train_offline_actor_critic(gradflow_env, seed)

    # q_loss climbs while the policy's return improves.
    facts = outcome.facts
    assert facts["q_last"] > facts["q_first"] + 0.2, facts
    assert facts["after"] > facts["before"], facts

    assert_silent(gradflow_server, outcome)


# -- chainer/chainer#5440: a Gaussian VAE's NLL goes negative ----------------------------


def train_gaussian_vae(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """A VAE with a Gaussian decoder that learns its log-variance; the loss is the
    Gaussian NLL plus the KL (Adam 3e-3). Densities above 1 make the NLL negative."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(8300 + seed)
    basis = torch.randn(2, 8, generator=g)
    model = nn.ModuleDict(
        {
            "enc": nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4)),
            "dec": nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 16)),
        }
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    run = watch(run_id, model, optimizer)
    losses = []
    for _ in range(steps):
        x = torch.randn(128, 2, generator=g) @ basis + 0.02 * torch.randn(128, 8, generator=g)
        mu, ln_var = model["enc"](x).chunk(2, -1)
        z = mu + (0.5 * ln_var).exp() * torch.randn_like(mu)
        mean_x, ln_var_x = model["dec"](z).chunk(2, -1)
        nll = 0.5 * (ln_var_x + (x - mean_x) ** 2 / ln_var_x.exp() + 1.8379).sum(-1).mean()
        kl = 0.5 * (mu**2 + ln_var.exp() - 1 - ln_var).sum(-1).mean()
        loss = nll + kl
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        losses.append(loss.item())
    run.close()
    return Outcome({"model": run}, {"first": mean(losses[:10]), "last": mean(losses[-20:])})


@pytest.mark.parametrize("seed", SEEDS)
def test_gaussian_vae_nll_goes_negative(gradflow_server, gradflow_env, seed):
    """https://github.com/chainer/chainer/issues/5440"""
    outcome = train_gaussian_vae(gradflow_env, seed)

    # The loss starts positive and ends below 0.
    facts = outcome.facts
    assert facts["first"] > 0 > facts["last"], facts

    assert_silent(gradflow_server, outcome)


# -- ermongroup/ncsn#2: the score model is in eval mode after the first validation -------


def train_ncsn(run_id: str, seed: int, steps: int = 400) -> Outcome:
    """Annealed denoising score matching on 2-d points (10 noise levels from 1 to
    0.01, loss weighted by sigma²), Adam 1e-3; the validation log after step 100
    calls `score.eval()` and nothing calls `train()` again. The model has neither
    dropout nor batch norm, as the maintainer notes."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(8400 + seed)
    sigmas = torch.logspace(0, -2, 10)
    score = nn.Sequential(
        nn.Linear(3, 128), nn.Softplus(), nn.Linear(128, 128), nn.Softplus(), nn.Linear(128, 2)
    )
    optimizer = torch.optim.Adam(score.parameters(), lr=1e-3)
    run = watch(run_id, score, optimizer)

    def dsm(n: int) -> torch.Tensor:
        angle = torch.rand(n, generator=g) * 6.283
        x = torch.stack([angle.cos(), angle.sin()], -1)
        k = torch.randint(0, 10, (n,), generator=g)
        s = sigmas[k].unsqueeze(-1)
        noisy = x + s * torch.randn(n, 2, generator=g)
        out = score(torch.cat([noisy, k.unsqueeze(-1).float() / 10], -1))
        return (0.5 * ((out * s + (noisy - x) / s) ** 2).sum(-1)).mean()

    with torch.no_grad():
        before = dsm(2000).item()
    in_eval = 0
    for step in range(steps):
        loss = dsm(128)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        in_eval += not score.training
        if step == 100:
            score.eval()
            with torch.no_grad():
                dsm(512)
    run.close()
    with torch.no_grad():
        after = dsm(2000).item()
    return Outcome({"model": run}, {"before": before, "after": after, "in_eval": in_eval})


@pytest.mark.parametrize("seed", SEEDS)
def test_ncsn_trains_in_eval_mode_without_harm(gradflow_server, gradflow_env, seed):
    """https://github.com/ermongroup/ncsn/issues/2"""
    outcome = train_ncsn(gradflow_env, seed)

    # Three quarters of the run in eval mode; the score-matching loss still falls.
    facts = outcome.facts
    assert facts["in_eval"] >= 290, facts
    assert facts["after"] < 0.95 * facts["before"], facts

    assert_silent(gradflow_server, outcome)


# -- Georgefwt/AquaLoRA#4: the frozen message decoder is held by the optimizer ----------


def train_watermark(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """A watermark fine-tune: a LoRA on a frozen image decoder learns to hide a 16-bit
    message that a frozen, pre-trained message decoder reads back (BCE, plus an MSE
    keeping the image close; AdamW 1e-2). The message decoder is `requires_grad_(False)` and yet
    in AdamW's parameter list, as in the thread."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(8500 + seed)
    base = nn.Linear(32, 64).requires_grad_(False)
    lora_a = nn.Linear(32 + 16, 16, bias=False)
    lora_b = nn.Linear(16, 64, bias=False)
    nn.init.zeros_(lora_b.weight)
    msgdecoder = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16)).requires_grad_(
        False
    )
    model = nn.ModuleDict(
        {"base": base, "lora_a": lora_a, "lora_b": lora_b, "msgdecoder": msgdecoder}
    )
    optimizer = torch.optim.AdamW(
        list(lora_a.parameters()) + list(lora_b.parameters()) + list(msgdecoder.parameters()),
        lr=1e-2,
    )
    run = watch(run_id, model, optimizer)
    frozen = snapshot(msgdecoder)

    def bit_accuracy(n: int) -> float:
        with torch.no_grad():
            latent = torch.randn(n, 32, generator=g)
            msg = torch.randint(0, 2, (n, 16), generator=g).float()
            image = base(latent) + lora_b(lora_a(torch.cat([latent, msg], -1)))
            return ((msgdecoder(image) > 0).float() == msg).float().mean().item()

    before = bit_accuracy(1000)
    for _ in range(steps):
        latent = torch.randn(64, 32, generator=g)
        msg = torch.randint(0, 2, (64, 16), generator=g).float()
        clean = base(latent)
        image = clean + lora_b(lora_a(torch.cat([latent, msg], -1)))
        loss = F.binary_cross_entropy_with_logits(msgdecoder(image), msg) + 0.01 * F.mse_loss(
            image, clean
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
    run.close()
    return Outcome(
        {"model": run},
        {"before": before, "after": bit_accuracy(1000), "decoder_moved": moved(frozen, msgdecoder)},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_aqualora_frozen_decoder_in_the_optimizer(gradflow_server, gradflow_env, seed):
    """https://github.com/Georgefwt/AquaLoRA/issues/4"""
    outcome = train_watermark(gradflow_env, seed)

    # The LoRA learns to hide the message; the frozen decoder never moves.
    facts = outcome.facts
    assert facts["before"] < 0.6 and facts["after"] > 0.9, facts
    assert not facts["decoder_moved"], facts

    assert_silent(gradflow_server, outcome)


# -- Bjarten/early-stopping-pytorch#18: validation loss below training loss --------------


def train_lightning_dropout(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """A classifier with dropout 0.5 as a `LightningModule` trained by
    `lightning.Trainer` (Adam 1e-3, `gradient_clip_val=0.5` with
    `gradient_clip_algorithm="value"`), watched by gradflow's Lightning callback. With
    dropout on in training and off in evaluation, the training loss stays above the
    loss on held-out data."""
    import lightning

    from gradflow.integrations.lightning import GradflowCallback

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(8600 + seed)
    centers = torch.randn(4, 16, generator=g) * 0.8

    def sample(n: int):
        y = torch.randint(0, 4, (n,), generator=g)
        return centers[y] + torch.randn(n, 16, generator=g), y

    losses = []

    class Classifier(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(16, 128),
                nn.ReLU(),
                nn.Dropout(0.5),
                nn.Linear(128, 128),
                nn.ReLU(),
                nn.Dropout(0.5),
                nn.Linear(128, 4),
            )

        def training_step(self, batch, _):
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    x, y = sample(steps * 32)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    model = Classifier()
    held_x, held_y = sample(2000)
    if dry():
        warnings.simplefilter("ignore")
    callback = GradflowCallback(run_id=run_id, **({"on_alert": None} if dry() else {}))
    trainer = lightning.Trainer(
        max_steps=steps,
        gradient_clip_val=0.5,
        gradient_clip_algorithm="value",
        accelerator="cpu",
        devices=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    model.eval()
    with torch.no_grad():
        out = model.net(held_x)
        held_loss = F.cross_entropy(out, held_y).item()
        acc = (out.argmax(-1) == held_y).float().mean().item()
    return Outcome(
        {"model": Run(run_id, steps=trainer.global_step)},
        {"train_last": mean(losses[-50:]), "held": held_loss, "accuracy": acc},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_lightning_validation_loss_below_training_loss(gradflow_server, gradflow_env, seed):
    """https://github.com/Bjarten/early-stopping-pytorch/issues/18"""
    outcome = train_lightning_dropout(gradflow_env, seed)

    # The held-out loss is below the training loss, and the classifier learned.
    facts = outcome.facts
    assert facts["held"] < facts["train_last"], facts
    assert facts["accuracy"] > 0.6, facts

    assert_silent(gradflow_server, outcome)
