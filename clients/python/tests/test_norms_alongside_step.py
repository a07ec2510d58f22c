"""On a CPU the gradient norms are taken on a worker thread while torch's optimizer
steps, and the post-step hook waits for them: the server receives the norms of the
gradients the optimizer stepped with, the same as when the training thread took
them. Where something else could change the gradients during the step (a step hook
registered after gradflow's, an optimizer from outside ``torch.optim``), the training
thread takes them before the step, as before."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import PromptAgent, batches, new_run_id
from torch import nn

import gradflow

MODULE = "agent.head"
STEPS = 4


def norm_of(model: nn.Module, module: str) -> float:
    """The module's gradient norm now, in f64."""
    owner = model.get_submodule(module)
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in owner.parameters()))


def train(model, optimizer, gf):
    data = batches(STEPS)
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        tokens, target = next(data)
        loss = nn.functional.cross_entropy(model(tokens), target)
        loss.backward()
        optimizer.step()
        gf.step(loss=loss)


def watched(server, model, optimizer, stem):
    """gradflow on the model, after a step hook that notes MODULE's gradient norm as
    the optimizer's first pre-step hook sees it."""
    seen = []
    optimizer.register_step_pre_hook(lambda *_: seen.append(norm_of(model, MODULE)))
    gf = gradflow.watch(model, optimizer, server=server.url, run_id=new_run_id(stem), on_alert=None)
    return gf, seen


def assert_reported(server, gf, seen):
    reported = server.series(gf.run_id, "grad_norm", MODULE)
    assert len(reported) == STEPS and len(seen) == STEPS, (reported, seen)
    for (_, value), expected in zip(reported, seen):
        assert value == pytest.approx(expected, rel=1e-5), (reported, seen)


def test_torch_optimizers_norms_are_taken_alongside_the_step(gradflow_server):
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    gf, seen = watched(gradflow_server, model, optimizer, "alongside")
    train(model, optimizer, gf)
    overlap = gf.instruments.measurer.overlap
    assert overlap is not None and overlap._pool is not None  # the worker took them
    gf.close()
    assert overlap._pool is None  # and stopped with the watch
    assert_reported(gradflow_server, gf, seen)


def test_a_step_hook_after_gradflows_keeps_the_norms_before_it(gradflow_server):
    """A pre-step hook registered after gradflow's halves the gradients in place: the
    norms reported are those before it, taken on the training thread (a worker
    would race with it)."""
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf, seen = watched(gradflow_server, model, optimizer, "hook-after")

    def halve(opt, *_):
        torch._foreach_mul_([p.grad for g in opt.param_groups for p in g["params"]], 0.5)

    optimizer.register_step_pre_hook(halve)
    train(model, optimizer, gf)
    pool = gf.instruments.measurer.overlap._pool
    gf.close()
    assert pool is None  # never started: every step's norms on the training thread
    assert_reported(gradflow_server, gf, seen)


class InPlaceDecay(torch.optim.Optimizer):
    """An optimizer from outside torch.optim that adds weight decay to the gradients
    in place through ``.data`` (which no version counter sees), as older ones do."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.data.add_(p.data, alpha=0.5)
                    p.add_(p.grad, alpha=-group["lr"])


def test_an_optimizer_from_elsewhere_is_measured_before_its_step(gradflow_server):
    model = PromptAgent()
    optimizer = InPlaceDecay(model.parameters(), lr=1e-3)
    gf, seen = watched(gradflow_server, model, optimizer, "elsewhere")
    train(model, optimizer, gf)
    assert gf.instruments.measurer.overlap is None
    gf.close()
    assert_reported(gradflow_server, gf, seen)
