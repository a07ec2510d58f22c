"""Generative models (the fourth set): CADA-VAE's two aligned VAEs, whose loss climbs
fast once the cross-reconstruction and distribution-alignment terms are switched on
by their warm-up schedules; a multi-modal VAE whose shared VAE's optimizer holds its
encoder alone; and an energy-disaggregation VAE whose decoder calls its first
deconvolution at every stage.
"""

from __future__ import annotations

from typing import Tuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, assert_silent, mean, snapshot, watch

pytestmark = pytest.mark.validation

CLASSES, FEATURES, ATTRIBUTES, LATENT = 6, 32, 8, 4


class VAE(nn.Module):
    """One of CADA-VAE's modality VAEs: an MLP encoder to a mean and a log-variance,
    an MLP decoder."""

    def __init__(self, dim: int, hidden: int = 64) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU())
        self.mu = nn.Linear(hidden, LATENT)
        self.logvar = nn.Linear(hidden, LATENT)
        self.decoder = nn.Sequential(nn.Linear(LATENT, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def encode(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        h = self.encoder(x)
        return self.mu(h), self.logvar(h)


def ramp(step: int, start: int, end: int, top: float) -> float:
    """CADA-VAE's warm-up: 0 before `start`, rising linearly to `top` at `end`."""
    return top * min(max((step - start) / (end - start), 0.0), 1.0)


def train_cada_vae(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """CADA-VAE's `vaemodel.py` in small: an image-feature VAE and an attribute VAE
    trained by one Adam (lr 1.5e-4 scaled to 3e-3 for the tiny nets, amsgrad) on
    L1 reconstruction, a KL term (beta 0 to 0.25 over the run), a cross-reconstruction
    term (each decoder from the other modality's latent; delta 0 to 1 between steps
    60 and 100) and a distribution alignment term (the 2-Wasserstein distance of the
    two latents; gamma 0 to 1 between steps 100 and 200), each summed over the batch
    of 50 as the repository does."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(5000 + seed)
    class_attributes = torch.rand(CLASSES, ATTRIBUTES, generator=g)
    mixing = torch.randn(ATTRIBUTES, FEATURES, generator=g)
    model = nn.ModuleDict({"image": VAE(FEATURES), "attribute": VAE(ATTRIBUTES)})
    optimizer = torch.optim.Adam(model.parameters(), lr=0.003, amsgrad=True)
    run = watch(run_id, model, optimizer)

    def batch(size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, CLASSES, (size,), generator=g)
        a = class_attributes[labels]
        x = torch.relu(a @ mixing) + 0.1 * torch.randn(size, FEATURES, generator=g)
        return x, a

    def cross_error() -> float:
        x, a = batch(500)
        with torch.no_grad():
            mu_a, _ = model["attribute"].encode(a)
            return F.l1_loss(model["image"].decoder(mu_a), x).item()

    losses, cross_at_switch = [], 0.0
    for step in range(steps):
        x, a = batch(50)
        mu_x, logvar_x = model["image"].encode(x)
        mu_a, logvar_a = model["attribute"].encode(a)
        z_x = mu_x + torch.randn_like(mu_x) * torch.exp(0.5 * logvar_x)
        z_a = mu_a + torch.randn_like(mu_a) * torch.exp(0.5 * logvar_a)
        reconstruction = F.l1_loss(model["image"].decoder(z_x), x, reduction="sum") + F.l1_loss(
            model["attribute"].decoder(z_a), a, reduction="sum"
        )
        cross = F.l1_loss(model["image"].decoder(z_a), x, reduction="sum") + F.l1_loss(
            model["attribute"].decoder(z_x), a, reduction="sum"
        )
        kl = -0.5 * torch.sum(1 + logvar_x - mu_x**2 - logvar_x.exp()) - 0.5 * torch.sum(
            1 + logvar_a - mu_a**2 - logvar_a.exp()
        )
        wasserstein = torch.sqrt(
            ((mu_x - mu_a) ** 2).sum(1)
            + ((torch.exp(0.5 * logvar_x) - torch.exp(0.5 * logvar_a)) ** 2).sum(1)
        ).sum()
        loss = (
            reconstruction
            + ramp(step, 0, steps, 0.25) * kl
            + ramp(step, 60, 100, 1.0) * cross
            + ramp(step, 100, 200, 1.0) * wasserstein
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        losses.append(loss.item())
        if step == 60:
            cross_at_switch = cross_error()
    run.close()
    return Outcome(
        {"model": run},
        {
            "loss_before": mean(losses[50:60]),
            "loss_peak": max(mean(losses[i : i + 10]) for i in range(60, steps, 10)),
            "cross_at_switch": cross_at_switch,
            "cross_end": cross_error(),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_cada_vae_loss_climbs_when_alignment_terms_switch_on(gradflow_server, gradflow_env, seed):
    """https://github.com/sbharadwajj/Generalized-Zero-Shot-Learning-via-Aligned-Variational-Autoencoders/issues/1"""
    outcome = train_cada_vae(gradflow_env, seed)

    # The loss climbs well above where it stood before the switch, and the aligned latents
    # learned what they are for: an image feature decoded from its class's
    # attributes is far closer to the real one than when the term switched on.
    facts = outcome.facts
    assert facts["loss_peak"] > 1.2 * facts["loss_before"], facts
    assert facts["cross_end"] < 0.7 * facts["cross_at_switch"], facts

    # The correct verdict: a healthy run whose objective grows by design.
    assert_silent(gradflow_server, outcome)


# -- zdebruine/MMVAE#39: the shared VAE's optimizer holds its encoder alone ----------

GENES = {"human": 40, "mouse": 30}


class SharedVAE(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2 * LATENT)
        )
        self.decoder = nn.Sequential(nn.Linear(LATENT, width), nn.ReLU(), nn.Linear(width, width))


class MultiModalVAE(nn.Module):
    """MMVAE's shape in small: an expert encoder and decoder per species around one
    shared VAE."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.experts = nn.ModuleDict(
            {
                species: nn.ModuleDict(
                    {
                        "encoder": nn.Sequential(nn.Linear(genes, width), nn.ReLU()),
                        "decoder": nn.Linear(width, genes),
                    }
                )
                for species, genes in GENES.items()
            }
        )
        self.shared = SharedVAE(width)

    def forward(self, x: torch.Tensor, species: str) -> Tuple[torch.Tensor, torch.Tensor]:
        expert = self.experts[species]
        mu, logvar = self.shared.encoder(expert["encoder"](x)).chunk(2, dim=1)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        kl = -0.5 * torch.mean(torch.sum(1 + logvar - mu**2 - logvar.exp(), dim=1))
        return expert["decoder"](self.shared.decoder(z)), kl


def cell_batch(species: str, size: int, g: torch.Generator, programs: dict) -> torch.Tensor:
    """Expression profiles: a mix of 3 gene programs of the species, with noise."""
    weights = torch.rand(size, 3, generator=g)
    return weights @ programs[species] + 0.05 * torch.randn(size, GENES[species], generator=g)


def train_mmvae(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """MMVAE's trainer as the issue reads it: one optimizer for the experts and one
    for the shared VAE, built from `shared.encoder.parameters()` alone (Adam 1e-3
    each); the species alternate by batch (64 cells), MSE reconstruction plus a KL
    term (weight 0.1); both optimizers' `zero_grad` and `step` on every batch."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(5500 + seed)
    programs = {s: torch.rand(3, n, generator=g) for s, n in GENES.items()}
    model = MultiModalVAE()
    expert_optimizer = torch.optim.Adam(model.experts.parameters(), lr=1e-3)
    shared_optimizer = torch.optim.Adam(model.shared.encoder.parameters(), lr=1e-3)
    runs = {
        "experts": watch(f"{run_id}-experts", model.experts, expert_optimizer),
        "shared": watch(f"{run_id}-shared", model.shared, shared_optimizer),
    }
    before = snapshot(model.shared)
    losses = []
    for step in range(steps):
        species = "human" if step % 2 == 0 else "mouse"
        x = cell_batch(species, 64, g, programs)
        reconstruction, kl = model(x, species)
        loss = F.mse_loss(reconstruction, x) + 0.1 * kl
        expert_optimizer.zero_grad()
        shared_optimizer.zero_grad()
        loss.backward()
        expert_optimizer.step()
        shared_optimizer.step()
        runs["experts"].step(loss)
        runs["shared"].step(loss)
        losses.append(loss.item())
    for run in runs.values():
        run.close()
    now = dict(model.shared.named_parameters())
    return Outcome(
        runs,
        {
            "decoder_moved": any(
                not torch.equal(now[n].detach(), before[n])
                for n in before
                if n.startswith("decoder")
            ),
            "encoder_moved": any(
                not torch.equal(now[n].detach(), before[n])
                for n in before
                if n.startswith("encoder")
            ),
            "decoder_grad": model.shared.decoder[0].weight.grad is not None,
            "loss_first": mean(losses[:20]),
            "loss_last": mean(losses[-20:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_mmvae_shared_decoder_left_out_of_its_optimizer(gradflow_server, gradflow_env, seed):
    """https://github.com/zdebruine/MMVAE/issues/39"""
    outcome = train_mmvae(gradflow_env, seed)

    # The shared decoder gets gradients and never changes; the shared encoder and the
    # experts train (the loss falls around the frozen decoder). No optimizer zeroes
    # the decoder's gradients either: they pile up, a consequence of the same cause.
    facts = outcome.facts
    assert facts["decoder_grad"] and not facts["decoder_moved"], facts
    assert facts["encoder_moved"], facts
    assert facts["loss_last"] < facts["loss_first"], facts

    # The correct verdict: on the shared VAE's run, trainable parameters outside its
    # optimizer, the decoder's (PROTOCOL: param_not_in_optimizer, cause
    # not_in_optimizer).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="shared",
            kind="param_not_in_optimizer",
            causes=("not_in_optimizer",),
            covers=("decoder",),
        ),
    )


# -- Virtsionis/torch-nilm#13: the VAE's decoder calls deconv1 at every stage --------

WINDOW = 32


def nilm_batch(size: int, g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """Aggregate power windows and the target appliance's share: the appliance runs
    in on/off blocks, the rest of the house adds a smooth base load and noise."""
    on = (torch.rand(size, 1, generator=g) < 0.5).float()
    start = torch.randint(0, WINDOW // 2, (size, 1), generator=g)
    t = torch.arange(WINDOW)[None, :]
    appliance = on * ((t >= start) & (t < start + WINDOW // 3)).float()
    base = 0.5 + 0.3 * torch.sin(t / 5 + torch.rand(size, 1, generator=g) * 6)
    aggregate = appliance + base + 0.05 * torch.randn(size, WINDOW, generator=g)
    return aggregate[:, None], appliance[:, None]


class NilmVAE(nn.Module):
    """torch-nilm's `VAE` in small as the issue found it: a convolutional encoder to
    a Gaussian latent, and a decoder with three transposed convolutions of the same
    shape, of which `forward` calls `self.deconv1` three times."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv1d(1, channels, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool1d(2),
            nn.Conv1d(channels, channels, 5, padding=2),
            nn.ReLU(),
        )
        self.mu = nn.Conv1d(channels, channels, 1)
        self.logvar = nn.Conv1d(channels, channels, 1)
        self.deconv1 = nn.ConvTranspose1d(channels, channels, 3, padding=1)
        self.deconv2 = nn.ConvTranspose1d(channels, channels, 3, padding=1)
        self.deconv3 = nn.ConvTranspose1d(channels, channels, 3, padding=1)
        self.upsample = nn.Upsample(scale_factor=2)
        self.output = nn.Conv1d(channels, 1, 1)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        h = self.encoder(x)
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        d = F.relu(self.deconv1(z))
        d = F.relu(self.deconv1(d))  # the repository's deconv2 stage
        d = F.relu(self.deconv1(self.upsample(d)))  # the repository's deconv3 stage
        kl = -0.5 * torch.mean(torch.sum(1 + logvar - mu**2 - logvar.exp(), dim=(1, 2)))
        return self.output(d), kl


def train_nilm_vae(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """torch-nilm's VAE training in small: MSE on the appliance's power plus the KL
    term (weight 1e-3), Adam 1e-3, batch 32 windows."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(5600 + seed)
    model = NilmVAE()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    run = watch(run_id, model, optimizer)
    before = snapshot(model)
    losses = []
    for _ in range(steps):
        aggregate, appliance = nilm_batch(32, g)
        prediction, kl = model(aggregate)
        loss = F.mse_loss(prediction, appliance) + 1e-3 * kl
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        losses.append(loss.item())
    run.close()
    now = dict(model.named_parameters())
    moved = {n for n in before if not torch.equal(now[n].detach(), before[n])}
    return Outcome(
        {"model": run},
        {
            "moved": moved,
            "unused_grads": [model.deconv2.weight.grad, model.deconv3.weight.grad],
            "loss_first": mean(losses[:20]),
            "loss_last": mean(losses[-20:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_nilm_vae_decoder_reuses_its_first_deconvolution(gradflow_server, gradflow_env, seed):
    """https://github.com/Virtsionis/torch-nilm/issues/13"""
    outcome = train_nilm_vae(gradflow_env, seed)

    # deconv2 and deconv3 never take part: no gradient, no change; everything else
    # trains and the loss falls.
    facts = outcome.facts
    assert facts["unused_grads"] == [None, None], facts
    assert not any(n.startswith(("deconv2", "deconv3")) for n in facts["moved"]), facts
    assert "deconv1.weight" in facts["moved"] and "encoder.0.weight" in facts["moved"], facts
    assert facts["loss_last"] < 0.8 * facts["loss_first"], facts

    # The correct verdict: two modules with trainable parameters that backward never
    # reaches (PROTOCOL: grad_stuck_zero, cause backward_not_reached or grad_missing).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="grad_stuck_zero",
            causes=("backward_not_reached", "grad_missing"),
            covers=("deconv2", "deconv3"),
        ),
    )
