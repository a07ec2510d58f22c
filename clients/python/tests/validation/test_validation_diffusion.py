"""Diffusion (noise prediction): a text encoder frozen at step 0 by a
`stop_text_encoder_training` of 0 while the user asked for it to train, and a healthy
DDPM whose loss stops falling after a few epochs while its gradients are often clipped.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

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

SIDE = 8


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The sinusoidal timestep embedding of DDPM and Stable Diffusion."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([args.sin(), args.cos()], dim=1)


class ResBlock(nn.Module):
    """A UNet residual block: GroupNorm, SiLU, conv, plus the time (and, for the
    conditional model, text) embedding, GroupNorm, SiLU, dropout, conv."""

    def __init__(self, width: int, emb: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(4, width)
        self.conv1 = nn.Conv2d(width, width, 3, padding=1)
        self.emb = nn.Linear(emb, width)
        self.norm2 = nn.GroupNorm(4, width)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x))) + self.emb(emb)[:, :, None, None]
        return x + self.conv2(self.dropout(F.silu(self.norm2(h))))


class UNet(nn.Module):
    """A one-resolution UNet stand-in: conv in, two residual blocks fed the timestep
    embedding (plus a pooled text embedding when conditioned), conv out."""

    def __init__(self, channels: int, width: int = 16, text: int = 0, dropout: float = 0.0) -> None:
        super().__init__()
        self.time_embed = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.text_proj = nn.Linear(text, width) if text else None
        self.conv_in = nn.Conv2d(channels, width, 3, padding=1)
        self.blocks = nn.ModuleList(ResBlock(width, width, dropout) for _ in range(2))
        self.norm_out = nn.GroupNorm(4, width)
        self.conv_out = nn.Conv2d(width, channels, 3, padding=1)
        self.width = width

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, text: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        emb = self.time_embed(timestep_embedding(t, self.width))
        if self.text_proj is not None:
            emb = emb + self.text_proj(text)
        h = self.conv_in(x)
        for block in self.blocks:
            h = block(h, emb)
        return self.conv_out(F.silu(self.norm_out(h)))


def linear_alphas_cumprod(beta_1: float, beta_t: float, steps: int = 1000) -> torch.Tensor:
    return torch.cumprod(1 - torch.linspace(beta_1, beta_t, steps), dim=0)


def noised(
    x0: torch.Tensor, alphas_cumprod: torch.Tensor, g: torch.Generator
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A DDPM training sample: a random timestep, Gaussian noise, and x_t."""
    t = torch.randint(0, len(alphas_cumprod), (x0.shape[0],), generator=g)
    noise = torch.randn(x0.shape, generator=g)
    ab = alphas_cumprod[t].view(-1, 1, 1, 1)
    return ab.sqrt() * x0 + (1 - ab).sqrt() * noise, t, noise


# -- kohya: the text encoder stops training at step 0 ----------------------------------

VOCAB, TOKENS, LATENT = 32, 6, 4


class TextEncoder(nn.Module):
    """A CLIP-like text encoder, shrunk: token and position embeddings, one pre-norm
    MLP block, a final layer norm, mean pooling."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB, width)
        self.position_embedding = nn.Parameter(0.02 * torch.randn(TOKENS, width))
        self.layer_norm1 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.final_layer_norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.token_embedding(tokens) + self.position_embedding
        h = h + self.mlp(self.layer_norm1(h))
        return self.final_layer_norm(h).mean(1)


def captioned_latents(size: int, g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """Cached 4x8x8 latents of four subjects, and captions naming the subject (the
    instance token first, then class and filler words)."""
    subjects = torch.randint(0, 4, (size,), generator=g)
    basis = torch.Generator().manual_seed(900)
    looks = torch.randn(4, LATENT, SIDE, SIDE, generator=basis)
    latents = looks[subjects] + 0.3 * torch.randn(size, LATENT, SIDE, SIDE, generator=g)
    captions = torch.randint(4, VOCAB, (size, TOKENS), generator=g)
    captions[:, 0] = subjects
    return latents, captions


def train_dreambooth_text_encoder_stopped(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """kohya's DreamBooth loop with `--train_text_encoder` and the GUI's
    `stop_text_encoder_training = 0`: at `global_step == 0` it runs
    `text_encoder.train(False)` and `text_encoder.requires_grad_(False)`, so the text
    encoder, in the optimizer at its own lr, never trains. AdamW (U-Net lr 1e-4, text
    encoder lr 5e-5), a scaled-linear DDPM schedule of 1000 steps, MSE on the noise.

    The user watches both networks (a ModuleDict of the two, as the training script
    holds them) and, having asked for both to train, says so with `train=`, the README's
    option for the groups meant to train."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(910 + seed)
    unet = UNet(LATENT, text=16)
    text_encoder = TextEncoder()
    models = nn.ModuleDict({"unet": unet, "text_encoder": text_encoder})
    optimizer = torch.optim.AdamW(
        [
            {"params": unet.parameters(), "lr": 1e-4},
            {"params": text_encoder.parameters(), "lr": 5e-5},
        ]
    )
    # The scaled-linear schedule of Stable Diffusion: betas from 0.00085 to 0.012.
    alphas_cumprod = torch.cumprod(1 - torch.linspace(0.00085**0.5, 0.012**0.5, 1000) ** 2, 0)
    stop_text_encoder_training = 0
    text_before, unet_before = snapshot(text_encoder), snapshot(unet)
    run = watch(run_id, models, optimizer, train=["unet", "text_encoder"])
    for global_step in range(steps):
        if global_step == stop_text_encoder_training:
            text_encoder.train(False)
            text_encoder.requires_grad_(False)
        latents, captions = captioned_latents(8, g)
        x_t, t, noise = noised(latents, alphas_cumprod, g)
        noise_pred = unet(x_t, t, text_encoder(captions))
        loss = (
            F.mse_loss(noise_pred.float(), noise.float(), reduction="none").mean([1, 2, 3]).mean()
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.step(loss)
    run.close()
    return Outcome(
        {"models": run},
        {
            "text_encoder_moved": moved(text_before, text_encoder),
            "unet_moved": len(moved(unet_before, unet)),
            "unet_params": len(unet_before),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_dreambooth_text_encoder_stopped_at_step_zero(gradflow_server, gradflow_env, seed):
    """https://github.com/bmaltais/kohya_ss/issues/1882"""
    outcome = train_dreambooth_text_encoder_stopped(gradflow_env, seed)

    facts = outcome.facts
    # The text encoder, asked to train, never changed; the U-Net trained.
    assert facts["text_encoder_moved"] == set(), facts
    assert facts["unet_moved"] == facts["unet_params"], facts

    # The correct verdict: a group listed in `train` has nothing trainable from the step
    # that froze it (PROTOCOL: group_not_training, cause no_trainable_params, on the
    # text encoder).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="models",
            kind="group_not_training",
            causes=("no_trainable_params",),
            covers=("text_encoder",),
        ),
    )


# -- DDPM: the loss stops falling, the gradients are clipped ---------------------------


def digit_like_images(size: int, g: torch.Generator) -> torch.Tensor:
    """8x8 images in [-1, 1] of four stroke shapes, as the DDPM repository scales its
    CIFAR images."""
    images = -torch.ones(4, 1, SIDE, SIDE)
    images[0, 0, 3:5, :] = 1
    images[1, 0, :, 3:5] = 1
    images[2, 0] = torch.where(torch.eye(SIDE) > 0, 1.0, -1.0)
    images[3, 0, 1:7, 1:7] = 1
    return images[torch.randint(0, 4, (size,), generator=g)]


def warmup_cosine(epoch: int, epochs: int, multiplier: float = 2.0) -> float:
    """The repository's `GradualWarmupScheduler(multiplier=2, warm_epoch=epochs // 10,
    after_scheduler=CosineAnnealingLR(T_max=epochs))`, stepped once an epoch, as a
    factor of the base lr: up linearly to 2x over the warm-up, then the cosine from 2x."""
    warm = max(epochs // 10, 1)
    if epoch < warm:
        return 1.0 + (multiplier - 1.0) * epoch / warm
    return multiplier * 0.5 * (1 + math.cos(math.pi * (epoch - warm) / epochs))


def train_ddpm(run_id: str, seed: int, epochs: int = 10) -> Outcome:
    """The DDPM repository's training: AdamW lr 1e-4, weight decay 1e-4, the warm-up
    plus cosine schedule, `loss = trainer(x_0).sum() / 1000.` (the per-pixel MSE on the
    noise, summed), `clip_grad_norm_(..., 1.)`, dropout 0.15, betas 1e-4 to 0.02 over
    1000 steps. 10 epochs of 30 batches of 32."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(950 + seed)
    model = UNet(1, dropout=0.15)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: warmup_cosine(e, epochs))
    alphas_cumprod = linear_alphas_cumprod(1e-4, 0.02)

    held_out = noised(digit_like_images(256, g), alphas_cumprod, g)

    def held_out_loss() -> float:
        x_t, t, noise = held_out
        model.eval()
        with torch.no_grad():
            value = F.mse_loss(model(x_t, t), noise).item()
        model.train()
        return value

    before = held_out_loss()
    run = watch(run_id, model, optimizer)
    losses, clipped = [], 0
    for _ in range(epochs):
        for _ in range(30):
            optimizer.zero_grad()
            x_t, t, noise = noised(digit_like_images(32, g), alphas_cumprod, g)
            loss = F.mse_loss(model(x_t, t), noise, reduction="none").sum() / 1000.0
            loss.backward()
            clipped += nn.utils.clip_grad_norm_(model.parameters(), 1.0).item() > 1.0
            optimizer.step()
            run.step(loss)
            losses.append(loss.item())
        schedule.step()
    run.close()
    return Outcome(
        {"model": run},
        {
            "held_out_before": before,
            "held_out_after": held_out_loss(),
            "clipped_steps": clipped,
            "loss_middle": mean(losses[-180:-90]),
            "loss_last": mean(losses[-90:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_ddpm_loss_stops_falling(gradflow_server, gradflow_env, seed):
    """https://github.com/zoubohao/DenoisingDiffusionProbabilityModel-ddpm-/issues/45"""
    outcome = train_ddpm(gradflow_env, seed)

    facts = outcome.facts
    # Alarming, as in the thread: after the first epochs the training loss no longer
    # falls, and the clip cuts the gradient on many steps ...
    assert facts["loss_last"] > 0.8 * facts["loss_middle"], facts
    assert facts["clipped_steps"] > 50, facts
    # ... while the noise prediction on fixed held-out samples kept improving.
    assert facts["held_out_after"] < 0.5 * facts["held_out_before"], facts

    assert_silent(gradflow_server, outcome)
