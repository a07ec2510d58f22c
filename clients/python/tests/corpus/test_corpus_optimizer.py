"""Corpus: what the optimizer is given. Learning-rate schedules stepped at the wrong
rate, modules left out of the parameter groups or put in the wrong one, clipping in
the wrong place."""

from __future__ import annotations

import torch
from corpus_support import (
    class_loss,
    lm_loss,
    moved,
    quickstart,
    snapshot,
    tiny_qwen,
    token_batches,
    train_step,
    verdict,
)
from torch import nn
from transformers import get_linear_schedule_with_warmup


def test_warmup_scheduler_stepped_per_epoch(gradflow_server, gradflow_env):
    """`get_polynomial_decay_schedule_with_warmup` (a per-step schedule) stepped once
    per epoch by the training framework: its factor is 0 for the whole first epoch,
    so the model does not train at all during it.

    Thread: https://github.com/huggingface/transformers/issues/20916
    """
    model = tiny_qwen()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 100, 1000)
    steps_per_epoch = 200  # the run below stays inside the first epoch

    def per_epoch(i):
        if (i + 1) % steps_per_epoch == 0:
            scheduler.step()

    before = snapshot(model)
    run_id = quickstart(model, optimizer, train_step(model, optimizer, after_step=per_epoch))
    assert optimizer.param_groups[0]["lr"] == 0.0 and not moved(before, model)
    verdict(gradflow_server, run_id, "norm_weight_frozen", cause="zero_lr")


def test_schedule_length_too_short_decays_lr_to_zero(gradflow_server, gradflow_env):
    """`num_training_steps` set far below the real number of optimizer steps: the
    linear schedule reaches lr 0 early and the rest of the run learns nothing
    (validation F1 "flatlined").

    Thread: https://github.com/determined-ai/determined/pull/711
    """
    model = tiny_qwen()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, 10)  # the run is 52 steps
    state = {}

    def schedule(i):
        scheduler.step()
        if i == 9:
            state["at_zero"] = snapshot(model)

    run_id = quickstart(model, optimizer, train_step(model, optimizer, after_step=schedule))
    assert not moved(state["at_zero"], model)  # nothing changed after step 10
    verdict(gradflow_server, run_id, "norm_weight_frozen", cause="zero_lr")


def test_scheduler_stepped_per_micro_batch(gradflow_server, gradflow_env):
    """With 4 micro-batches per optimizer step, `scheduler.step()` runs after every
    micro-batch: a 16 000-step warm-up is over after 1000 optimizer steps and the
    decay runs 4x too fast.

    Threads: https://github.com/Lightning-AI/pytorch-lightning/issues/1476,
    https://github.com/starVLA/starVLA/pull/210
    """
    model = tiny_qwen()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 40, 400)  # in optimizer steps
    data = token_batches()

    def step(_):
        optimizer.zero_grad(set_to_none=True)
        for _micro in range(4):
            loss = lm_loss(model, next(data)) / 4
            loss.backward()
            scheduler.step()  # the bug: per micro-batch
        optimizer.step()
        return loss

    run_id = quickstart(model, optimizer, step, steps=12)
    # After 12 optimizer steps the warm-up should be at 12/40; it is at 48/40, done.
    assert optimizer.param_groups[0]["lr"] < 1e-3 and scheduler.last_epoch == 48
    alert = verdict(gradflow_server, run_id, "scheduler_per_micro_batch", "LambdaLR")
    assert alert["evidence"]["measured"] == 4


class Backbone(nn.Module):
    """A detector-like model: `base` backbone, `triplet` and `feat` heads, `classifier`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.feat = nn.Linear(32, 32)
        self.feat_bn = nn.BatchNorm1d(32)
        self.classifier = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.relu(self.feat_bn(self.feat(self.base(x)))))


def test_modules_left_out_of_the_parameter_groups(gradflow_server, gradflow_env):
    """Parameter groups built from the backbone and "the new parameters" by id: the
    feature layers and their BatchNorm end up in neither, so they never update.

    Thread: https://github.com/zhunzhong07/HHL/issues/8
    """
    model = Backbone()
    base_ids = {id(p) for p in model.base.parameters()} | {
        id(p) for m in (model.feat, model.feat_bn) for p in m.parameters()
    }
    new_params = [p for p in model.parameters() if id(p) not in base_ids]
    optimizer = torch.optim.SGD(
        [{"params": model.base.parameters(), "lr": 0.01}, {"params": new_params, "lr": 0.1}],
        lr=0.1,
        momentum=0.9,
    )
    before = snapshot(model)
    run_id = quickstart(model, optimizer, train_step(model, optimizer, class_loss))
    changed = moved(before, model)
    assert "feat.weight" not in changed and "classifier.weight" in changed
    verdict(gradflow_server, run_id, "param_not_in_optimizer", "feat")


def test_backbone_gets_the_main_lr(gradflow_server, gradflow_env):
    """The backbone is meant to train at `lr_backbone` (10x lower), but the name
    filter that builds its parameter group never matches: the backbone trains at the
    main model's lr, and nothing says so.

    Thread: https://github.com/huggingface/lerobot/pull/280
    """
    model = Backbone()
    named = list(model.named_parameters())
    backbone = [p for n, p in named if n.startswith("model.backbone")]  # the bug: no such prefix
    rest = [p for n, p in named if not n.startswith("model.backbone")]
    optimizer = torch.optim.AdamW([{"params": rest}, {"params": backbone, "lr": 1e-5}], lr=1e-3)
    run_id = quickstart(model, optimizer, train_step(model, optimizer, class_loss))
    group_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    assert group_of[id(model.base[0].weight)] == 1e-3
    verdict(gradflow_server, run_id, "param_group_empty", "param group 1")


def clipped_where_it_cannot_act(server, where: str) -> None:
    """The loop clips to 0.1 at `where` (a `train_step` hook); every optimizer step
    still used the unclipped gradient (recorded by a step pre-hook)."""
    model = Backbone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    used = []

    def record(*_):
        used.append(nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())

    def clip(_):
        nn.utils.clip_grad_norm_(model.parameters(), 0.1)

    optimizer.register_step_pre_hook(record)
    run_id = quickstart(model, optimizer, train_step(model, optimizer, class_loss, **{where: clip}))
    assert max(used) > 0.1  # the optimizer stepped on unclipped gradients
    verdict(server, run_id, "clip_after_step", "gradients")


def test_gradient_clipping_after_the_optimizer_step(gradflow_server, gradflow_env):
    """`clip_grad_norm_` called after `optimizer.step()`: the step already used the
    unclipped gradients, so `--max-grad-norm` silently does nothing.

    Threads: https://github.com/VGraphRNN/VGRNN/issues/4,
    https://github.com/awslabs/graphstorm/issues/1366
    """
    clipped_where_it_cannot_act(gradflow_server, "after_step")


def test_gradient_clipping_before_backward(gradflow_server, gradflow_env):
    """The clip was put in the training step, before `backward()` runs: it clips the
    previous step's leftovers (or nothing), never the gradient about to be used, so
    the model trained without clipping.

    Thread: https://github.com/simchowitzlabpublic/nano-world-model/pull/22
    """
    clipped_where_it_cannot_act(gradflow_server, "before")
