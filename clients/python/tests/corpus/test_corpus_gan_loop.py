"""Corpus: the PyTorch DCGAN example's loop, watched one watch per model, must stay
silent. Its generator step's backward (errG through the discriminator) adds to the
discriminator's gradients after the discriminator's optimizer stepped; the next
iteration's netD.zero_grad() clears them before the discriminator's own backward
passes. Nothing reaches the discriminator's next step, so nothing was carried over
and no micro-batch was lost.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import torch
from conftest import new_run_id
from corpus_support import Progress, expects_silence, judge, one_thread, seeded
from torch import nn

import gradflow

# Three times loss_spike's window of 128 readings (the longest of the detectors).
STEPS = 400
NZ = 8


def generator() -> nn.Module:
    """The DCGAN generator, scaled down to 8×8 images: latent -> 4×4 -> 8×8."""
    return nn.Sequential(
        nn.ConvTranspose2d(NZ, 16, 4, 1, 0, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(True),
        nn.ConvTranspose2d(16, 1, 4, 2, 1, bias=False),
        nn.Tanh(),
    )


def discriminator() -> nn.Module:
    """The DCGAN discriminator, scaled down: 8×8 -> 4×4 -> a probability."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 4, 2, 1, bias=False),
        nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(16, 1, 4, 1, 0, bias=False),
        nn.Sigmoid(),
    )


def real_images(g: torch.Generator, batch: int = 16) -> torch.Tensor:
    """Dark 8×8 images with a bright horizontal bar at a random row, in [-1, 1]."""
    images = torch.full((batch, 1, 8, 8), -0.9)
    rows = torch.randint(1, 7, (batch,), generator=g)
    images[torch.arange(batch), 0, rows, :] = 0.9
    return images + 0.05 * torch.randn(images.shape, generator=g)


def bar_score(images: torch.Tensor) -> float:
    """How bar-like the images are: the brightest row's mean minus the image's mean
    (about 1.6 for the data, near 0 for noise)."""
    rows = images.mean(dim=3).squeeze(1)
    return float((rows.max(dim=1).values - images.mean(dim=(1, 2, 3))).mean())


@seeded
@expects_silence
def test_the_dcgan_example_loop_watched_per_model(request, gradflow_server, gradflow_env, seed):
    """The official DCGAN loop: netD.zero_grad(); errD_real.backward();
    errD_fake.backward() on fake.detach(); optimizerD.step(); netG.zero_grad();
    errG.backward(); optimizerG.step(); each model watched with its own optimizer,
    as the client's one-optimizer `watch` asks. errG's backward also adds gradients
    to the discriminator's parameters; netD.zero_grad() clears them first thing the
    next iteration.

    Threads: https://github.com/pytorch/examples/issues/116 (fake.detach() for the
    discriminator's step, errG through it for the generator's),
    https://github.com/yunjey/pytorch-tutorial/issues/56 ("we only train the
    discriminator using d_optimizer.step() and reset the grad buffer")
    """
    torch.manual_seed(seed)
    netG, netD = generator(), discriminator()
    optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    criterion = nn.BCELoss()
    g = torch.Generator().manual_seed(100 + seed)
    fixed_noise = torch.randn(64, NZ, 1, 1, generator=g)

    def sample() -> torch.Tensor:
        with torch.no_grad():
            netG.eval()
            images = netG(fixed_noise)
            netG.train()
            return images

    start = bar_score(sample())
    watched: List[Tuple[str, Any]] = []
    for name, (model, optimizer) in (("d", (netD, optimizerD)), ("g", (netG, optimizerG))):
        run_id = new_run_id(f"dcgan-{name}")
        watched.append((run_id, gradflow.watch(model, optimizer, run_id=run_id)))
    (d_run, gf_d), (g_run, gf_g) = watched
    # One torch thread, as the corpus' quickstart runs (corpus_support.one_thread).
    with one_thread():
        for _ in range(STEPS):
            real = real_images(g)
            batch = real.shape[0]
            netD.zero_grad()
            errD_real = criterion(netD(real).view(-1), torch.ones(batch))
            errD_real.backward()
            fake = netG(torch.randn(batch, NZ, 1, 1, generator=g))
            errD_fake = criterion(netD(fake.detach()).view(-1), torch.zeros(batch))
            errD_fake.backward()
            optimizerD.step()
            gf_d.step(loss=errD_real + errD_fake)
            netG.zero_grad()
            errG = criterion(netD(fake).view(-1), torch.ones(batch))
            errG.backward()
            optimizerG.step()
            gf_g.step(loss=errG)
        gf_d.close()
        gf_g.close()

    # Bars appear (from about 0.03 to 0.2-0.4).
    bars = Progress("bar score of the samples", start, bar_score(sample()), by=2.0, higher=True)
    # The discriminator's watcher saw what fooled the former rules: the generator's
    # backward found its gradients still there, and netD.zero_grad() reset them.
    carried = gradflow_server.series(d_run, "grads_carried_over")
    resets = gradflow_server.series(d_run, "metric", "grads_reset_between_backwards")
    # (From the second step: the first has no step before it.)
    assert len(carried) == STEPS - 1 and all(v == 1 for _, v in carried), carried[:5]
    assert len(resets) == STEPS - 1 and all(v == 1 for _, v in resets), resets[:5]
    for run_id in (d_run, g_run):
        judge(request, gradflow_server, run_id, steps=STEPS, progress=bars)
