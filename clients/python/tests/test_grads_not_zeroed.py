"""A loop that never zeroes its gradients, against the same loop done right and
gradient accumulation."""

from __future__ import annotations

import urllib.error

import pytest
import torch
from conftest import PromptAgent, batches, new_run_id
from torch import nn

import gradflow


def loop(server, zero: str, steps: int = 10, accumulate: int = 1, weights=None):
    """zero: "none" (the bug), "before" (zero_grad before backward), "after" (after the
    optimizer step), "data" (the old idiom p.grad.data.zero_()), "inside" and
    "inside_zeros" (zero_grad in the micro-batch loop, to None or to zeros: the bug
    that keeps the last micro-batch only). weights: each micro-batch's loss weight (0:
    a backward pass that adds an exactly-zero gradient)."""
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(model, optimizer, server=server.url, run_id=new_run_id("zero"))
    data = batches(steps * accumulate)
    weights = weights or [1.0] * accumulate
    for _ in range(steps):
        if zero == "before":
            optimizer.zero_grad(set_to_none=True)
        for micro in range(accumulate):
            if zero in ("inside", "inside_zeros"):
                optimizer.zero_grad(set_to_none=zero == "inside")
            tokens, target = next(data)
            loss = nn.functional.cross_entropy(model(tokens), target) * weights[micro] / accumulate
            loss.backward()
        optimizer.step()
        if zero == "after":
            optimizer.zero_grad(set_to_none=False)
        elif zero == "data":
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.data.zero_()
        gf.step(loss=loss)
    gf.close()
    return gf.run_id


def test_a_loop_that_never_zeroes_its_gradients(gradflow_server):
    run_id = loop(gradflow_server, "none")
    alert = gradflow_server.wait_for_alert(run_id, "grads_not_zeroed")
    assert alert["severity"] == "warning" and alert["evidence"]["cause"] == "not_zeroed"
    # Step 0 had nothing to carry; steps 1, 2, 3 did: it opens on the third.
    assert (alert["first_step"], alert["opened_step"]) == (1, 3), alert
    assert "grew" not in alert["detail"] and "total gradient norm went from" in alert["detail"]
    assert "zero_grad" in alert["fix"]


def test_zeroing_before_after_or_by_data_and_accumulation_stay_silent(gradflow_server):
    for zero, accumulate in [("before", 1), ("after", 1), ("data", 1), ("before", 3)]:
        run_id = loop(gradflow_server, zero, accumulate=accumulate)
        kinds = [a["kind"] for a in gradflow_server.alerts(run_id)]
        assert "grads_not_zeroed" not in kinds, (zero, accumulate, kinds)
        assert gradflow_server.run(run_id)["step_count"] == 10


RESETS = "grads_reset_between_backwards"


def test_zero_grad_inside_the_micro_batch_loop_is_counted_every_step(gradflow_server):
    """The record says, per step with several backward passes, how many of the later
    ones found the gradient the earlier ones accumulated reset: 3 of 4 micro-batches
    lost, whether zero_grad sets gradients to None or to zeros."""
    for zero in ("inside", "inside_zeros"):
        run_id = loop(gradflow_server, zero, accumulate=4)
        resets = gradflow_server.series(run_id, "metric", RESETS)
        # Step 0 has no probe yet (it is placed at the first optimizer step).
        assert [step for step, _ in resets] == list(range(1, 10)), (zero, resets)
        assert all(value == 3 for _, value in resets), (zero, resets)


def test_intended_accumulation_reports_no_reset_and_one_backward_reports_nothing(
    gradflow_server,
):
    for zero in ("before", "after"):
        run_id = loop(gradflow_server, zero, accumulate=3)
        resets = gradflow_server.series(run_id, "metric", RESETS)
        assert len(resets) == 9 and all(value == 0 for _, value in resets), (zero, resets)
    # One backward per step: nothing to compare, nothing sent (no such series).
    run_id = loop(gradflow_server, "before")
    with pytest.raises(urllib.error.HTTPError) as missing:
        gradflow_server.series(run_id, "metric", RESETS)
    assert missing.value.code == 404


def test_a_backward_that_adds_exactly_zero_is_no_reset(gradflow_server):
    """A gradient found at zero is a reset only when the previous backward left it
    non-zero: micro-batches weighted 0 (a REINFORCE time step whose return is 0) leave
    the zero they found. With zero_grad to zeros inside the loop and the first of four
    micro-batches weighted 0, the second finds a zero nothing was lost from; the third
    and fourth each lose what the one before left: 2 resets a step, not 3."""
    run_id = loop(gradflow_server, "before", accumulate=4, weights=[0.0, 0.0, 1.0, 0.0])
    resets = gradflow_server.series(run_id, "metric", RESETS)
    assert len(resets) == 9 and all(value == 0 for _, value in resets), resets
    run_id = loop(gradflow_server, "inside_zeros", accumulate=4, weights=[0.0, 1.0, 1.0, 1.0])
    resets = gradflow_server.series(run_id, "metric", RESETS)
    assert len(resets) == 9 and all(value == 2 for _, value in resets), resets


def test_steps_the_loss_scaler_skips_are_not_micro_batches(gradflow_server):
    """fp16 under a `GradScaler` whose initial scale overflows: it skips
    `optimizer.step()` on several steps running while the scale comes down (expected:
    https://github.com/huggingface/accelerate/pull/139). A skipped step still ends
    the loop's step, so the next `zero_grad()` is not a reset between the
    micro-batches of one optimizer step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    gf = gradflow.watch(
        model, optimizer, scaler=scaler, server=gradflow_server.url, run_id=new_run_id("skips")
    )
    skipped = []
    for _ in range(16):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(
                model(torch.randn(8, 16)).float(), torch.arange(8) % 4
            )
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped.append(scaler.get_scale() < scale)
        gf.step(loss=loss)
    gf.close()
    assert sum(skipped[:8]) >= 3, skipped  # several skipped steps running
    try:
        resets = gradflow_server.series(gf.run_id, "metric", "grads_reset_between_backwards")
    except urllib.error.HTTPError as err:  # 404: never sent, no step had two backwards
        assert err.code == 404, err
        resets = []
    assert not [p for p in resets if p[1]], resets
    assert not gradflow_server.serious(gf.run_id)


def test_sam_resetting_after_its_climb_is_no_reset(gradflow_server):
    """SAM (https://github.com/davda54/sam/issues/32): backward, climb to w + e(w) in
    place, zero_grad, backward again at the climbed weights, back to w, step. The
    second pass's gradient replaces the first on purpose: the weights changed in
    place between the passes, so the reset is not counted. The same loop without the
    climb is accumulation that keeps only its last pass: counted."""
    for climb in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        params = list(model.parameters())
        optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id("sam"))
        for _ in range(10):
            x, y = torch.randn(8, 16), torch.arange(8) % 4
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            with torch.no_grad():
                climbs = [0.05 * p.grad / (p.grad.norm() + 1e-12) for p in params]
                if climb:
                    for p, e in zip(params, climbs):
                        p.add_(e)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                if climb:
                    for p, e in zip(params, climbs):
                        p.sub_(e)
            optimizer.step()
            optimizer.zero_grad()
            gf.step(loss=loss)
        gf.close()
        resets = gradflow_server.series(gf.run_id, "metric", RESETS)
        assert len(resets) == 9, (climb, resets)
        assert all(value == (0 if climb else 1) for _, value in resets), (climb, resets)
