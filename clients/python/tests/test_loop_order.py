"""The loop-order checks (clipping, schedulers) hold torch's clip function and an
optimizer hook for the first optimizer steps only: both go away after them or at
`close`, whichever comes first, and a clip imported before `watch` is seen."""

from __future__ import annotations

import torch
from conftest import new_run_id
from torch import nn
from torch.nn.utils import clip_grad
from torch.nn.utils import clip_grad_norm_ as imported_before_watch

import gradflow
from gradflow.capture import loop_order


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def one_step(model, optimizer, clip_after: bool) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(torch.randn(4, 8)).square().sum().backward()
    optimizer.step()
    if clip_after:  # the clip that cannot act, through the name imported early
        imported_before_watch(model.parameters(), 1e-3)


def test_the_clip_is_restored_at_close(gradflow_server):
    original = clip_grad._clip_grads_with_norm_
    model, optimizer = model_and_optimizer()
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id())
    assert clip_grad._clip_grads_with_norm_ is not original
    for _ in range(3):
        one_step(model, optimizer, clip_after=True)
        gf.step()
    gf.close()
    assert clip_grad._clip_grads_with_norm_ is original
    alert = gradflow_server.wait_for_alert(gf.run_id, "clip_after_step", subject="gradients")
    assert alert["evidence"]["params"] == 4


def test_everything_is_removed_after_the_first_steps(gradflow_server):
    original = clip_grad._clip_grads_with_norm_
    model, optimizer = model_and_optimizer()
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id())
    hooks = len(optimizer._optimizer_step_post_hooks)
    for _ in range(loop_order.LOOKS + 1):
        one_step(model, optimizer, clip_after=False)
        gf.step()
    # The loop-order wrapper is gone; what stays for the run is the one observer
    # of clips with a limit of 0 (gradflow.capture.clip_zero), straight over torch's own.
    assert clip_grad._clip_grads_with_norm_.__wrapped__ is original
    assert len(optimizer._optimizer_step_post_hooks) == hooks - 1
    gf.close()
    assert gradflow_server.serious(gf.run_id) == []
