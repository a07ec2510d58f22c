"""Corpus: failures of training beyond language models where the optimizer and the
model that learns part ways: a GAN whose discriminator is never stepped, a GAN whose
discriminator never zeroes its gradients, a Dreamer value model whose optimizer holds
another network's parameters, a char-RNN trained as a second instance while the
optimizer holds the first, and a regression whose loss broadcasts its target.

Each runs at three seeds for 150 steps: three times `grad_stuck_zero`'s 50-step
window, the longest of the detectors that could see these.
"""

from __future__ import annotations

from typing import Callable, Tuple

import pytest
import torch
from conftest import new_run_id
from corpus_loops import fit
from corpus_support import expects, judge, moved, snapshot
from torch import nn

import gradflow

SEEDS = [0, 1, 2]
STEPS = 150


# -- GANs: one watch per model, each with its own optimizer -------------------------


def gan(seed: int) -> Tuple[nn.Module, nn.Module, Callable[[int], torch.Tensor]]:
    """A 2-D GAN (MLP generator and discriminator, batch 16): the generator, the
    discriminator, and `real(n)` drawing data around (2, -1)."""
    torch.manual_seed(seed)
    generator = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
    discriminator = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    g = torch.Generator().manual_seed(100 + seed)

    def real(n: int) -> torch.Tensor:
        return torch.tensor([2.0, -1.0]) + 0.3 * torch.randn(n, 2, generator=g)

    return generator, discriminator, real


def train_gan(
    seed: int, *, step_discriminator: bool = True, zero_discriminator: bool = True
) -> Tuple[str, nn.Module, dict]:
    """The DCGAN example's loop (Adam 2e-4, β1 0.5, BCE), each model watched with its
    own optimizer; the bug is switched in by the flags. Returns the discriminator's
    run id, the discriminator and its weights before training."""
    generator, discriminator, real = gan(seed)
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    d_run, g_run = new_run_id("gan-d"), new_run_id("gan-g")
    gf_d = gradflow.watch(discriminator, opt_d, run_id=d_run)
    gf_g = gradflow.watch(generator, opt_g, run_id=g_run)
    before = snapshot(discriminator)
    for _ in range(STEPS):
        if zero_discriminator:
            opt_d.zero_grad()
        fake = generator(torch.randn(16, 4))
        loss_d = bce(discriminator(real(16)), torch.ones(16, 1)) + bce(
            discriminator(fake.detach()), torch.zeros(16, 1)
        )
        loss_d.backward()
        if step_discriminator:
            opt_d.step()
        gf_d.step(loss=loss_d)
        opt_g.zero_grad()
        loss_g = bce(discriminator(fake), torch.ones(16, 1))
        loss_g.backward()
        opt_g.step()
        gf_g.step(loss=loss_g)
    gf_d.close()
    gf_g.close()
    return d_run, discriminator, before


@expects("optimizer_not_stepped", "optimizer", "never_stepped")
@pytest.mark.parametrize("seed", SEEDS)
def test_a_discriminator_whose_optimizer_never_steps(request, gradflow_server, gradflow_env, seed):
    """The discriminator's loss is backpropagated but `optimizer_d.step()` is missing:
    it gets gradients at every iteration and never changes ("you do not include
    optimizer.step"; "just feel amazing the model could be trained well without
    updating").

    Thread: https://github.com/zhaoyuzhi/deepfillv2/issues/6
    """
    d_run, discriminator, before = train_gan(seed, step_discriminator=False)
    assert not moved(before, discriminator)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in discriminator.parameters())
    judge(request, gradflow_server, d_run)


@expects("grads_not_zeroed", "gradients", "not_zeroed")
@pytest.mark.parametrize("seed", SEEDS)
def test_a_discriminator_that_never_zeroes_its_gradients(
    request, gradflow_server, gradflow_env, seed
):
    """The discriminator's (the PATE student's) loss is backpropagated at every
    iteration with no `zero_grad()`: each step uses the sum of every gradient since
    the start ("Student loss has no zero_grad ... It's actually a bug").

    Thread: https://github.com/opendp/smartnoise-sdk/issues/280
    """
    d_run, discriminator, _ = train_gan(seed, zero_discriminator=False)
    # The gradient held at the end is the sum of all: far above one step's.
    held = sum(float(p.grad.norm()) for p in discriminator.parameters())
    discriminator.zero_grad()
    _, _, real = gan(seed)
    nn.BCEWithLogitsLoss()(discriminator(real(16)), torch.ones(16, 1)).backward()
    one = sum(float(p.grad.norm()) for p in discriminator.parameters())
    assert held > 10 * one, (held, one)
    judge(request, gradflow_server, d_run)


# -- an optimizer built over another network's parameters ----------------------------


@expects("nothing_trains", "run", "none_in_optimizer", also=["param_not_in_optimizer"])
@pytest.mark.parametrize("seed", SEEDS)
def test_a_value_model_whose_optimizer_holds_the_actor(
    request, gradflow_server, gradflow_env, seed
):
    """Dreamer's value optimizer built over the wrong module's parameters: the value
    model is trained on λ-returns, its optimizer steps the actor ("fix algo bug of
    value optimizer optimizing wrong params"). The value model never learns.

    Thread: https://github.com/juliusfrost/dreamer-pytorch/pull/79
    """
    torch.manual_seed(seed)
    actor = nn.Sequential(nn.Linear(8, 32), nn.ELU(), nn.Linear(32, 2))
    value = nn.Sequential(nn.Linear(8, 32), nn.ELU(), nn.Linear(32, 1))
    value_optimizer = torch.optim.Adam(actor.parameters(), lr=8e-5)
    g = torch.Generator().manual_seed(100 + seed)

    def value_loss() -> torch.Tensor:
        states = torch.randn(32, 8, generator=g)
        returns = states[:, :1] + 0.1 * torch.randn(32, 1, generator=g)
        return 0.5 * ((value(states) - returns) ** 2).mean()

    before = snapshot(value)
    run_id, _ = fit(value, value_optimizer, value_loss, STEPS)
    assert not moved(before, value)
    judge(request, gradflow_server, run_id)
    # Each module's own finding says the same: its parameters are not in the optimizer.


class CharRNN(nn.Module):
    """The char-RNN classification tutorial's RNN: input and hidden to hidden and
    output, one character at a time."""

    def __init__(self, letters: int = 16, hidden: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.i2h = nn.Linear(letters + hidden, hidden)
        self.i2o = nn.Linear(letters + hidden, classes)
        self.hidden = hidden

    def forward(self, line: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(line.shape[1], self.hidden)
        out = torch.zeros(line.shape[1], self.i2o.out_features)
        for char in line:
            both = torch.cat([char, h], 1)
            h, out = torch.tanh(self.i2h(both)), self.i2o(both)
        return out


@expects("nothing_trains", "run", "none_in_optimizer", also=["param_not_in_optimizer"])
@pytest.mark.parametrize("seed", SEEDS)
def test_a_char_rnn_built_twice_trains_the_copy_the_optimizer_lacks(
    request, gradflow_server, gradflow_env, seed
):
    """The model is instantiated twice: the optimizer (SGD, lr 0.005) is built over
    the first instance, the loop trains the second; "loss is big, and loss flow up
    and down, do not diminish" ("I have the model instantiated twice ... so the
    params aren't reset").

    Thread: https://github.com/spro/practical-pytorch/issues/9
    """
    torch.manual_seed(seed)
    rnn = CharRNN()
    optimizer = torch.optim.SGD(rnn.parameters(), lr=0.005)
    rnn = CharRNN()  # the second instantiation, further down the notebook
    g = torch.Generator().manual_seed(100 + seed)

    def line_loss() -> torch.Tensor:
        letters = torch.randint(0, 16, (6, 8), generator=g)
        line = nn.functional.one_hot(letters, 16).float()
        return nn.functional.cross_entropy(rnn(line), letters[0] % 4)

    before = snapshot(rnn)
    run_id, _ = fit(rnn, optimizer, line_loss, STEPS)
    assert not moved(before, rnn)
    judge(request, gradflow_server, run_id)
    # Each module's own finding says the same: its parameters are not in the optimizer.


# -- a regression whose loss broadcasts -----------------------------------------------


@expects("loss_broadcasts", "loss", "loss_broadcasts")
@pytest.mark.parametrize("seed", SEEDS)
def test_a_regression_loss_that_broadcasts_its_target(request, gradflow_server, gradflow_env, seed):
    """`MSELoss()(yhat, y)` with predictions of shape (N, 1) and targets of shape (N):
    the loss broadcasts to (N, N) and fits every prediction to the mean target; the
    convex regression never finds its coefficients (thread's settings: 100 samples,
    y = 10 + 9 x0 - 2 x1 + noise, SGD lr 0.1).

    Thread: https://github.com/pytorch/pytorch/issues/16045
    """
    torch.manual_seed(seed)
    x = torch.randn(100, 2)
    y = 10 + 9 * x[:, 0] - 2 * x[:, 1] + torch.randn(100)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="target size"):
        run_id, _ = fit(model, optimizer, lambda: nn.MSELoss()(model(x), y), STEPS)
    # The slope stays near 0 instead of (9, -2): the loss levels off near y's variance.
    assert model.weight.abs().max() < 1.0, model.weight
    with torch.no_grad():
        assert nn.functional.mse_loss(model(x).squeeze(1), y) > 50
    judge(request, gradflow_server, run_id)
