"""Corpus: low precision. fp16 overflowing on every step, clipping the scaled
gradients, bf16 weights whose updates round away."""

from __future__ import annotations

import torch
from corpus_support import (
    FIRST_STEPS,
    NORM_WINDOW,
    OVERFLOW_WINDOW,
    Classifier,
    amp_loop,
    class_loss,
    expects,
    judge,
    moved,
    quickstart,
    seeded,
    snapshot,
    three_windows,
    tiny_qwen,
    train_step,
)
from torch import nn

NORMS = ("model.layers", "model.norm")


@seeded
@expects("scaler_overflow_streak", "scaler", "overflow", also=["loss_nonfinite"])
def test_fp16_overflow_on_every_step(request, gradflow_server, gradflow_env, seed):
    """fp16 mixed precision where the activations themselves overflow: every step is
    skipped and the loss scale keeps halving ("Overflow detected. Skipping step"), the
    model never learns. The thread gives no optimizer settings: AdamW at lr 1e-3.

    Thread: https://github.com/deepspeedai/DeepSpeed/issues/697
    """
    model = Classifier(hidden=64, seed=seed)
    with torch.no_grad():  # activations past fp16's 65504 in the hidden layer
        model.embed.weight.mul_(1e4)
        model.hidden.weight.mul_(1e4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    before = snapshot(model)
    step = train_step(
        model, optimizer, class_loss, scaler=scaler, autocast=torch.float16, seed=seed
    )
    run_id = quickstart(model, optimizer, step, steps=three_windows(OVERFLOW_WINDOW), scaler=scaler)
    assert not moved(before, model) and scaler.get_scale() <= 65536.0 / 2**16
    judge(request, gradflow_server, run_id)


@seeded
@expects("clip_before_unscale", "gradients", "clip_before_unscale")
def test_clipping_the_scaled_gradients(request, gradflow_server, gradflow_env, seed):
    """`clip_grad_norm_` under AMP without `scaler.unscale_` first: the norm clipped
    is the scaled one (x65536), so every gradient is cut to max_norm/scale after
    unscaling and SGD barely moves ("the loss does not decrease anymore"). The thread
    gives no optimizer settings: SGD at lr 0.1, clip 1.0.

    Thread: https://github.com/pytorch/pytorch/issues/40907
    """
    norms = []

    def clip(loop):  # the bug: no scaler.unscale_(optimizer) before it
        norms.append(nn.utils.clip_grad_norm_(loop.model.parameters(), 1.0).item())

    loop = amp_loop(seed, clip)
    run_id = quickstart(
        loop.model, loop.optimizer, loop.step, steps=three_windows(FIRST_STEPS), scaler=loop.scaler
    )
    # The clipped norm was the scaled one: the step used 1/65536 of the clip.
    assert min(norms) > 1000.0
    alert = judge(request, gradflow_server, run_id)
    assert alert["evidence"]["measured"] == 65536


@seeded
@expects("clip_before_unscale", "gradients", "clip_before_unscale")
def test_value_clipping_the_scaled_gradients(request, gradflow_server, gradflow_env, seed):
    """The same AMP mistake with `clip_grad_value_`: the scaled gradients (x65536) are
    clamped to 1.0, so after unscaling no element is above 1/65536 and SGD barely
    moves. A variant of the norm clip above, from the same thread.

    Thread: https://github.com/pytorch/pytorch/issues/40907
    """
    used = []

    def clip(loop):  # the bug: no scaler.unscale_(optimizer) before it
        nn.utils.clip_grad_value_(loop.model.parameters(), 1.0)

    loop = amp_loop(seed, clip)

    def record(*_):  # what the step uses, unscaled by scaler.step
        used.append(max(p.grad.abs().max().item() for p in loop.model.parameters()))

    loop.optimizer.register_step_pre_hook(record)
    run_id = quickstart(
        loop.model, loop.optimizer, loop.step, steps=three_windows(FIRST_STEPS), scaler=loop.scaler
    )
    # Every element the step used was clamped to 1/scale: the clip cut them all.
    assert used and max(used) <= 1.0 / 65536 * 1.001, max(used)
    judge(request, gradflow_server, run_id)


@seeded
@expects("norm_weight_frozen", NORMS, "low_precision_underflow")
def test_bf16_norm_weights_never_move(request, gradflow_server, gradflow_env, seed):
    """The whole model trained in bf16 (no fp32 master copy): RMSNorm weights start
    at 1.0, where a bf16 step is 2^-7, and AdamW's ~lr updates round away: every
    normalization layer ends exactly at 1.0. The threads give no lr we can use at
    this size: AdamW at 1e-4.

    Threads: https://github.com/vllm-project/speculators/pull/765,
    https://github.com/fla-org/flame/issues/47
    """
    model = tiny_qwen(seed).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    before = snapshot(model)
    step = train_step(model, optimizer, seed=seed)
    run_id = quickstart(model, optimizer, step, steps=three_windows(NORM_WINDOW))
    changed = moved(before, model)
    assert (
        "model.norm.weight" not in changed
        and "model.layers.0.input_layernorm.weight" not in changed
    )
    judge(request, gradflow_server, run_id)


@seeded
@expects(
    "update_rounded_away",
    ("model.layers", "model.embed_tokens", "lm_head"),
    "low_precision_underflow",
    also=["norm_weight_frozen"],
)
def test_bf16_linear_layers_at_a_fine_tuning_lr(request, gradflow_server, gradflow_env, seed):
    """The model forced to bf16 at a fine-tuning lr: almost every intended update of
    the linear layers is below half a bf16 ulp and rounds away; the loss "decreases
    much more slowly" than in fp32. From the thread: lr 1e-5. The norm weights are
    frozen too (norm_weight_frozen).

    Thread: https://github.com/hp-l33/AiM/issues/10
    """
    model = tiny_qwen(seed).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    weight = model.model.layers[0].mlp.up_proj.weight
    start = weight.detach().clone()
    step = train_step(model, optimizer, seed=seed)
    run_id = quickstart(model, optimizer, step, steps=three_windows(NORM_WINDOW))
    # 60 AdamW steps of ~1e-5 each move every element in fp32; in bf16 most of them
    # never moved at all. Per step, 96-97 % of the intended changes round away after
    # the first (AdamW's first update is lr·sign(g), the largest it ever is).
    still = (weight.detach() == start).float().mean().item()
    assert still > 0.6, still
    alert = judge(request, gradflow_server, run_id)
    assert alert["evidence"]["min_lost_fraction"] >= 0.95, alert["evidence"]
