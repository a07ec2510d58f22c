"""Healthy training raises nothing, and watching it does not change it."""

from __future__ import annotations

import pytest
import torch
from conftest import PromptAgent, batches, free_port, new_run_id, qwen_config, train
from torch import nn
from transformers import Qwen2ForCausalLM

import gradflow


def watch(server, model, optimizer, **options):
    return gradflow.watch(
        model, optimizer, server=server.url, run_id=new_run_id(), on_alert=None, **options
    )


def test_healthy_adamw_run_raises_nothing(gradflow_server):
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = watch(
        gradflow_server,
        model,
        optimizer,
        detectors={"stuck_zero_steps": 10, "frozen_norm_steps": 10},
    )
    losses = train(model, optimizer, gf, 40)
    gf.close()
    assert losses[-1] < losses[0]
    assert gradflow_server.run(gf.run_id)["step_count"] == 40
    assert gradflow_server.serious(gf.run_id) == []


def test_healthy_sgd_with_momentum_and_gradient_accumulation_raises_nothing(gradflow_server):
    model = PromptAgent()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    gf = watch(
        gradflow_server,
        model,
        optimizer,
        detectors={"stuck_zero_steps": 10, "frozen_norm_steps": 10},
    )
    data = batches(60)
    for _ in range(20):
        for _micro in range(3):
            tokens, target = next(data)
            nn.functional.cross_entropy(model(tokens), target).div(3).backward()
        optimizer.step()
        optimizer.zero_grad()  # zeroed after the step: gradients were read before
        gf.step(loss=1.0)
    gf.close()
    assert gradflow_server.serious(gf.run_id) == []
    hits = gradflow_server.series(gf.run_id, "hook_hits", "agent.head")
    assert [value for _, value in hits] == [3] * 20
    grad = gradflow_server.series(gf.run_id, "grad_norm", "agent")
    assert all(value > 0 for _, value in grad)
    # SGD's intended update is what it applied, in f32.
    intended = gradflow_server.series(gf.run_id, "intended_update_norm", "agent.norm.weight")
    applied = gradflow_server.series(gf.run_id, "update_norm", "agent.norm.weight")
    for (_, want), (_, got) in zip(intended, applied):
        assert abs(want - got) <= 1e-3 * got + 1e-9


def test_reporting_every_fifth_step(gradflow_server):
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = watch(gradflow_server, model, optimizer, every=5)
    train(model, optimizer, gf, 20)
    gf.close()
    steps = [step for step, _ in gradflow_server.series(gf.run_id, "grad_norm", "qwen")]
    assert steps == [0, 5, 10, 15]
    assert [
        s for s, _ in gradflow_server.series(gf.run_id, "update_norm", "agent.norm.weight")
    ] == [
        0,
        5,
        10,
        15,
    ]


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["f32", "bf16-autocast"])
def test_watching_leaves_training_bit_identical(tmp_path, autocast):
    """Post-accumulate-grad hooks and optimizer hooks only read: the losses and the
    final weights of a watched run equal those of a bare one, bit for bit."""

    def run(watched: bool):
        model = PromptAgent(seed=3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gf = None
        if watched:
            gf = gradflow.watch(
                model,
                optimizer,
                server=f"http://127.0.0.1:{free_port()}",
                on_alert=None,
                close_timeout=0.5,
                spool_dir=str(tmp_path),
            )
        losses = train(model, optimizer, gf, 12, autocast=autocast)
        if gf is not None:
            gf.close()
        return losses, [p.detach().clone() for p in model.parameters()]

    bare_losses, bare_weights = run(False)
    watched_losses, watched_weights = run(True)
    assert watched_losses == bare_losses
    assert all(torch.equal(a, b) for a, b in zip(bare_weights, watched_weights))


def test_grad_norms_match_a_direct_computation(gradflow_server):
    model = PromptAgent()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    gf = watch(gradflow_server, model, optimizer)
    tokens, target = next(batches(1))
    nn.functional.cross_entropy(model(tokens), target).backward()
    expected = {
        "agent.head": torch.cat(
            [model.agent.head.weight.grad.flatten(), model.agent.head.bias.grad.flatten()]
        )
        .norm()
        .item(),
        "qwen.norm": model.qwen.norm.weight.grad.norm().item(),
    }
    optimizer.step()
    gf.step(loss=torch.tensor(1.5))
    gf.close()
    for module, want in expected.items():
        ((step, got),) = gradflow_server.series(gf.run_id, "grad_norm", module)
        assert step == 0 and abs(got - want) <= 1e-5 * want, (module, got, want)
    assert gradflow_server.series(gf.run_id, "loss") == [[0, 1.5]]


def test_scaled_gradients_are_read_unscaled_and_before_clipping(gradflow_server):
    model = PromptAgent()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    gf = watch(gradflow_server, model, optimizer, scaler=scaler)
    tokens, target = next(batches(1))
    loss = nn.functional.cross_entropy(model(tokens), target)
    scaler.scale(loss).backward()
    head_grads = [model.agent.head.weight.grad, model.agent.head.bias.grad]
    want = torch.cat([g.flatten() for g in head_grads]).norm().item() / 1024.0
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
    scaler.step(optimizer)
    scaler.update()
    gf.step(loss=loss)
    gf.close()
    ((_, head),) = gradflow_server.series(gf.run_id, "grad_norm", "agent.head")
    assert abs(head - want) <= 1e-5 * want, (head, want)  # unscaled, not clipped to 1e-3
    assert gradflow_server.series(gf.run_id, "scaler_scale") == [[0, 1024.0]]
    assert gradflow_server.series(gf.run_id, "found_inf") == [[0, 0.0]]


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, maximize=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        lambda ps: torch.optim.SGD(ps, lr=0.1),
    ],
    ids=["adamw", "adam-l2-amsgrad", "adam-maximize", "sgd-nesterov", "sgd"],
)
def test_intended_update_is_the_applied_one_in_f32(gradflow_server, make):
    """In f32 nothing rounds away at these step sizes, so what the optimizer meant to
    apply, recomputed from its state, is what it applied."""
    model = PromptAgent()
    optimizer = make(model.parameters())
    gf = watch(gradflow_server, model, optimizer)
    train(model, optimizer, gf, 4)
    gf.close()
    name = "agent.norm.weight"
    intended = gradflow_server.series(gf.run_id, "intended_update_norm", name)
    applied = gradflow_server.series(gf.run_id, "update_norm", name)
    assert len(intended) == len(applied) == 4
    for (_, want), (_, got) in zip(intended, applied):
        assert got > 0 and abs(want - got) <= 1e-4 * got, (want, got)
    assert all(v == 0 for _, v in gradflow_server.series(gf.run_id, "rounded_away", name))
    assert all(v == 48 for _, v in gradflow_server.series(gf.run_id, "intended_nonzero", name))


def test_healthy_causal_lm_raises_nothing(gradflow_server):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = watch(
        gradflow_server,
        model,
        optimizer,
        detectors={"stuck_zero_steps": 10, "frozen_norm_steps": 10},
    )
    for tokens, _ in batches(25):
        optimizer.zero_grad()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        gf.step(loss=loss)
    gf.close()
    assert gradflow_server.run(gf.run_id)["step_count"] == 25
    assert gradflow_server.serious(gf.run_id) == []
    steps = [step for step, _ in gradflow_server.series(gf.run_id, "grad_norm", "model.layers")]
    assert steps == list(range(25))
