"""Corpus: loops that run, log a loss and update nothing, or keep only part of the
gradient: everything frozen, gradients cleared at the wrong place, reentrant
checkpointing over frozen inputs."""

from __future__ import annotations

import pytest
import torch
from corpus_support import (
    STEPS,
    add_lora,
    checkpoint_layers,
    lm_loss,
    moved,
    quickstart,
    snapshot,
    tiny_qwen,
    token_batches,
    train_step,
    verdict,
)

import gradflow


def frozen_adapter_model():
    """A LoRA model loaded "for inference": adapters and base all frozen, input
    gradients enabled (as `prepare_model_for_kbit_training` does), so backward runs."""
    model = tiny_qwen()
    for p in add_lora(model):
        p.requires_grad_(False)
    model.enable_input_require_grads()
    return model


def learns_nothing(server, model, optimizer, cause):
    """The run changes no weight, and gradflow says so at registration."""
    before = snapshot(model)
    run_id = quickstart(model, optimizer, train_step(model, optimizer))
    assert not moved(before, model)
    alert = verdict(server, run_id, "nothing_trains", "run", cause)
    assert alert["severity"] == "critical" and alert.get("step") is None, alert


def test_adapter_loaded_frozen_gives_an_empty_optimizer(gradflow_server, gradflow_env):
    """`PeftModel.from_pretrained` loads the adapter with `is_trainable=False`; the
    trainer groups the trainable parameters by weight decay into two empty groups and
    trains for the whole run with nothing to update.

    Thread: https://github.com/huggingface/trl/issues/6700
    """
    model = frozen_adapter_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": trainable, "weight_decay": 0.0}, {"params": [], "weight_decay": 0.01}], lr=1e-3
    )
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 0
    learns_nothing(gradflow_server, model, optimizer, "all_frozen")


def test_trainable_params_zero_with_an_optimizer_over_all_parameters(gradflow_server, gradflow_env):
    """The adapter came back frozen ("trainable params: 0"), the optimizer was built
    over `model.parameters()` (all frozen), the loss is logged and nothing learns.

    Thread: https://github.com/tloen/alpaca-lora/issues/352
    """
    model = frozen_adapter_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    learns_nothing(gradflow_server, model, optimizer, "all_frozen")


def test_zero_grad_inside_the_micro_batch_loop(gradflow_server, gradflow_env):
    """Gradient accumulation over 4 micro-batches with `zero_grad` called per micro-
    batch: every optimizer step sees only the last micro-batch's gradient.

    Threads: https://github.com/bytetriper/RAE/issues/67,
    https://github.com/pytorch/torchtitan/pull/3575
    """
    model = tiny_qwen()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = token_batches()
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

    run_id = quickstart(model, optimizer, step, steps=12)
    # What the optimizer stepped on is the last micro-batch's gradient alone.
    assert all(only_last)
    alert = verdict(gradflow_server, run_id, "accumulation_reset", "gradients")
    assert alert["evidence"]["resets"] == 3 and "about 4 times smaller" in alert["detail"], alert


def test_zero_grad_between_backward_and_step(gradflow_server, gradflow_env):
    """`optimizer.zero_grad()` moved between `backward()` and `step()`: the step finds
    no gradient (set to None) and the model never changes, while the loss is logged.

    Thread: https://github.com/Tony-Y/pytorch_warmup/issues/12
    """
    model = tiny_qwen()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = token_batches()
    before = snapshot(model)

    def step(_):
        loss = lm_loss(model, next(data))
        loss.backward()
        optimizer.zero_grad()  # the bug: clears what backward just computed
        optimizer.step()
        return loss

    run_id = quickstart(model, optimizer, step)
    assert not moved(before, model)
    # Backward reached every module on every step; the gradient was gone by the step.
    hits = gradflow_server.series(run_id, "hook_hits", "model.layers.0.mlp.up_proj")
    assert len(hits) == STEPS and all(value == 1 for _, value in hits), hits
    alert = verdict(gradflow_server, run_id, "grad_stuck_zero", "model", "cleared_before_step")
    assert "zero_grad" in alert["fix"], alert["fix"]


def test_reentrant_checkpointing_over_a_frozen_base_starves_lora(gradflow_server, gradflow_env):
    """LoRA on a frozen base with reentrant activation checkpointing and no
    `enable_input_require_grads()`: the checkpointed blocks' input does not require
    grad, so the adapters inside them never get a gradient ("lora_B nonzero: 0").

    Threads: https://github.com/locuslab/open-unlearning/issues/178,
    https://github.com/microsoft/LoRA/issues/120
    """
    model = tiny_qwen()
    adapters = add_lora(model)
    # A trained head (the projector of a LLaVA-style model) keeps the loss
    # differentiable, so backward runs and nothing complains.
    model.lm_head.requires_grad_(True)
    checkpoint_layers(model, reentrant=True)
    optimizer = torch.optim.AdamW(adapters + list(model.lm_head.parameters()), lr=1e-3)
    before = snapshot(model)
    # The client says it at once, naming the checkpoint and the fix.
    with pytest.warns(gradflow.GradflowWarning, match="reentrant activation checkpoint") as seen:
        run_id = quickstart(model, optimizer, train_step(model, optimizer))
    # The client's own notice (the server's alert, also warned, says it again).
    (notice,) = [w for w in seen if "runs inside a reentrant" in str(w.message)]
    assert "enable_input_require_grads()" in str(notice.message)
    assert "use_reentrant=False" in str(notice.message)
    changed = moved(before, model)
    assert not [n for n in changed if "lora_" in n] and "lm_head.weight" in changed
    alert = verdict(
        gradflow_server, run_id, "grad_stuck_zero", "model.layers", cause="backward_not_reached"
    )
    # The alert itself names the checkpoint, not a torch.no_grad() the user never wrote,
    # and gives the checkpoint's fix.
    assert alert["evidence"]["graph_cut"]["via"] == "reentrant_checkpoint", alert["evidence"]
    assert "reentrant activation checkpoint" in alert["detail"], alert["detail"]
    assert "enable_input_require_grads()" in alert["fix"], alert["fix"]
    assert "use_reentrant" in alert["fix"], alert["fix"]
