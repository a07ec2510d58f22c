"""`ReduceLROnPlateau` read the wrong way round (protocol v1.10's
`plateau_mode_mismatch`): in its default mode "min", stepped with an accuracy that
rises, it cuts the lr at every `patience` evaluations while the model improves
(md-mohaiminul/ViS4mer#4). Its healthy twins stay silent: the same accuracy in mode
"max", and a validation loss that falls and then flattens in mode "min", whose lr
cuts are the scheduler doing its job."""

from __future__ import annotations

from typing import List

import torch
from conftest import new_run_id
from torch import nn

import gradflow
from gradflow.capture import plateau

LR = 1e-2


def classifier_run(gradflow_server, mode: str, metric: str, steps: int = 200):
    """A 4-class classifier on a quadrant rule (AdamW 1e-2), evaluated every 10 steps
    on held-out data; the plateau scheduler (patience 1, factor 0.2) is stepped with
    the held-out accuracy or loss. Returns the run id, the metric's readings and the
    final lr."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, mode=mode, patience=1, factor=0.2
    )
    g = torch.Generator().manual_seed(1)
    held_out = torch.randn(512, 16, generator=torch.Generator().manual_seed(999))

    def labels(x: torch.Tensor) -> torch.Tensor:
        return ((x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()) % 4

    readings: List[float] = []
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id())
    for i in range(steps):
        x = torch.randn(8, 16, generator=g)
        loss = nn.functional.cross_entropy(model(x), labels(x))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if i % 10 == 9:
            with torch.no_grad():
                out = model(held_out)
                if metric == "accuracy":
                    readings.append(float((out.argmax(1) == labels(held_out)).float().mean()))
                else:
                    readings.append(float(nn.functional.cross_entropy(out, labels(held_out))))
            scheduler.step(readings[-1])
        gf.step(loss=loss)
    gf.close()
    assert gradflow_server.run(gf.run_id)["step_count"] == steps
    return gf.run_id, readings, optimizer.param_groups[0]["lr"]


def test_an_accuracy_in_min_mode_is_named(gradflow_server):
    run_id, accuracy, lr = classifier_run(gradflow_server, "min", "accuracy")
    assert accuracy[-1] > accuracy[0] + 0.2, accuracy  # the model learned
    assert lr < LR * 0.2**3, lr  # and the lr was cut again and again
    alert = gradflow_server.wait_for_alert(
        run_id, "plateau_mode_mismatch", subject="ReduceLROnPlateau"
    )
    assert alert["severity"] == "warning"
    assert alert["evidence"]["measured"] >= plateau.CUTS
    assert "mode='max'" in alert["fix"]
    assert [a["kind"] for a in gradflow_server.serious(run_id)] == ["plateau_mode_mismatch"]


def test_the_same_accuracy_in_max_mode_is_silent(gradflow_server):
    run_id, accuracy, _ = classifier_run(gradflow_server, "max", "accuracy")
    assert accuracy[-1] > accuracy[0] + 0.2, accuracy
    assert gradflow_server.serious(run_id) == []


def test_a_validation_loss_that_flattens_in_min_mode_is_silent(gradflow_server):
    run_id, loss, lr = classifier_run(gradflow_server, "min", "loss", steps=400)
    assert min(loss) < loss[0] * 0.7, loss  # it fell
    assert lr < LR, lr  # the plateau cut the lr: the look-alike's numbers
    assert gradflow_server.serious(run_id) == []


def test_the_scheduler_class_is_restored_at_close(gradflow_server):
    original = torch.optim.lr_scheduler.ReduceLROnPlateau.step
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id())
    assert torch.optim.lr_scheduler.ReduceLROnPlateau.step is not original
    gf.close()
    assert torch.optim.lr_scheduler.ReduceLROnPlateau.step is original


def test_kendall_tau_reads_a_steady_trend():
    assert plateau._kendall_tau([1, 2, 3, 4]) == 1.0
    assert plateau._kendall_tau([4, 3, 2, 1]) == -1.0
    assert abs(plateau._kendall_tau([1, 3, 1, 3, 1, 3])) < 0.3


def _findings(mode: str, metrics: List[float]) -> List[str]:
    """The findings of a plateau scheduler (patience 0) stepped with `metrics`."""
    optimizer = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    watch = plateau.PlateauWatch(optimizer)
    try:
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode, patience=0)
        for metric in metrics:
            scheduler.step(metric)
    finally:
        watch.remove()
    return [f["kind"] for f in watch.findings()]


def test_a_first_reading_s_jitter_is_not_an_improvement():
    """A validation loss in mode "max" whose second reading is 0.1 % above its first
    (selene's loss at one seed) and that then falls to 0.47 never improved: named.
    A loss that fell from 2.0 to 1.0 and overfits back up in mode "min" did improve
    (by far more than it has since risen above its first reading): silent, though
    its latest readings climb steadily."""
    falling = [0.6924, 0.6932] + [0.69 - 0.02 * i for i in range(12)]
    assert _findings("max", falling) == ["plateau_mode_mismatch"]
    overfit = [2.0, 1.0] + [1.05 + 0.05 * i for i in range(12)]
    assert plateau._kendall_tau(overfit) >= plateau.TREND
    assert _findings("min", overfit) == []
