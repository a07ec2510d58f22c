"""The Hugging Face ``Trainer`` through ``GradflowCallback``: a tiny random Qwen2 causal
LM, bf16 autocast on CPU, gradient accumulation, clipping, against the real server."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import pytest
import torch
from conftest import VOCAB, new_run_id, qwen_config
from transformers import Qwen2ForCausalLM, Trainer, TrainingArguments

from gradflow.integrations.transformers import GradflowCallback


class Tokens(torch.utils.data.Dataset):
    """Random token sequences: causal LM examples whose labels are their inputs."""

    def __init__(self, count: int, length: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (count, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def run_trainer(
    tmp_path, server, model, steps: int, watch_options: Optional[Dict[str, Any]] = None, **arguments
):
    settings: Dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    settings.update(arguments)
    callback = GradflowCallback(
        run_id=new_run_id("hf"), server=server.url, on_alert=None, **(watch_options or {})
    )
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**settings),
        train_dataset=Tokens(4 * steps * settings.get("gradient_accumulation_steps", 1)),
        callbacks=[callback],
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return callback.gf.run_id, logs


def total_grad_norms(server, run_id: str) -> Dict[int, float]:
    """Per step, the gradient norm over every reported module (what clip_grad_norm_
    measures over the whole model)."""
    modules = {p["module"] for p in server.run(run_id)["params"] if p["requires_grad"]}
    squares: Dict[int, float] = {}
    for module in modules:
        for step, value in server.series(run_id, "grad_norm", module):
            squares[step] = squares.get(step, 0.0) + value * value
    return {step: math.sqrt(sq) for step, sq in squares.items()}


def test_trainer_bf16_with_accumulation_and_clipping(tmp_path, gradflow_server):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen_config())
    run_id, logs = run_trainer(
        tmp_path,
        gradflow_server,
        model,
        12,
        bf16=True,
        gradient_accumulation_steps=2,
        max_grad_norm=0.05,  # clips every step: the reported norms must be the raw ones
    )
    run = gradflow_server.run(run_id)
    assert run["step_count"] == 12 and (run["first_step"], run["last_step"]) == (1, 12)
    assert {p["group"] for p in run["params"]} >= {"model.layers", "lm_head"}
    assert run["config"]["user"]["trainer"]["gradient_accumulation_steps"] == 2

    # The Trainer logs each step's loss and its gradient norm before clipping.
    loss = dict(gradflow_server.series(run_id, "loss"))
    norms = total_grad_norms(gradflow_server, run_id)
    for step, entry in enumerate(logs, start=1):
        assert loss[step] == pytest.approx(entry["loss"], abs=2e-3), (step, loss, logs)
        assert entry["grad_norm"] > 0.05, "the test needs clipping to be active"
        assert norms[step] == pytest.approx(entry["grad_norm"], rel=1e-3), (step, norms, logs)
    # The clip's bound, which those raw norms went through before the step.
    bound = gradflow_server.series(run_id, "metric", "grad_clip_max_norm")
    assert [value for _, value in bound] == [0.05] * 12
    # Two backward passes reached every module in each optimizer step.
    hits = gradflow_server.series(run_id, "hook_hits", "model.layers.1.mlp.down_proj")
    assert [value for _, value in hits] == [2] * 12
    assert gradflow_server.serious(run_id) == []


def test_trainer_bf16_weights_show_norms_frozen_by_rounding(tmp_path, gradflow_server):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen_config()).to(torch.bfloat16)
    run_id, _ = run_trainer(
        tmp_path,
        gradflow_server,
        model,
        12,
        learning_rate=3e-4,
        watch_options={"detectors": {"frozen_norm_steps": 10}},
    )
    alert = gradflow_server.wait_for_alert(run_id, "norm_weight_frozen", subject="model.layers")
    assert alert["evidence"]["cause"] == "low_precision_underflow", alert
