"""A healthy run that ends with an evaluation stays clean to its last step.

The usual end of training is an evaluation under ``torch.no_grad()``: a plain loop's
last eval, the Hugging Face ``Trainer``'s ``eval_strategy``, Lightning's validation.
Those forwards come after the last ``gf.step`` and have no backward pass: they are
not a training step, so nothing of them reaches the server. Each run is read back
through the server's API as the dashboard reads it: no alert above ``info``, every
trained module reached by backward on the last stored step, one stored step per
optimizer step, and a last gradient that is not 0."""

from __future__ import annotations

from typing import Any

import lightning
import torch
from conftest import PromptAgent, ServerProcess, batches, new_run_id, qwen_config, train
from test_lightning_trainer import PromptAgent as LightningAgent
from test_transformers_trainer import Tokens
from torch import nn
from transformers import Qwen2ForCausalLM, Trainer, TrainingArguments

import gradflow
from gradflow.integrations.lightning import GradflowCallback as LightningCallback
from gradflow.integrations.transformers import GradflowCallback as TrainerCallback


def assert_clean_end(server: ServerProcess, run_id: str, optimizer_steps: int) -> None:
    run = server.run(run_id)
    assert run["step_count"] == optimizer_steps, run
    raised = [(a["kind"], a["subject"], a["severity"]) for a in server.alerts(run_id)]
    assert [a for a in raised if a[2] != "info"] == [], raised
    last = run["last_step"]
    trained = [p for p in run["params"] if p["requires_grad"]]
    for module in sorted({p["module"] for p in trained}):
        hits = server.series(run_id, "hook_hits", module)
        assert hits[-1][0] == last and hits[-1][1] > 0, (module, hits[-3:])
    for group in sorted({p["group"] for p in trained}):
        norms = server.series(run_id, "grad_norm", group)
        assert norms[-1][0] == last and norms[-1][1] > 0, (group, norms[-3:])


def test_a_plain_loop_ending_with_a_no_grad_evaluation(gradflow_server):
    torch.manual_seed(0)
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id("eval"))
    train(model, optimizer, gf, 12)
    model.eval()
    with torch.no_grad():  # the final evaluation
        for tokens, target in batches(3, seed=7):
            accuracy = (model(tokens).argmax(-1) == target).float().mean()
    assert 0.0 <= float(accuracy) <= 1.0
    gf.close()
    assert_clean_end(gradflow_server, gf.run_id, 12)


def test_the_hf_trainer_with_an_eval_set(tmp_path, gradflow_server):
    torch.manual_seed(0)
    callback = TrainerCallback(run_id=new_run_id("hf-eval"), server=gradflow_server.url)
    trainer = Trainer(
        model=Qwen2ForCausalLM(qwen_config()),
        args=TrainingArguments(
            output_dir=str(tmp_path / "out"),
            max_steps=8,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            eval_strategy="steps",
            eval_steps=4,  # at step 4 and after the last step, 8
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        ),
        train_dataset=Tokens(32),
        eval_dataset=Tokens(8, seed=1),
        callbacks=[callback],
    )
    trainer.train()
    assert [e["step"] for e in trainer.state.log_history if "eval_loss" in e] == [4, 8]
    assert_clean_end(gradflow_server, callback.gf.run_id, 8)


class ValidatedAgent(LightningAgent):
    """The Lightning prompt agent with a validation set, run at the end of the epoch."""

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = self.agent(self.encoder(x)).pow(2).mean()
        self.log("val_loss", loss)
        return loss


def test_lightning_with_validation(gradflow_server):
    torch.manual_seed(0)
    train_data = torch.utils.data.TensorDataset(torch.randn(10 * 8, 16))
    val_data = torch.utils.data.TensorDataset(torch.randn(2 * 8, 16))
    callback = LightningCallback(run_id=new_run_id("pl-val"), server=gradflow_server.url)
    trainer = lightning.Trainer(
        accelerator="cpu",
        max_epochs=1,  # 10 steps, then the epoch's validation
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        ValidatedAgent(),
        torch.utils.data.DataLoader(train_data, batch_size=8),
        torch.utils.data.DataLoader(val_data, batch_size=8),
    )
    assert trainer.global_step == 10 and "val_loss" in trainer.callback_metrics
    assert_clean_end(gradflow_server, callback.gf.run_id, 10)


def test_a_registration_change_after_the_last_step_still_reaches_the_server(gradflow_server):
    """No backward after the last gf.step, but the model changed (a module unfrozen
    for the next phase): the amendment is sent alone, with no step data."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id("amend"))
    x = torch.randn(4, 8)
    for _ in range(5):
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        gf.step(loss=loss)
    model[0].requires_grad_(True)
    with torch.no_grad():
        model(x)
    gf.close()
    run = gradflow_server.run(gf.run_id)
    unfrozen = {p["name"]: p["requires_grad"] for p in run["params"]}
    assert unfrozen["0.weight"] is True and unfrozen["0.bias"] is True, run["params"]
    assert [a["step"] for a in run["amendments"]] == [5], run["amendments"]
    # The amendment's record carries no measurement: backward reached every trained
    # module on the last training step, and nothing says otherwise after it.
    for module in ("2",):
        hits = gradflow_server.series(gf.run_id, "hook_hits", module)
        assert hits[-1] == [4, 1], hits
