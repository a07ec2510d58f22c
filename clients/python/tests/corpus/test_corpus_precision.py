"""Corpus: low precision. fp16 overflowing on every step, clipping the scaled
gradients, bf16 weights whose updates round away."""

from __future__ import annotations

import torch
from corpus_support import (
    Classifier,
    class_loss,
    moved,
    quickstart,
    snapshot,
    tiny_qwen,
    train_step,
    verdict,
)
from torch import nn


def test_fp16_overflow_on_every_step(gradflow_server, gradflow_env):
    """fp16 mixed precision where the activations themselves overflow: every step is
    skipped and the loss scale keeps halving ("Overflow detected. Skipping step"), the
    model never learns.

    Thread: https://github.com/deepspeedai/DeepSpeed/issues/697
    """
    model = Classifier(hidden=64)
    with torch.no_grad():  # activations past fp16's 65504 in the hidden layer
        model.embed.weight.mul_(1e4)
        model.hidden.weight.mul_(1e4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    before = snapshot(model)
    step = train_step(model, optimizer, class_loss, scaler=scaler, autocast=torch.float16)
    run_id = quickstart(model, optimizer, step, steps=16, scaler=scaler)
    assert not moved(before, model) and scaler.get_scale() <= 65536.0 / 2**16
    verdict(gradflow_server, run_id, "scaler_overflow_streak", cause="overflow")


def test_clipping_the_scaled_gradients(gradflow_server, gradflow_env):
    """`clip_grad_norm_` under AMP without `scaler.unscale_` first: the norm clipped
    is the scaled one (x65536), so every gradient is cut to max_norm/scale after
    unscaling and SGD barely moves ("the loss does not decrease anymore").

    Thread: https://github.com/pytorch/pytorch/issues/40907
    """
    model = Classifier(hidden=64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    norms = []

    def clip(_):  # the bug: no scaler.unscale_(optimizer) before it
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())

    step = train_step(
        model, optimizer, class_loss, scaler=scaler, autocast=torch.float16, after_backward=clip
    )
    run_id = quickstart(model, optimizer, step, scaler=scaler)
    # The clipped norm was the scaled one: the step used 1/65536 of the clip.
    assert min(norms) > 1000.0
    alert = verdict(gradflow_server, run_id, "clip_before_unscale", "gradients")
    assert alert["evidence"]["measured"] == 65536


def test_bf16_norm_weights_never_move(gradflow_server, gradflow_env):
    """The whole model trained in bf16 (no fp32 master copy): RMSNorm weights start
    at 1.0, where a bf16 step is 2^-7, and AdamW's ~lr updates round away: every
    normalization layer ends exactly at 1.0.

    Threads: https://github.com/vllm-project/speculators/pull/765,
    https://github.com/fla-org/flame/issues/47
    """
    model = tiny_qwen().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    before = snapshot(model)
    run_id = quickstart(model, optimizer, train_step(model, optimizer), steps=24)
    changed = moved(before, model)
    assert (
        "model.norm.weight" not in changed
        and "model.layers.0.input_layernorm.weight" not in changed
    )
    verdict(gradflow_server, run_id, "norm_weight_frozen", cause="low_precision_underflow")


def test_bf16_linear_layers_at_a_fine_tuning_lr(gradflow_server, gradflow_env):
    """The model forced to bf16 at a fine-tuning lr (1e-5): almost every intended
    update of the linear layers is below half a bf16 ulp and rounds away; the loss
    "decreases much more slowly" than in fp32.

    Thread: https://github.com/hp-l33/AiM/issues/10
    """
    model = tiny_qwen().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    weight = model.model.layers[0].mlp.up_proj.weight
    start = weight.detach().clone()
    run_id = quickstart(model, optimizer, train_step(model, optimizer))
    # 52 AdamW steps of ~1e-5 each move every element in fp32; in bf16 most of them
    # never moved at all. Per step, 96-97 % of the intended changes round away after
    # the first (AdamW's first update is lr·sign(g), the largest it ever is).
    still = (weight.detach() == start).float().mean().item()
    assert still > 0.6, still
    alert = verdict(
        gradflow_server, run_id, "update_rounded_away", "model.layers", "low_precision_underflow"
    )
    assert alert["evidence"]["min_lost_fraction"] >= 0.95, alert["evidence"]
