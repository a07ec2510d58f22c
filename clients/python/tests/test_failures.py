"""Every failure gradflow's Rust trainer reproduces, reproduced in PyTorch: the client
must give the server what it needs to name each one, with the right cause."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import PromptAgent, new_run_id, train
from said import alerts_said
from torch import nn

import gradflow
from gradflow.measurement.registration import SIGNATURE_EVERY


def watch(server, model, optimizer, **options):
    options.setdefault("run_id", new_run_id())
    options.setdefault("on_alert", None)
    return gradflow.watch(model, optimizer, server=server.url, **options)


def test_detached_prompt_is_backward_not_reached_on_qwen(gradflow_server):
    model = PromptAgent(detach_prompt=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = watch(gradflow_server, model, optimizer, detectors={"stuck_zero_steps": 10})
    train(model, optimizer, gf, 14)
    gf.close()
    alert = gradflow_server.wait_for_alert(gf.run_id, "grad_stuck_zero", subject="qwen")
    assert alert["severity"] == "critical"
    assert alert["evidence"]["cause"] == "backward_not_reached", alert
    # The agent trained: nothing is said about it.
    assert not [a for a in gradflow_server.serious(gf.run_id) if a["subject"].startswith("agent")]
    hits = gradflow_server.series(gf.run_id, "hook_hits", "qwen.layers.0.self_attn.q_proj")
    assert hits and all(value == 0 for _, value in hits)


def test_bf16_norm_weights_under_adamw_are_frozen_by_rounding(gradflow_server):
    model = PromptAgent().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    gf = watch(gradflow_server, model, optimizer, detectors={"frozen_norm_steps": 10})
    train(model, optimizer, gf, 14)
    gf.close()
    alert = gradflow_server.wait_for_alert(gf.run_id, "norm_weight_frozen")
    assert alert["evidence"]["cause"] == "low_precision_underflow", alert
    name = "qwen.layers.0.input_layernorm.weight"
    # What the client measured: AdamW meant ~lr per element, far below bf16's spacing
    # at 1.0 (2^-7), and every such update rounded away.
    ratio = gradflow_server.series(gf.run_id, "intended_update_max_ulp", name)
    assert ratio and all(0 < value < 0.25 for _, value in ratio), ratio
    nonzero = gradflow_server.series(gf.run_id, "intended_nonzero", name)
    rounded = gradflow_server.series(gf.run_id, "rounded_away", name)
    assert nonzero[-1][1] == 48 and rounded[-1][1] == 48
    assert all(value == 0 for _, value in gradflow_server.series(gf.run_id, "update_norm", name))


def test_grad_scaler_over_bf16_params_is_flagged_before_the_first_step(gradflow_server):
    model = PromptAgent().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with alerts_said() as shown:
        gf = watch(gradflow_server, model, optimizer, scaler=scaler, on_alert="warn")
    assert any("scaler_bf16_incompatible" in m for m in shown), shown
    gf.close()
    alert = gradflow_server.wait_for_alert(gf.run_id, "scaler_bf16_incompatible")
    assert alert["first_step"] is None and alert["severity"] == "critical"


def test_raise_mode_stops_at_watch_on_a_critical_registration_alert(gradflow_server):
    model = PromptAgent().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(gradflow.TrainingAlert) as raised:
        watch(gradflow_server, model, optimizer, scaler=scaler, on_alert="raise")
    assert raised.value.kind == "scaler_bf16_incompatible"
    assert "fix:" in str(raised.value)
    # Nothing stays attached to the objects of a run the user chose to stop.
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert not {"step", "update", "unscale_"} & set(vars(scaler))


def test_qwen_left_out_of_the_optimizer(gradflow_server):
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.agent.parameters(), lr=1e-3)
    gf = watch(gradflow_server, model, optimizer, detectors={"frozen_norm_steps": 10})
    train(model, optimizer, gf, 14)
    gf.close()
    alert = gradflow_server.wait_for_alert(gf.run_id, "param_not_in_optimizer", subject="qwen")
    assert alert["severity"] == "critical"
    frozen = gradflow_server.wait_for_alert(gf.run_id, "norm_weight_frozen", subject="qwen")
    assert frozen["evidence"]["cause"] == "not_in_optimizer", frozen


def test_late_unfreeze_outside_the_optimizer_is_amended_and_flagged(gradflow_server):
    model = PromptAgent()
    model.qwen.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.agent.parameters(), lr=1e-3)
    gf = watch(gradflow_server, model, optimizer)
    assert not gradflow_server.alerts(gf.run_id), "a frozen backbone is not a fault"

    def unfreeze(step):
        if step == 8:
            model.qwen.requires_grad_(True)  # ... but never added to the optimizer

    train(model, optimizer, gf, 14, before_step=unfreeze)
    gf.close()
    run = gradflow_server.run(gf.run_id)
    amended = [a for a in run["amendments"] if a["step"] == 8]
    assert amended, run["amendments"]
    specs = {p["name"]: p for p in amended[0]["amend"]["params"]}
    spec = specs["qwen.layers.0.mlp.up_proj.weight"]
    assert spec["requires_grad"] is True and spec["in_optimizer"] is False
    alert = gradflow_server.wait_for_alert(gf.run_id, "param_not_in_optimizer", subject="qwen")
    assert alert["severity"] == "critical"
    assert alert["opened_step"] == 8, alert


def test_parameter_group_added_while_training_is_an_amendment(gradflow_server):
    model = PromptAgent()
    model.qwen.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.agent.parameters(), lr=1e-3)
    gf = watch(gradflow_server, model, optimizer)

    def unfreeze(step):
        if step == 5:
            model.qwen.requires_grad_(True)
            optimizer.add_param_group({"params": model.qwen.parameters(), "lr": 1e-4})

    train(model, optimizer, gf, 10, before_step=unfreeze)
    gf.close()
    run = gradflow_server.run(gf.run_id)
    (amendment,) = [a for a in run["amendments"] if a["step"] == 5]
    groups = amendment["amend"]["param_groups"]
    assert groups == [
        {"name": "1", "lr": 1e-4, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}
    ]
    spec = {p["name"]: p for p in run["params"]}["qwen.norm.weight"]
    assert spec["in_optimizer"] is True and spec["param_group"] == "1"
    assert not gradflow_server.serious(gf.run_id)
    lrs = gradflow_server.series(gf.run_id, "lr", "1")
    assert lrs and lrs[0][0] == 5


def test_fp16_overflow_under_a_cpu_grad_scaler(gradflow_server):
    model = PromptAgent()
    # Activations past fp16's range (65504) under fp16 autocast: every step overflows.
    model.agent.prompt_proj.weight.data.mul_(1e4)
    model.agent.hidden.weight.data.mul_(1e4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    gf = watch(
        gradflow_server, model, optimizer, scaler=scaler, detectors={"overflow_streak_steps": 6}
    )
    train(model, optimizer, gf, 10, scaler=scaler, autocast=torch.float16)
    gf.close()
    alert = gradflow_server.wait_for_alert(gf.run_id, "scaler_overflow_streak")
    assert alert["evidence"]["cause"] == "overflow"
    found = gradflow_server.series(gf.run_id, "found_inf")
    assert found and all(value == 1 for _, value in found), found
    scale = [value for _, value in gradflow_server.series(gf.run_id, "scaler_scale")]
    # Read before update() halved it: the first reported scale is the initial one.
    assert scale[0] == 65536.0 and scale[1] == 32768.0, scale
    # Skipped steps are not a NaN-gradient verdict: the scaler explains them.
    assert not [a for a in gradflow_server.alerts(gf.run_id) if a["kind"] == "grad_nonfinite"]


def test_nan_gradient_is_flagged_and_no_step_is_lost(gradflow_server):
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = watch(gradflow_server, model, optimizer)

    def poison(step):
        if step == 6:
            model.agent.head.weight.grad[0, 0] = math.nan

    train(model, optimizer, gf, 10, after_backward=poison)
    gf.close()
    alert = gradflow_server.wait_for_alert(gf.run_id, "grad_nonfinite", subject="agent")
    assert alert["evidence"]["cause"] == "nan" and alert["first_step"] == 6
    # The step the NaN was injected names only the agent's head; the rest follows it.
    head = gradflow_server.series(gf.run_id, "grad_norm", "agent.head")
    assert [step for step, value in head if not isinstance(value, float)][:1] == [6], head
    run = gradflow_server.run(gf.run_id)
    assert run["step_count"] == 10 and run["last_step"] == 9


class LoRALinear(nn.Module):
    """A frozen base projection plus a low-rank adapter kept in its own dtype."""

    def __init__(self, base: nn.Linear, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, dtype=dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, dtype=dtype)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype)))
        return self.base(x) + low.to(x.dtype)


def lora_model(adapter_dtype: torch.dtype) -> PromptAgent:
    model = PromptAgent()
    model.qwen.requires_grad_(False)
    for layer in model.qwen.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj, 4, adapter_dtype)
        layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj, 4, adapter_dtype)
    return model


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def test_lora_adapters_in_another_dtype_than_the_trained_weights(gradflow_server):
    model = lora_model(torch.bfloat16)
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-3)
    gf = watch(gradflow_server, model, optimizer)
    train(model, optimizer, gf, 4)
    gf.close()
    alert = gradflow_server.wait_for_alert(gf.run_id, "dtype_mismatch", subject="qwen")
    assert alert["evidence"]["cause"] == "mixed_param_dtypes"
    assert alert["evidence"]["expected"] == "f32" and alert["evidence"]["found"] == ["bf16"]


def test_lora_adapters_in_the_trained_dtype_raise_nothing(gradflow_server):
    model = lora_model(torch.float32)
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-3)
    gf = watch(gradflow_server, model, optimizer)
    train(model, optimizer, gf, 4)
    gf.close()
    assert gradflow_server.run(gf.run_id)["step_count"] == 4
    assert not gradflow_server.serious(gf.run_id)


def test_adapters_cast_while_training_are_amended(gradflow_server):
    model = lora_model(torch.float32)
    optimizer = torch.optim.SGD(trainable(model), lr=1e-2)
    gf = watch(gradflow_server, model, optimizer)

    def cast(step):
        if step == 3:  # what a trainer library does to adapters behind the user's back
            for layer in model.qwen.layers:
                layer.self_attn.q_proj.lora_A.to(torch.bfloat16)
                layer.self_attn.q_proj.lora_B.to(torch.bfloat16)

    train(model, optimizer, gf, 3 + SIGNATURE_EVERY + 1, before_step=cast)
    gf.close()
    run = gradflow_server.run(gf.run_id)
    (amendment,) = run["amendments"]
    # Step 3 is not one whose signature is read anyway (every SIGNATURE_EVERY-th): the
    # adapters' gradients come in their new dtype on the step of the cast.
    assert 3 % SIGNATURE_EVERY != 0
    assert amendment["step"] == 3, run["amendments"]
    dtypes = {p["name"]: p["dtype"] for p in amendment["amend"]["params"]}
    assert dtypes == {
        f"qwen.layers.{i}.self_attn.q_proj.lora_{ab}.weight": "bf16"
        for i in range(2)
        for ab in "AB"
    }
    alert = gradflow_server.wait_for_alert(gf.run_id, "dtype_mismatch", subject="qwen")
    assert alert["evidence"]["found"] == ["bf16"]


def test_a_learning_rate_far_too_high_is_runaway_loss_within_five_steps(gradflow_server):
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    gf = watch(gradflow_server, model, optimizer)
    losses = train(model, optimizer, gf, 8)
    gf.close()
    alert = gradflow_server.wait_for_alert(gf.run_id, "loss_divergence")
    assert alert["opened_step"] <= 5, (alert, losses)
    assert alert["evidence"]["cause"] == "divergence"


def test_a_head_meant_to_train_but_frozen_by_a_wrong_filter(gradflow_server):
    model = PromptAgent()
    for name, p in model.named_parameters():
        if "head" in name:  # meant to freeze attention heads; froze the agent's head too
            p.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    gf = watch(gradflow_server, model, optimizer, train=["qwen", "agent", "agent.head"])
    gf.close()
    alert = gradflow_server.wait_for_alert(gf.run_id, "group_not_training")
    assert alert["subject"] == "agent.head" and alert["severity"] == "critical"
    assert alert["first_step"] is None
    assert [a["subject"] for a in gradflow_server.alerts(gf.run_id)] == ["agent.head"]


def test_frozen_modules_inside_a_group_meant_to_train_are_named(gradflow_server):
    model = PromptAgent()
    for name, p in model.named_parameters():
        if "head" in name:  # the same wrong filter, with only the group declared
            p.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    gf = watch(gradflow_server, model, optimizer, train=["agent"])
    gf.close()
    alert = gradflow_server.wait_for_alert(gf.run_id, "group_not_training")
    assert (alert["subject"], alert["severity"]) == ("agent", "warning"), alert
    assert alert["evidence"]["cause"] == "frozen_modules"
    assert alert["evidence"]["modules"] == ["agent.head"], alert


def test_an_fp16_overflow_from_the_inputs_names_the_batch(gradflow_server):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    gf = watch(
        gradflow_server, model, optimizer, scaler=scaler, detectors={"overflow_streak_steps": 6}
    )
    for _ in range(8):
        x = torch.randn(8, 16) * 3e5  # features never normalised: past fp16's 65504
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        gf.step(loss=loss)
    gf.close()
    alert = gradflow_server.wait_for_alert(gf.run_id, "scaler_overflow_streak")
    assert alert["evidence"]["cause"] == "input_overflow", alert
    assert alert["evidence"]["input_absmax"] > 65504
    assert "the batch is the likely cause" in alert["detail"]


class EncoderHead(nn.Module):
    """Two groups the loop calls itself, never through a forward of the whole."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)


def test_an_fp16_overflow_from_the_inputs_of_a_loop_calling_submodules(gradflow_server):
    """The loop calls model.encoder(x) and model.head(h), never model(x): the batch
    is measured at the groups' roots (the head's input, an activation, is not)."""
    model = EncoderHead()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    gf = watch(
        gradflow_server, model, optimizer, scaler=scaler, detectors={"overflow_streak_steps": 6}
    )
    for _ in range(8):
        x = torch.randn(8, 16) * 3e5  # past fp16's 65504
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model.head(model.encoder(x)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        gf.step(loss=loss)
    gf.close()
    alert = gradflow_server.wait_for_alert(gf.run_id, "scaler_overflow_streak")
    assert alert["evidence"]["cause"] == "input_overflow", alert
    assert alert["evidence"]["input_absmax"] > 65504


def test_the_first_steps_already_hint_at_a_cut_encoder(gradflow_server):
    """Long before the 50-step verdict, the second step says what the first showed."""
    model = PromptAgent(detach_prompt=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = watch(gradflow_server, model, optimizer)
    train(model, optimizer, gf, 3)
    gf.close()
    hint = gradflow_server.wait_for_alert(gf.run_id, "first_step_hint")
    assert (hint["severity"], hint["first_step"], hint["opened_step"]) == ("info", 0, 1)
    named = hint["evidence"]["no_gradient"]
    assert named and all(m.startswith("qwen") for m in named), named
    assert "qwen.layers.0.mlp.up_proj" in named
    assert not gradflow_server.serious(gf.run_id)


def test_bf16_linear_layers_frozen_by_rounding_are_found_like_norm_weights(gradflow_server):
    """A bf16 model at an lr whose AdamW steps are all below half a bf16 ulp: every
    group's linear layers and embeddings keep their values exactly."""
    model = PromptAgent().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    gf = watch(
        gradflow_server, model, optimizer, updates_every=2, detectors={"frozen_norm_steps": 6}
    )
    train(model, optimizer, gf, 10)
    gf.close()
    for group in ("qwen", "agent"):
        alert = gradflow_server.wait_for_alert(gf.run_id, "update_rounded_away", subject=group)
        evidence = alert["evidence"]
        assert evidence["cause"] == "low_precision_underflow", alert
        assert evidence["rounded_away"] >= 0.98 * evidence["intended_nonzero"], evidence
    name = "qwen.layers.0.mlp.up_proj.weight"
    lost = gradflow_server.series(gf.run_id, "rounded_away", name)
    meant = gradflow_server.series(gf.run_id, "intended_nonzero", name)
    assert [s for s, _ in lost] == [0, 2, 4, 6, 8], lost
    # Only elements near 0 moved: over 98 % of the intended changes rounded away.
    assert all(r >= 0.98 * m for (_, r), (_, m) in zip(lost, meant)), (lost, meant)


def test_a_large_model_checked_a_slice_at_a_time_is_still_found(gradflow_server, monkeypatch):
    """A model past the per-step budget of the update check (here the budget is cut
    to a few of PromptAgent's layers): each checked step measures the next slice of
    its bf16 parameters, every parameter in turn, and the groups frozen by rounding
    are still found: a group is judged on the reports that hold some of it, so one
    that fits in a single slice is found within two rounds of the slices (here 4
    slices of a check every 2nd step: by step 14; all at once: by step 8)."""
    from gradflow.measurement import updates

    monkeypatch.setattr(updates, "SLICE_ELEMENTS", 15_000)
    model = PromptAgent().to(torch.bfloat16)
    tracked = [n for n, p in model.named_parameters() if "norm" not in n and p.numel() > 0]
    assert sum(p.numel() for p in model.parameters()) > 3 * updates.SLICE_ELEMENTS
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    gf = watch(
        gradflow_server, model, optimizer, updates_every=2, detectors={"frozen_norm_steps": 6}
    )
    train(model, optimizer, gf, 16)
    gf.close()
    for group in ("qwen", "agent"):
        alert = gradflow_server.wait_for_alert(gf.run_id, "update_rounded_away", subject=group)
        assert alert["evidence"]["cause"] == "low_precision_underflow", alert
        assert alert["opened_step"] <= 14, alert
    # Each parameter is measured on some checked steps, not all: slices in turn.
    measured = {
        n: [s for s, _ in gradflow_server.series(gf.run_id, "rounded_away", n)] for n in tracked
    }
    assert all(measured.values()), {n: s for n, s in measured.items() if not s}
    assert all(len(s) < 8 for s in measured.values()), measured
    checked = sorted({s for steps in measured.values() for s in steps})
    assert checked == [0, 2, 4, 6, 8, 10, 12, 14], checked


def test_bf16_layers_at_a_healthy_lr_are_not_frozen(gradflow_server):
    model = PromptAgent().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gf = watch(
        gradflow_server, model, optimizer, updates_every=2, detectors={"frozen_norm_steps": 6}
    )
    train(model, optimizer, gf, 10)
    gf.close()
    kinds = [a["kind"] for a in gradflow_server.alerts(gf.run_id)]
    assert "update_rounded_away" not in kinds, kinds
    name = "qwen.layers.0.mlp.up_proj.weight"
    assert all(v > 0 for _, v in gradflow_server.series(gf.run_id, "update_norm", name))
