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
from gradflow import _torch_compat
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
    value_clip = nn.utils.clip_grad_value_
    model, optimizer = model_and_optimizer()
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id())
    hooks = len(optimizer._optimizer_step_post_hooks)
    for _ in range(loop_order.LOOKS + 1):
        one_step(model, optimizer, clip_after=False)
        gf.step()
    # The loop-order wrapper is gone; what stays for the run is the one observer
    # of clips with a limit of 0 (gradflow.capture.clip_zero), straight over torch's own.
    assert clip_grad._clip_grads_with_norm_.__wrapped__ is original
    assert nn.utils.clip_grad_value_.__wrapped__ is value_clip
    assert len(optimizer._optimizer_step_post_hooks) == hooks - 1
    gf.close()
    assert nn.utils.clip_grad_value_ is value_clip
    assert gradflow_server.serious(gf.run_id) == []


def test_a_value_clip_after_the_step_is_named_and_restored_at_close(gradflow_server):
    value_clip = nn.utils.clip_grad_value_
    model, optimizer = model_and_optimizer()
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id())
    for _ in range(3):
        one_step(model, optimizer, clip_after=False)
        # A generator of parameters, read once for the observers and the clip alike.
        nn.utils.clip_grad_value_((p for p in model.parameters()), 1e-4)
        gf.step()
    assert all(float(p.grad.abs().max()) <= 1e-4 for p in model.parameters())
    gf.close()
    assert nn.utils.clip_grad_value_ is value_clip
    alert = gradflow_server.wait_for_alert(gf.run_id, "clip_after_step", subject="gradients")
    assert alert["evidence"]["params"] == 4
    assert "clip_grad_value_ cut 4 parameter tensors" in alert["detail"]


def test_a_value_clip_that_cuts_nothing_is_not_a_finding(gradflow_server):
    model, optimizer = model_and_optimizer()
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id())
    for _ in range(loop_order.LOOKS + 1):
        one_step(model, optimizer, clip_after=False)
        nn.utils.clip_grad_value_(model.parameters(), 1e6)  # after the step, but a no-op
        gf.step()
    gf.close()
    assert gradflow_server.run(gf.run_id)["step_count"] == loop_order.LOOKS + 1
    assert gradflow_server.serious(gf.run_id) == []


def test_a_clip_after_the_step_that_cuts_only_later_is_watched_until_it_does(gradflow_server):
    """The clip sits after the step from the start, but the gradients stay under its
    bound for the first steps (jongwook/onsets-and-frames#24: a bound of 3 that early
    gradients do not reach): the clips are watched on, alone, until one cuts."""
    original = clip_grad._clip_grads_with_norm_
    model, _ = model_and_optimizer()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id())
    hooks = len(optimizer._optimizer_step_post_hooks)
    norms = []
    x = torch.randn(4, 8)
    for step in range(40):
        optimizer.zero_grad(set_to_none=True)
        # The loss grows with the step, so the gradients pass the bound only after
        # the first LOOKS steps.
        (model(x).square().sum() * (1 + step)).backward()
        optimizer.step()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), 150.0)))
        gf.step()
    first_cut = next(i for i, n in enumerate(norms) if n > 150.0)
    assert first_cut > loop_order.LOOKS, norms
    alert = gradflow_server.wait_for_alert(gf.run_id, "clip_after_step", subject="gradients")
    assert alert["evidence"]["params"] == 4
    # Said, the watch ends: torch's clip and the optimizer's hooks are as before.
    assert clip_grad._clip_grads_with_norm_.__wrapped__ is original
    assert len(optimizer._optimizer_step_post_hooks) == hooks - 1
    gf.close()


def test_stacked_clip_observers_come_off_in_any_order():
    original = nn.utils.clip_grad_value_
    seen = []
    lower = _torch_compat.wrap_clip_values(lambda _p, v: seen.append(("lower", v)))
    upper = _torch_compat.wrap_clip_values(lambda _p, v: seen.append(("upper", v)))
    assert lower is not None and upper is not None
    param = nn.Parameter(torch.ones(3))
    param.grad = torch.tensor([5.0, -5.0, 0.5])
    nn.utils.clip_grad_value_([param], 1.0)
    assert seen == [("upper", 1.0), ("lower", 1.0)]
    assert param.grad.tolist() == [1.0, -1.0, 0.5]
    lower()  # the one beneath goes first: the upper one now calls torch's directly
    assert nn.utils.clip_grad_value_.__wrapped__ is original
    nn.utils.clip_grad_value_([param], 0.25)
    assert seen[-1] == ("upper", 0.25) and len(seen) == 3
    upper()
    assert nn.utils.clip_grad_value_ is original


def clipped_before_backward(gradflow_server, bound: float, set_to_none: bool = True, steps=20):
    """`zero_grad(); clip_grad_norm_(...); loss.backward(); optimizer.step()`
    (Cranial-XIX/FAMO#4): the clip finds no gradient (or only zeros) every time."""
    model, optimizer = model_and_optimizer()
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id())
    used = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=set_to_none)
        assert float(nn.utils.clip_grad_norm_(model.parameters(), bound)) == 0.0
        model(torch.randn(4, 8)).square().sum().backward()
        used.append(float(nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        optimizer.step()
        gf.step()
    gf.close()
    return gf.run_id, used


def test_a_clip_before_backward_that_would_have_cut_is_named_with_its_numbers(gradflow_server):
    run_id, used = clipped_before_backward(gradflow_server, bound=0.5)
    assert sum(n > 0.5 for n in used) >= 2, used
    alert = gradflow_server.wait_for_alert(run_id, "clip_after_step", subject="gradients")
    evidence = alert["evidence"]
    assert evidence["cause"] == "clip_after_step" and evidence["params"] == 4
    assert evidence["bound"] == 0.5
    # The first two steps above the bound, as the optimizer used them.
    above = [n for n in used if n > 0.5][:2]
    assert evidence["used_norms"][:2] == [float(f"{n:.4g}") for n in above], (evidence, used)
    assert "before loss.backward()" in alert["detail"], alert["detail"]
    assert "max_norm is 0.5" in alert["detail"], alert["detail"]


def test_a_clip_of_zeroed_gradients_before_backward_is_named(gradflow_server):
    """`zero_grad(set_to_none=False)` leaves zeros: the clip's total norm is 0."""
    run_id, used = clipped_before_backward(gradflow_server, bound=0.5, set_to_none=False)
    assert sum(n > 0.5 for n in used) >= 2, used
    alert = gradflow_server.wait_for_alert(run_id, "clip_after_step", subject="gradients")
    assert alert["evidence"]["bound"] == 0.5


def test_a_clip_before_backward_whose_bound_is_never_reached_is_silent(gradflow_server):
    """Misplaced, but it would have cut nothing: every step is what a clip in the right
    place gives, so there is nothing to tell the user about their training."""
    run_id, used = clipped_before_backward(gradflow_server, bound=1e6)
    assert max(used) < 1e6
    assert gradflow_server.run(run_id)["step_count"] == 20
    assert gradflow_server.serious(run_id) == []


def test_clips_where_they_act_are_silent(gradflow_server):
    """Gradient accumulation clipped once after the last micro-batch's backward, and a
    loop that zeroes in place (`set_to_none=False`) and clips after backward: both clip
    the gradients the step uses, at a bound the gradients pass."""
    for set_to_none in (True, False):
        model, optimizer = model_and_optimizer()
        run_id = new_run_id()
        gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=run_id)
        for _ in range(loop_order.LOOKS + 4):
            optimizer.zero_grad(set_to_none=set_to_none)
            for _ in range(3):
                (model(torch.randn(4, 8)).square().sum() / 3).backward()
            assert float(nn.utils.clip_grad_norm_(model.parameters(), 0.5)) > 0.5
            optimizer.step()
            gf.step()
        gf.close()
        assert gradflow_server.run(run_id)["step_count"] == loop_order.LOOKS + 4
        assert gradflow_server.serious(run_id) == []
