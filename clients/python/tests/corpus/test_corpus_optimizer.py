"""Corpus: what the optimizer is given. Learning-rate schedules stepped at the wrong
rate, modules left out of the parameter groups or put in the wrong one, clipping in
the wrong place."""

from __future__ import annotations

import torch
from corpus_support import (
    FIRST_STEPS,
    NORM_WINDOW,
    class_loss,
    expects,
    judge,
    lm_loss,
    moved,
    quickstart,
    seeded,
    snapshot,
    three_windows,
    tiny_qwen,
    token_batches,
    train_step,
)
from torch import nn
from transformers import (
    get_linear_schedule_with_warmup,
    get_polynomial_decay_schedule_with_warmup,
)

# norm_weight_frozen's window, three times over.
NORM_STEPS = three_windows(NORM_WINDOW)
# The client's clip, scheduler and registration checks, three times over.
EARLY_STEPS = three_windows(FIRST_STEPS)
NORMS = ("model.layers", "model.norm")


@seeded
@expects("lr_vanished", "run", "lr_zero")
def test_warmup_scheduler_stepped_per_epoch(request, gradflow_server, gradflow_env, seed):
    """`get_polynomial_decay_schedule_with_warmup` (a per-step schedule) stepped once
    per epoch by the training framework: its factor is 0 for the whole first epoch,
    so the model does not train at all during it. From the thread: that schedule;
    no optimizer settings: AdamW at lr 1e-3.

    Thread: https://github.com/huggingface/transformers/issues/20916
    """
    model = tiny_qwen(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_polynomial_decay_schedule_with_warmup(optimizer, 100, 1000)
    steps_per_epoch = 200  # the run below stays inside the first epoch

    def per_epoch(i):
        if (i + 1) % steps_per_epoch == 0:
            scheduler.step()

    before = snapshot(model)
    step = train_step(model, optimizer, after_step=per_epoch, seed=seed)
    run_id = quickstart(model, optimizer, step, steps=NORM_STEPS)
    assert optimizer.param_groups[0]["lr"] == 0.0 and not moved(before, model)
    judge(request, gradflow_server, run_id)


@seeded
@expects("lr_vanished", "run", "lr_zero")
def test_schedule_length_too_short_decays_lr_to_zero(request, gradflow_server, gradflow_env, seed):
    """`num_training_steps` set far below the real number of optimizer steps: the
    linear schedule reaches lr 0 early and the rest of the run learns nothing
    (validation F1 "flatlined"). The thread gives no optimizer settings: AdamW at
    lr 1e-3.

    Thread: https://github.com/determined-ai/determined/pull/711
    """
    model = tiny_qwen(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, 10)  # the run is longer
    state = {}

    def schedule(i):
        scheduler.step()
        if i == 9:
            state["at_zero"] = snapshot(model)

    step = train_step(model, optimizer, after_step=schedule, seed=seed)
    run_id = quickstart(model, optimizer, step, steps=10 + NORM_STEPS)
    assert not moved(state["at_zero"], model)  # nothing changed after step 10
    judge(request, gradflow_server, run_id)


@seeded
@expects("scheduler_per_micro_batch", "LambdaLR", "scheduler_per_micro_batch")
def test_scheduler_stepped_per_micro_batch(request, gradflow_server, gradflow_env, seed):
    """With 4 micro-batches per optimizer step, `scheduler.step()` runs after every
    micro-batch: a 16 000-step warm-up is over after 1000 optimizer steps and the
    decay runs 4x too fast. The threads give no optimizer settings: AdamW at lr 1e-3.

    Threads: https://github.com/Lightning-AI/pytorch-lightning/issues/1476,
    https://github.com/starVLA/starVLA/pull/210
    """
    model = tiny_qwen(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 40, 400)  # in optimizer steps
    data = token_batches(seed + 1)

    def step(_):
        optimizer.zero_grad(set_to_none=True)
        for _micro in range(4):
            loss = lm_loss(model, next(data)) / 4
            loss.backward()
            scheduler.step()  # the bug: per micro-batch
        optimizer.step()
        return loss

    run_id = quickstart(model, optimizer, step, steps=EARLY_STEPS)
    # After 36 optimizer steps the warm-up should be at 36/40; it is at 144/40, done.
    assert optimizer.param_groups[0]["lr"] < 1e-3 and scheduler.last_epoch == 4 * EARLY_STEPS
    alert = judge(request, gradflow_server, run_id)
    assert alert["evidence"]["measured"] == 4


class Backbone(nn.Module):
    """A detector-like model: `base` backbone, `triplet` and `feat` heads, `classifier`."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.feat = nn.Linear(32, 32)
        self.feat_bn = nn.BatchNorm1d(32)
        self.classifier = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.relu(self.feat_bn(self.feat(self.base(x)))))


@seeded
@expects(
    "param_not_in_optimizer", ("feat", "feat_bn"), "not_in_optimizer", also=["norm_weight_frozen"]
)
def test_modules_left_out_of_the_parameter_groups(request, gradflow_server, gradflow_env, seed):
    """Parameter groups built from the backbone and "the new parameters" by id: the
    feature layers and their BatchNorm end up in neither, so they never update. From
    the thread: SGD with momentum 0.9, lr 0.01 for the backbone and 0.1 for the new
    layers. The BatchNorm's weight is also a frozen norm weight (norm_weight_frozen,
    whose window sets the run's length).

    Thread: https://github.com/zhunzhong07/HHL/issues/8
    """
    torch.manual_seed(seed)
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
    step = train_step(model, optimizer, class_loss, seed=seed)
    run_id = quickstart(model, optimizer, step, steps=NORM_STEPS)
    changed = moved(before, model)
    assert "feat.weight" not in changed and "classifier.weight" in changed
    judge(request, gradflow_server, run_id)


@seeded
@expects("param_group_empty", "param group 1", "param_group_empty")
def test_backbone_gets_the_main_lr(request, gradflow_server, gradflow_env, seed):
    """The backbone is meant to train at `lr_backbone` (10x lower), but the name
    filter that builds its parameter group never matches: the backbone trains at the
    main model's lr, and nothing says so. The thread gives no lr we can use at this
    size: AdamW at 1e-3, the backbone's 1e-5.

    Thread: https://github.com/huggingface/lerobot/pull/280
    """
    torch.manual_seed(seed)
    model = Backbone()
    named = list(model.named_parameters())
    backbone = [p for n, p in named if n.startswith("model.backbone")]  # the bug: no such prefix
    rest = [p for n, p in named if not n.startswith("model.backbone")]
    optimizer = torch.optim.AdamW([{"params": rest}, {"params": backbone, "lr": 1e-5}], lr=1e-3)
    step = train_step(model, optimizer, class_loss, seed=seed)
    run_id = quickstart(model, optimizer, step, steps=EARLY_STEPS)
    group_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    assert group_of[id(model.base[0].weight)] == 1e-3
    judge(request, gradflow_server, run_id)


def clipped_where_it_cannot_act(
    request, server, where: str, seed: int, by_value: bool = False
) -> None:
    """The loop clips to 0.1 at `where` (a `train_step` hook), by the total norm or,
    `by_value`, element by element; every optimizer step still used the unclipped
    gradient (its norm, or its largest element, recorded by a step pre-hook)."""
    torch.manual_seed(seed)
    model = Backbone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    used = []

    def record(*_):
        grads = [p.grad for p in model.parameters()]
        if by_value:
            used.append(max(g.abs().max().item() for g in grads))
        else:
            used.append(nn.utils.get_total_norm(grads).item())

    def clip(_):
        if by_value:
            nn.utils.clip_grad_value_(model.parameters(), 0.1)
        else:
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)

    optimizer.register_step_pre_hook(record)
    step = train_step(model, optimizer, class_loss, seed=seed, **{where: clip})
    run_id = quickstart(model, optimizer, step, steps=EARLY_STEPS)
    assert max(used) > 0.1  # the optimizer stepped on unclipped gradients
    judge(request, server, run_id)


@seeded
@expects("clip_after_step", "gradients", "clip_after_step")
def test_gradient_clipping_after_the_optimizer_step(request, gradflow_server, gradflow_env, seed):
    """`clip_grad_norm_` called after `optimizer.step()`: the step already used the
    unclipped gradients, so `--max-grad-norm` silently does nothing. The threads give
    no settings we can use at this size: SGD at lr 0.05, clip 0.1.

    Threads: https://github.com/VGraphRNN/VGRNN/issues/4,
    https://github.com/awslabs/graphstorm/issues/1366
    """
    clipped_where_it_cannot_act(request, gradflow_server, "after_step", seed)


@seeded
@expects("clip_after_step", "gradients", "clip_after_step")
def test_gradient_clipping_before_backward(request, gradflow_server, gradflow_env, seed):
    """The clip was put in the training step, before `backward()` runs: it clips the
    previous step's leftovers (or nothing), never the gradient about to be used, so
    the model trained without clipping.

    Thread: https://github.com/simchowitzlabpublic/nano-world-model/pull/22
    """
    clipped_where_it_cannot_act(request, gradflow_server, "before", seed)


@seeded
@expects("clip_after_step", "gradients", "clip_after_step")
def test_value_clipping_after_the_optimizer_step(request, gradflow_server, gradflow_env, seed):
    """The same misplaced clip with `clip_grad_value_` (`--clip-value` in the loops that
    clip element by element): called after `optimizer.step()`, it clamps gradients the
    step already used, and the model trains unclipped. A variant of the norm clip
    above, from the same threads.

    Threads: https://github.com/VGraphRNN/VGRNN/issues/4,
    https://github.com/awslabs/graphstorm/issues/1366
    """
    clipped_where_it_cannot_act(request, gradflow_server, "after_step", seed, by_value=True)
