"""A real Lightning ``Trainer`` on CPU through ``GradflowCallback``: gradients before
clipping, accumulated over micro-batches, unscaled under a loss scaler, a cut graph
diagnosed, against the real server."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import lightning
import pytest
import torch
from conftest import new_run_id
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from gradflow.integrations.lightning import GradflowCallback


class PromptAgent(lightning.LightningModule):
    """An encoder writes a prompt that an agent consumes; ``detach`` cuts the encoder
    off backward, as a stray ``torch.no_grad()`` would."""

    def __init__(self, detach: bool = False) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32))
        self.agent = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.detach = detach

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        if self.detach:
            with torch.no_grad():
                prompt = self.encoder(x)
        else:
            prompt = self.encoder(x)
        return self.agent(prompt).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Truth(lightning.Callback):
    """What Lightning itself has at ``on_before_optimizer_step`` (after unscaling, before
    clipping): each group's gradient norm, and each micro-batch's loss."""

    def __init__(self) -> None:
        self.norms: List[Dict[str, float]] = []
        self.losses: List[float] = []
        self.clipped: List[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        norms = {}
        for group in ("encoder", "agent"):
            grads = [p.grad for p in getattr(pl_module, group).parameters() if p.grad is not None]
            norms[group] = math.sqrt(sum(float(g.float().norm()) ** 2 for g in grads))
        self.norms.append(norms)


def fit(
    server,
    model: lightning.LightningModule,
    steps: int,
    batches: int,
    watch_options: Optional[Dict[str, Any]] = None,
    **trainer_options: Any,
):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(batches * 8, 16))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    callback = GradflowCallback(
        run_id=new_run_id("pl"), server=server.url, on_alert=None, **(watch_options or {})
    )
    truth = Truth()
    trainer = lightning.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=[callback, truth],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_options,
    )
    trainer.fit(model, loader)
    return callback.gf.run_id, truth


def group_norms(server, run_id: str, group: str) -> Dict[int, float]:
    return {step: value for step, value in server.series(run_id, "grad_norm", group)}


def test_lightning_reports_gradients_before_clipping_with_accumulation(gradflow_server):
    torch.manual_seed(0)
    run_id, truth = fit(
        gradflow_server,
        PromptAgent(),
        steps=6,
        batches=12,
        accumulate_grad_batches=2,
        gradient_clip_val=1e-3,
    )
    run = gradflow_server.run(run_id)
    assert (run["step_count"], run["first_step"], run["last_step"]) == (6, 0, 5)
    assert {p["group"] for p in run["params"]} == {"encoder", "agent"}
    assert run["config"]["user"]["lightning"]["accumulate_grad_batches"] == 2
    assert len(truth.norms) == 6
    for group in ("encoder", "agent"):
        reported = group_norms(gradflow_server, run_id, group)
        for step, norms in enumerate(truth.norms):
            # Far above the clip value: the norm the model really had, not the clipped one.
            assert norms[group] > 1e-2
            assert reported[step] == pytest.approx(norms[group], rel=1e-4), (group, step)
    # The loss of a step is the mean of its two micro-batches' losses.
    loss = dict(gradflow_server.series(run_id, "loss"))
    for step in range(6):
        expected = (truth.losses[2 * step] + truth.losses[2 * step + 1]) / 2
        assert loss[step] == pytest.approx(expected, rel=1e-5)
    # Both micro-batches' backward passes reached every module.
    hits = gradflow_server.series(run_id, "hook_hits", "encoder.0")
    assert [value for _, value in hits] == [2] * 6
    assert gradflow_server.serious(run_id) == []


def test_lightning_under_a_loss_scaler_reports_unscaled_gradients(gradflow_server):
    torch.manual_seed(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6)
    run_id, truth = fit(
        gradflow_server,
        PromptAgent(),
        steps=5,
        batches=5,
        gradient_clip_val=1e-3,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )
    run = gradflow_server.run(run_id)
    assert run["precision"]["loss_scaler"] == "dynamic", run["precision"]
    scale = gradflow_server.series(run_id, "scaler_scale")
    assert [value for _, value in scale] == [2.0**6] * 5
    # Lightning unscales before it clips: no clip_before_unscale, nothing else either.
    assert gradflow_server.serious(run_id) == []
    for group in ("encoder", "agent"):
        reported = group_norms(gradflow_server, run_id, group)
        for step, norms in enumerate(truth.norms):
            assert reported[step] == pytest.approx(norms[group], rel=1e-3), (group, step)


def test_lightning_cut_graph_is_diagnosed(gradflow_server):
    torch.manual_seed(0)
    run_id, _ = fit(
        gradflow_server,
        PromptAgent(detach=True),
        steps=14,
        batches=14,
        watch_options={"detectors": {"stuck_zero_steps": 10}},
    )
    alert = gradflow_server.wait_for_alert(run_id, "grad_stuck_zero", subject="encoder")
    assert alert["severity"] == "critical"
    assert alert["evidence"]["cause"] == "backward_not_reached", alert
    assert gradflow_server.serious(run_id) == [alert]


class BadBatch(PromptAgent):
    """One batch whose targets are ten thousand off the others' (a mislabelled sample):
    the gradients of that step are thousands of times their usual norm."""

    def __init__(self, bad_step: int) -> None:
        super().__init__()
        self.bad_step = bad_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        target = 1e4 if self.global_step == self.bad_step else 0.0
        return (self.agent(self.encoder(x)) - target).pow(2).mean()


@pytest.mark.parametrize("clip", [1.0, None], ids=["clipped", "unclipped"])
def test_lightning_a_bad_batch_the_clip_cut_is_no_explosion(gradflow_server, clip):
    torch.manual_seed(0)
    options: Dict[str, Any] = {} if clip is None else {"gradient_clip_val": clip}
    run_id, truth = fit(gradflow_server, BadBatch(bad_step=40), steps=60, batches=60, **options)
    # The bad batch's gradients were thousands of times the usual, before the clip.
    usual = sorted(n["agent"] for n in truth.norms[:40])[20]
    assert truth.norms[40]["agent"] > 1000 * usual, (truth.norms[40], usual)
    assert gradflow_server.run(run_id)["step_count"] == 60
    explosions = [a for a in gradflow_server.alerts(run_id) if a["kind"] == "grad_explosion"]
    if clip is None:
        # Nothing bounded the update: the spike is the alert it always was.
        assert explosions, gradflow_server.alerts(run_id)
        assert {a["evidence"]["cause"] for a in explosions} == {"spike"}
        assert {a["first_step"] for a in explosions} == {40}
    else:
        # Lightning cut it to max_norm 1 before the step: one batch, one ordinary update.
        assert explosions == [], explosions
        stored = gradflow_server.series(run_id, "metric", "grad_clip_max_norm")
        assert [value for _, value in stored] == [clip] * 60
