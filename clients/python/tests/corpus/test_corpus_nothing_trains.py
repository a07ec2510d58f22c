"""Corpus: loops that run, log a loss and update nothing, or keep only part of the
gradient: everything frozen, gradients cleared at the wrong place, reentrant
checkpointing over frozen inputs."""

from __future__ import annotations

import pytest
import torch
from corpus_support import (
    FIRST_STEPS,
    RESET_STEPS,
    STUCK_WINDOW,
    add_lora,
    checkpoint_layers,
    expects,
    hf_trainer,
    judge,
    lm_loss,
    moved,
    one_thread,
    quickstart,
    seeded,
    snapshot,
    three_windows,
    tiny_qwen,
    token_batches,
    train_step,
)

import gradflow


def frozen_adapter_model(seed: int):
    """A LoRA model loaded "for inference": adapters and base all frozen, input
    gradients enabled (as `prepare_model_for_kbit_training` does), so backward runs."""
    model = tiny_qwen(seed)
    for p in add_lora(model):
        p.requires_grad_(False)
    model.enable_input_require_grads()
    return model


def learns_nothing(request, server, model, optimizer, seed):
    """The run changes no weight, and gradflow says so at registration (a registration
    check: the run goes on for three times the first-steps window)."""
    before = snapshot(model)
    step = train_step(model, optimizer, seed=seed)
    run_id = quickstart(model, optimizer, step, steps=three_windows(FIRST_STEPS))
    assert not moved(before, model)
    alert = judge(request, server, run_id)
    assert alert["severity"] == "critical" and alert.get("step") is None, alert


@seeded
@expects("nothing_trains", "run", "all_frozen")
def test_adapter_loaded_frozen_gives_an_empty_optimizer(
    request, gradflow_server, gradflow_env, seed
):
    """`PeftModel.from_pretrained` loads the adapter with `is_trainable=False`; the
    trainer groups the trainable parameters by weight decay into two empty groups and
    trains for the whole run with nothing to update. From the thread: TRL's SFT
    trainer, AdamW at its default lr 2e-5.

    Thread: https://github.com/huggingface/trl/issues/6700
    """
    model = frozen_adapter_model(seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": trainable, "weight_decay": 0.0}, {"params": [], "weight_decay": 0.01}], lr=2e-5
    )
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 0
    learns_nothing(request, gradflow_server, model, optimizer, seed)


@seeded
@expects("nothing_trains", "run", "all_frozen")
def test_adapter_loaded_frozen_under_the_trainer(
    request, gradflow_server, gradflow_env, tmp_path, seed
):
    """The same frozen adapter trained by the Hugging Face `Trainer` itself, watched
    through its `GradflowCallback`: the Trainer builds its own two weight-decay groups
    from the parameters that require grad (none) and runs every step. From the thread:
    the Trainer's loop, lr 2e-5. A variant of the hand-written loop above.

    Thread: https://github.com/huggingface/trl/issues/6700
    """
    model = frozen_adapter_model(seed)
    before = snapshot(model)
    steps = three_windows(FIRST_STEPS)
    batches = token_batches(seed + 1)
    trainer, callback = hf_trainer(model, tmp_path, steps, seed, batches, learning_rate=2e-5)
    with one_thread():
        trainer.train()
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == 0
    assert not moved(before, model)
    alert = judge(request, gradflow_server, callback.gf.run_id)
    assert alert["severity"] == "critical" and alert.get("step") is None, alert


@seeded
@expects("nothing_trains", "run", "all_frozen")
def test_trainable_params_zero_with_an_optimizer_over_all_parameters(
    request, gradflow_server, gradflow_env, seed
):
    """The adapter came back frozen ("trainable params: 0"), the optimizer was built
    over `model.parameters()` (all frozen), the loss is logged and nothing learns.
    From the thread: alpaca-lora's AdamW at lr 3e-4.

    Thread: https://github.com/tloen/alpaca-lora/issues/352
    """
    model = frozen_adapter_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    learns_nothing(request, gradflow_server, model, optimizer, seed)


@seeded
@expects("accumulation_reset", "gradients", "reset_between_backwards")
def test_zero_grad_inside_the_micro_batch_loop(request, gradflow_server, gradflow_env, seed):
    """Gradient accumulation over 4 micro-batches with `zero_grad` called per micro-
    batch: every optimizer step sees only the last micro-batch's gradient. The rule
    wants 3 reports running; the run is 12 optimizer steps (48 backward passes). The
    threads give no optimizer settings: AdamW at lr 1e-3.

    Threads: https://github.com/bytetriper/RAE/issues/67,
    https://github.com/pytorch/torchtitan/pull/3575
    """
    model = tiny_qwen(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = token_batches(seed + 1)
    only_last = []

    def step(_):
        micro = [next(data) for _ in range(4)]
        for tokens in micro:
            optimizer.zero_grad(set_to_none=True)  # the bug: inside the micro-batch loop
            loss = lm_loss(model, tokens) / 4
            loss.backward()
        (last,) = torch.autograd.grad(lm_loss(model, micro[-1]) / 4, model.lm_head.weight)
        only_last.append(torch.allclose(model.lm_head.weight.grad, last, atol=1e-7))
        optimizer.step()
        return loss

    run_id = quickstart(model, optimizer, step, steps=RESET_STEPS)
    # What the optimizer stepped on is the last micro-batch's gradient alone.
    assert all(only_last)
    alert = judge(request, gradflow_server, run_id)
    assert alert["evidence"]["resets"] == 3 and "about 4 times smaller" in alert["detail"], alert


@seeded
@expects(
    "grad_stuck_zero",
    ("model.embed_tokens", "model.layers", "model.norm", "lm_head"),
    "cleared_before_step",
)
def test_zero_grad_between_backward_and_step(request, gradflow_server, gradflow_env, seed):
    """`optimizer.zero_grad()` moved between `backward()` and `step()`: the step finds
    no gradient (set to None) and the model never changes, while the loss is logged.
    The thread gives no optimizer settings: AdamW at lr 1e-3.

    Thread: https://github.com/Tony-Y/pytorch_warmup/issues/12
    """
    model = tiny_qwen(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = token_batches(seed + 1)
    before = snapshot(model)

    def step(_):
        loss = lm_loss(model, next(data))
        loss.backward()
        optimizer.zero_grad()  # the bug: clears what backward just computed
        optimizer.step()
        return loss

    steps = three_windows(STUCK_WINDOW)
    run_id = quickstart(model, optimizer, step, steps=steps)
    assert not moved(before, model)
    # Backward reached every module on every step; the gradient was gone by the step.
    hits = gradflow_server.series(run_id, "hook_hits", "model.layers.0.mlp.up_proj")
    assert len(hits) == steps and all(value == 1 for _, value in hits), hits
    alert = judge(request, gradflow_server, run_id)
    assert "zero_grad" in alert["fix"], alert["fix"]


@seeded
@expects("grad_stuck_zero", "model.layers", "backward_not_reached")
def test_reentrant_checkpointing_over_a_frozen_base_starves_lora(
    request, gradflow_server, gradflow_env, seed
):
    """LoRA on a frozen base with reentrant activation checkpointing and no
    `enable_input_require_grads()`: the checkpointed blocks' input does not require
    grad, so the adapters inside them never get a gradient ("lora_B nonzero: 0").
    The threads give no optimizer settings: AdamW at lr 1e-3.

    Threads: https://github.com/locuslab/open-unlearning/issues/178,
    https://github.com/microsoft/LoRA/issues/120
    """
    model = tiny_qwen(seed)
    adapters = add_lora(model)
    # A trained head (the projector of a LLaVA-style model) keeps the loss
    # differentiable, so backward runs and nothing complains.
    model.lm_head.requires_grad_(True)
    checkpoint_layers(model, reentrant=True)
    optimizer = torch.optim.AdamW(adapters + list(model.lm_head.parameters()), lr=1e-3)
    before = snapshot(model)
    # The client says it at once, naming the checkpoint and the fix.
    with pytest.warns(gradflow.GradflowWarning, match="reentrant activation checkpoint") as seen:
        step = train_step(model, optimizer, seed=seed)
        run_id = quickstart(model, optimizer, step, steps=three_windows(STUCK_WINDOW))
    # The client's own notice (the server's alert, also warned, says it again).
    (notice,) = [w for w in seen if "runs inside a reentrant" in str(w.message)]
    assert "enable_input_require_grads()" in str(notice.message)
    assert "use_reentrant=False" in str(notice.message)
    changed = moved(before, model)
    assert not [n for n in changed if "lora_" in n] and "lm_head.weight" in changed
    alert = judge(request, gradflow_server, run_id)
    # The alert itself names the checkpoint, not a torch.no_grad() the user never wrote,
    # and gives the checkpoint's fix.
    assert alert["evidence"]["graph_cut"]["via"] == "reentrant_checkpoint", alert["evidence"]
    assert "reentrant activation checkpoint" in alert["detail"], alert["detail"]
    assert "enable_input_require_grads()" in alert["fix"], alert["fix"]
    assert "use_reentrant" in alert["fix"], alert["fix"]
