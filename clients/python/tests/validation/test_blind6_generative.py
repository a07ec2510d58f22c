"""Generative cases of the sixth set: a distilled generator cast to bf16 whose updates
round away, a fine-tuning loop that clips the scaled gradients, a noise-prediction
model trained by Lightning with gradient accumulation, a lookup-free quantiser whose
entropy term drives the loss below 0, and a hinge-loss GAN whose generator loss goes
negative.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, Run, assert_caught, assert_silent, dry, mean, watch

pytestmark = pytest.mark.validation


def ring(size: int, g: torch.Generator, modes: int = 8) -> torch.Tensor:
    """Points on `modes` Gaussian blobs around the unit circle."""
    k = torch.randint(0, modes, (size,), generator=g).float()
    angle = 2 * math.pi * k / modes
    centres = torch.stack([torch.cos(angle), torch.sin(angle)], 1)
    return centres + 0.05 * torch.randn(size, 2, generator=g)


class Denoiser(nn.Module):
    """An MLP predicting the noise of a 2-d point from the noised point and its time;
    no normalisation layer."""

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


ALPHAS_BAR = torch.cumprod(1 - torch.linspace(1e-4, 0.05, 50), 0)


def noised(x0: torch.Tensor, g: torch.Generator):
    t = torch.randint(0, 50, (x0.shape[0],), generator=g)
    noise = torch.randn(x0.shape, generator=g)
    a = ALPHAS_BAR[t].unsqueeze(1)
    return a.sqrt() * x0 + (1 - a).sqrt() * noise, t / 50, noise


# -- tianweiy/CausVid#19: the generator cast to bf16 ----------------------------------


def train_bf16_generator(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The generator loaded with `.to(dtype=torch.bfloat16)` and trained with AdamW at a
    fine-tuning lr (2e-6) without fp32 master weights; an fp32 twin trains beside it on
    the same batches (not watched), to show what the steps should have done."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(8600 + seed)
    model = Denoiser()
    twin = Denoiser()
    twin.load_state_dict(model.state_dict())
    model = model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-6)
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=2e-6)
    run = watch(run_id, model, optimizer)
    start = [p.detach().clone() for p in model.parameters()]
    twin_start = [p.detach().clone() for p in twin.parameters()]
    for _ in range(steps):
        x, t, noise = noised(ring(128, g), g)
        loss = F.mse_loss(model(x.bfloat16(), t.bfloat16()).float(), noise)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        twin_loss = F.mse_loss(twin(x, t), noise)
        twin_optimizer.zero_grad()
        twin_loss.backward()
        twin_optimizer.step()
    run.close()

    def moved_share(params, starts) -> float:
        changed = sum(int((p.detach() != s).sum()) for p, s in zip(params, starts))
        return changed / sum(s.numel() for s in starts)

    return Outcome(
        {"model": run},
        {
            "bf16_moved": moved_share(list(model.parameters()), start),
            "fp32_moved": moved_share(list(twin.parameters()), twin_start),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_causvid_generator_cast_to_bf16(gradflow_server, gradflow_env, seed):
    """https://github.com/tianweiy/CausVid/issues/19"""
    outcome = train_bf16_generator(gradflow_env, seed)

    # Under 2 % of the bf16 weights ever changed; every fp32 weight did.
    facts = outcome.facts
    assert facts["bf16_moved"] < 0.02, facts
    assert facts["fp32_moved"] > 0.99, facts

    # The correct verdict: the updates are rounded away in bf16.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="update_rounded_away", causes=("low_precision_underflow",)),
    )


# -- victorchall/EveryDream2trainer#175: the clip reads the scaled gradients ----------


def train_everydream(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The trainer's AMP loop: fp16 autocast (on the CPU here) with a GradScaler,
    `scaler.scale(loss).backward()`, then `clip_grad_norm_(unet.parameters(),
    clip_grad_scale)` with the usual 1.0 and no `scaler.unscale_`, then
    `scaler.step(optimizer)`; AdamW lr 1e-3."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(8700 + seed)
    model = Denoiser()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    run = watch(run_id, model, optimizer, scaler=scaler)
    cut = []
    for _ in range(steps):
        x, t, noise = noised(ring(128, g), g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x, t).float(), noise)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaled_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        # A gradient whose true norm was under the bound, cut all the same.
        cut.append(float(scaled_norm) > 1.0 and float(scaled_norm) / scale < 1.0)
        scaler.step(optimizer)
        scaler.update()
        run.step(loss)
    run.close()
    return Outcome(
        {"model": run},
        {"clipped_share": mean([float(c) for c in cut]), "scale": scaler.get_scale()},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_everydream_clips_the_scaled_gradients(gradflow_server, gradflow_env, seed):
    """https://github.com/victorchall/EveryDream2trainer/pull/175"""
    outcome = train_everydream(gradflow_env, seed)

    # On most steps the clip cut a gradient whose true norm was under its bound (the
    # scaled norm is far above 1 while the scale is in the thousands or more).
    facts = outcome.facts
    assert facts["clipped_share"] > 0.8, facts
    assert facts["scale"] >= 1024, facts

    # The correct verdict: the clip ran before the unscale.
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


# -- cvlab-columbia/zero123#49: a noisy step loss under Lightning with accumulation -----


def train_lightning_diffusion(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """A noise-prediction `LightningModule` trained by `lightning.Trainer` with
    `accumulate_grad_batches=2` (the thread's setting), AdamW lr 1e-3, watched by
    gradflow's Lightning callback."""
    import lightning

    from gradflow.integrations.lightning import GradflowCallback

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(8800 + seed)

    class NoisePredictor(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.denoiser = Denoiser()

        def training_step(self, batch, _):
            x, t, noise = batch
            return F.mse_loss(self.denoiser(x, t), noise)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    x, t, noise = noised(ring(2 * steps * 32, g), g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, t, noise), batch_size=32)
    model = NoisePredictor()
    held = noised(ring(2048, g), g)
    with torch.no_grad():
        before = F.mse_loss(model.denoiser(held[0], held[1]), held[2]).item()
        batch_losses = [
            F.mse_loss(model.denoiser(x[i : i + 32], t[i : i + 32]), noise[i : i + 32]).item()
            for i in range(0, 32 * 40, 32)
        ]
    if dry():
        warnings.simplefilter("ignore")
    callback = GradflowCallback(run_id=run_id, **({"on_alert": None} if dry() else {}))
    trainer = lightning.Trainer(
        max_steps=steps,
        accumulate_grad_batches=2,
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
        after = F.mse_loss(model.denoiser(held[0], held[1]), held[2]).item()
        late = [
            F.mse_loss(model.denoiser(x[i : i + 32], t[i : i + 32]), noise[i : i + 32]).item()
            for i in range(0, 32 * 40, 32)
        ]
    spread = (max(late) - min(late)) / mean(late)
    return Outcome(
        {"model": Run(run_id, steps=trainer.global_step)},
        {"before": before, "after": after, "spread": spread, "first_spread": batch_losses},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_lightning_accumulated_diffusion_loss_is_noisy(gradflow_server, gradflow_env, seed):
    """https://github.com/cvlab-columbia/zero123/issues/49"""
    outcome = train_lightning_diffusion(gradflow_env, seed)

    # 300 optimizer steps of 2 batches; the held-out loss fell, while one batch's loss
    # differs from another's by more than half their mean.
    facts = outcome.facts
    assert outcome.runs["model"].steps == 300
    assert facts["after"] < 0.8 * facts["before"], facts
    assert facts["spread"] > 0.5, facts

    # The correct verdict: a healthy run.
    assert_silent(gradflow_server, outcome)


# -- markweberdev/maskbit#2: the entropy term makes the loss negative -----------------


class LFQAutoencoder(nn.Module):
    """An encoder to 8 binary latents (lookup-free quantisation: the sign, with a
    straight-through gradient) and a decoder."""

    def __init__(self, dim: int = 16, bits: int = 8) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, bits))
        self.decoder = nn.Sequential(nn.Linear(bits, 64), nn.ReLU(), nn.Linear(64, dim))

    def forward(self, x: torch.Tensor):
        z = self.encoder(x)
        q = z + (torch.sign(z) - z).detach()
        p = torch.sigmoid(4 * z)

        def h(prob: torch.Tensor) -> torch.Tensor:
            prob = prob.clamp(1e-6, 1 - 1e-6)
            return -(prob * prob.log() + (1 - prob) * (1 - prob).log())

        sample_entropy = h(p).mean()
        codebook_entropy = h(p.mean(0)).mean()
        return self.decoder(q), sample_entropy, codebook_entropy


def train_lfq(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """MaskBit's tokenizer loss: reconstruction plus 0.1 x (per-sample entropy -
    codebook entropy), the second subtracted because it is maximised; Adam lr 5e-3."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(8900 + seed)
    prototypes = 0.5 * torch.randn(16, 16, generator=g)

    def batch(size: int) -> torch.Tensor:
        k = torch.randint(0, 16, (size,), generator=g)
        return prototypes[k] + 0.05 * torch.randn(size, 16, generator=g)

    model = LFQAutoencoder()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    run = watch(run_id, model, optimizer)
    held = batch(1024)
    with torch.no_grad():
        before = F.mse_loss(model(held)[0], held).item()
    losses, entropy_losses = [], []
    for _ in range(steps):
        x = batch(128)
        recon, sample_entropy, codebook_entropy = model(x)
        entropy_loss = 0.1 * (sample_entropy - codebook_entropy)
        loss = F.mse_loss(recon, x) + entropy_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        losses.append(loss.item())
        entropy_losses.append(entropy_loss.item())
    run.close()
    with torch.no_grad():
        after = F.mse_loss(model(held)[0], held).item()
    return Outcome(
        {"model": run},
        {
            "before": before,
            "after": after,
            "last_loss": mean(losses[-30:]),
            "negative_entropy_share": mean([float(v < 0) for v in entropy_losses]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_lfq_tokenizer_loss_goes_negative(gradflow_server, gradflow_env, seed):
    """https://github.com/markweberdev/maskbit/issues/2"""
    outcome = train_lfq(gradflow_env, seed)

    # The entropy loss is negative throughout and pulls the total below 0; the
    # reconstruction error fell by more than half.
    facts = outcome.facts
    assert facts["negative_entropy_share"] > 0.9, facts
    assert facts["last_loss"] < 0, facts
    assert facts["after"] < 0.5 * facts["before"], facts

    # The correct verdict: a healthy run.
    assert_silent(gradflow_server, outcome)


# -- lyndonzheng/Pluralistic-Inpainting#5: the generator's hinge loss is negative -------


def mmd(a: torch.Tensor, b: torch.Tensor) -> float:
    def k(x, y):
        return torch.exp(-(torch.cdist(x, y) ** 2) / 0.1).mean()

    return (k(a, a) + k(b, b) - 2 * k(a, b)).item()


def train_hinge_gan(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The SAGAN hinge loss the thread's model uses: D minimises `relu(1 - D(real)) +
    relu(1 + D(fake))`, G minimises `-D(G(z))`, which is negative whenever D scores the
    fakes above 0; two time-scale Adam (G 1e-3, D 4e-3, betas 0 and 0.9), MLPs on 2-d
    data."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9000 + seed)
    generator = nn.Sequential(
        nn.Linear(8, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 2)
    )
    discriminator = nn.Sequential(
        nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1)
    )
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3, betas=(0.0, 0.9))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=4e-3, betas=(0.0, 0.9))
    runs = {
        "generator": watch(f"{run_id}-generator", generator, opt_g),
        "discriminator": watch(f"{run_id}-discriminator", discriminator, opt_d),
    }
    held = ring(1024, g)
    with torch.no_grad():
        before = mmd(generator(torch.randn(1024, 8, generator=g)), held)
    g_losses = []
    for _ in range(steps):
        real = ring(128, g)
        fake = generator(torch.randn(128, 8, generator=g))
        d_loss = (
            F.relu(1 - discriminator(real)).mean() + F.relu(1 + discriminator(fake.detach())).mean()
        )
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        runs["discriminator"].step(d_loss)

        g_loss = -discriminator(generator(torch.randn(128, 8, generator=g))).mean()
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
        runs["generator"].step(g_loss)
        g_losses.append(g_loss.item())
    for run in runs.values():
        run.close()
    with torch.no_grad():
        after = mmd(generator(torch.randn(1024, 8, generator=g)), held)
    return Outcome(
        runs,
        {
            "before": before,
            "after": after,
            "negative_share": mean([float(v < 0) for v in g_losses]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_hinge_gan_generator_loss_goes_negative(gradflow_server, gradflow_env, seed):
    """https://github.com/lyndonzheng/Pluralistic-Inpainting/issues/5"""
    outcome = train_hinge_gan(gradflow_env, seed)

    # The generator's loss is negative on a twentieth of the steps or more; the samples
    # moved far towards the data.
    facts = outcome.facts
    assert facts["negative_share"] > 0.05, facts
    assert facts["after"] < 0.2 * facts["before"], facts

    # The correct verdict: a healthy run.
    assert_silent(gradflow_server, outcome)
