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


def norm_jobs(gf):
    """The gradients handed to the worker, one list a step, from now on."""
    worker = gf.instruments.measurer.worker
    started = []
    start = worker.start

    def noted(norms, grads):
        started.append(grads)
        start(norms, grads)

    worker.start = noted
    return started


def assert_reported(server, gf, seen):
    reported = server.series(gf.run_id, "grad_norm", MODULE)
    assert len(reported) == STEPS and len(seen) == STEPS, (reported, seen)
    for (_, value), expected in zip(reported, seen):
        assert value == pytest.approx(expected, rel=1e-5), (reported, seen)


def test_torch_optimizers_norms_are_taken_alongside_the_step(gradflow_server):
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    gf, seen = watched(gradflow_server, model, optimizer, "alongside")
    started = norm_jobs(gf)
    train(model, optimizer, gf)
    assert len(started) == STEPS  # every step's norms taken by the worker
    worker = gf.instruments.worker
    gf.close()
    assert worker._pool is None  # and the worker stopped with the watch
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
    started = norm_jobs(gf)
    train(model, optimizer, gf)
    gf.close()
    assert started == []  # every step's norms taken on the training thread
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
    assert gf.instruments.measurer.worker is None
    gf.close()
    assert_reported(gradflow_server, gf, seen)


def adam_series(server, on_worker: bool):
    """Adam's update RMS of MODULE on every step, its moments read on the worker or
    copied on the training thread."""
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(
        model,
        optimizer,
        server=server.url,
        run_id=new_run_id("adam-worker" if on_worker else "adam-copied"),
        on_alert=None,
        signals={"adam": 1},
    )
    adam = gf.instruments.signals.adam
    assert adam.worker is not None and adam.worker is gf.instruments.worker
    if not on_worker:
        adam.worker = None
    train(model, optimizer, gf)
    gf.close()
    return server.series(gf.run_id, "adam_update_rms", MODULE)


def test_adams_state_read_on_the_worker_is_the_step_it_followed(gradflow_server):
    """The worker reads the moments while the next forward and backward run, and the
    next optimizer step waits for it: the same numbers as copies taken right after
    the step (a read after the next step would see other moments)."""
    worker = adam_series(gradflow_server, on_worker=True)
    copied = adam_series(gradflow_server, on_worker=False)
    assert len(worker) == STEPS and len(copied) == STEPS, (worker, copied)
    assert len({value for _, value in copied}) == STEPS, copied  # a new figure each step
    for (step, a), (same, b) in zip(worker, copied):
        assert step == same and a == pytest.approx(b, rel=1e-6), (worker, copied)


def test_norm_weights_intended_update_read_on_the_worker_is_the_steps_own(gradflow_server):
    """The norm weights' Adam moments are copied on the worker beside the next forward
    and backward, and the group's lr read at the step: with a scheduler that halves
    the lr between the step and gf.step, what the optimizer meant is still what it
    applied (in f32 nothing rounds away), on every step."""
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    gf = gradflow.watch(
        model,
        optimizer,
        server=gradflow_server.url,
        run_id=new_run_id("intended-worker"),
        on_alert=None,
        signals=False,
    )
    worker = gf.instruments.worker
    assert worker is not None
    reads = []
    until_next_step = worker.until_next_step

    def noted(read):
        reads.append(read)
        return until_next_step(read)

    worker.until_next_step = noted
    data = batches(STEPS)
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        tokens, target = next(data)
        nn.functional.cross_entropy(model(tokens), target).backward()
        optimizer.step()
        scheduler.step()
        gf.step()
    gf.close()
    assert len(reads) == STEPS, reads
    name = "agent.norm.weight"
    intended = gradflow_server.series(gf.run_id, "intended_update_norm", name)
    applied = gradflow_server.series(gf.run_id, "update_norm", name)
    assert len(intended) == len(applied) == STEPS, (intended, applied)
    for (_, want), (_, got) in zip(intended, applied):
        assert got > 0 and abs(want - got) <= 1e-4 * got, (intended, applied)
