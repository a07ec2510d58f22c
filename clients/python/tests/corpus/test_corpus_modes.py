"""Corpus: the model is in another mode than the user thinks: evaluation mode while
training, a freeze that did not freeze."""

from __future__ import annotations

from typing import Any

import lightning
import torch
from corpus_support import (
    ANY,
    FIRST_STEPS,
    NORM_WINDOW,
    STUCK_WINDOW,
    class_loss,
    expects,
    feature_batches,
    judge,
    moved,
    not_caught,
    one_thread,
    quickstart,
    seeded,
    snapshot,
    three_windows,
    train_step,
)
from torch import nn

from gradflow.integrations.lightning import GradflowCallback

# The step of the evaluation that leaves the model in eval mode.
EVAL_STEP = 5


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.5))
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


@seeded
@expects("model_in_eval_mode", "model", "left_in_eval")
def test_model_left_in_eval_mode_after_evaluation(request, gradflow_server, gradflow_env, seed):
    """`evaluate()` calls `model.eval()` and training never calls `model.train()`
    again: after the first evaluation, the rest of training runs without dropout.
    The run goes on for three of the rule's 20-step windows after the evaluation.
    The thread gives no optimizer settings: Adam at lr 1e-3.

    Thread: https://github.com/shubhamagarwal92/mmd/issues/14
    """
    torch.manual_seed(seed)
    model = DropoutNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    modes = []

    def evaluate(i):
        if i == EVAL_STEP:  # the periodic evaluation, which never switches back
            model.eval()
            with torch.no_grad():
                model(next(feature_batches(16, 4, seed=9))[0])

    step = train_step(
        model,
        optimizer,
        class_loss,
        before=evaluate,
        after_step=lambda _: modes.append(model.training),
        seed=seed,
    )
    run_id = quickstart(model, optimizer, step, steps=EVAL_STEP + three_windows(NORM_WINDOW))
    # dropout off from the evaluation on
    assert modes[:EVAL_STEP] == [True] * EVAL_STEP and not any(modes[EVAL_STEP:])
    alert = judge(request, gradflow_server, run_id)
    assert alert["first_step"] == EVAL_STEP and "model.train()" in alert["fix"], alert


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = Encoder()
        self.logits = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(self.enc(x))


@seeded
@expects("freeze_flag_ignored", "enc", "freeze_flag_ignored")
def test_frozen_flag_set_on_the_module_not_its_parameters(
    request, gradflow_server, gradflow_env, seed
):
    """`frozen=True` sets `encoder.requires_grad = False` on the module, an attribute
    nothing reads: the parameters still require grad and the "frozen" pretrained
    encoder is fine-tuned. A registration check; the run goes on for three times the
    first-steps window. The threads give no optimizer settings: Adam at lr 1e-3.

    Threads: https://github.com/catalyst-team/catalyst/issues/79,
    https://github.com/CSCYQJ/MICCAI23-ProtoContra-SFDA/issues/18
    """
    torch.manual_seed(seed)
    model = Net()
    model.enc.requires_grad = False  # the bug: meant requires_grad_(False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = snapshot(model)
    step = train_step(model, optimizer, class_loss, seed=seed)
    run_id = quickstart(model, optimizer, step, steps=three_windows(FIRST_STEPS))
    assert "enc.net.0.weight" in moved(before, model)
    alert = judge(request, gradflow_server, run_id)
    assert "enc.requires_grad_(False)" in alert["fix"], alert


class LitNet(lightning.LightningModule):
    """`Net` as a LightningModule: the encoder's "frozen" flag set the same way."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return class_loss(self.net, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


@seeded
@expects("freeze_flag_ignored", "net.enc", "freeze_flag_ignored")
def test_frozen_flag_set_on_the_module_under_lightning(
    request, gradflow_server, gradflow_env, seed
):
    """The same ignored freeze in a LightningModule trained by Lightning's own loop,
    watched through its `GradflowCallback` (the registration happens at
    `on_train_start`, from the Trainer's optimizer). A variant of the hand-written
    loop above; catalyst's thread is about a framework's own `frozen=` flag.

    Threads: https://github.com/catalyst-team/catalyst/issues/79,
    https://github.com/CSCYQJ/MICCAI23-ProtoContra-SFDA/issues/18
    """
    torch.manual_seed(seed)
    model = LitNet()
    model.net.enc.requires_grad = False  # the bug: meant requires_grad_(False)
    before = snapshot(model)
    steps = three_windows(FIRST_STEPS)
    data = feature_batches(16, 4, seed + 1)
    x, y = (torch.cat(parts) for parts in zip(*(next(data) for _ in range(steps))))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    callback = GradflowCallback()
    trainer = lightning.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with one_thread():
        trainer.fit(model, loader)
    assert "net.enc.net.0.weight" in moved(before, model)
    alert = judge(request, gradflow_server, callback.gf.run_id)
    assert "requires_grad_(False)" in alert["fix"], alert


class TaskNet(nn.Module):
    """A shared feature extractor and a new task's classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.classifier = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@not_caught(
    "missed: a frozen classifier is a legitimate setup; without train= the "
    "registration does not say which modules are meant to learn",
)
@seeded
@expects(ANY, "classifier", ANY)
def test_freeze_mask_inverted(request, gradflow_server, gradflow_env, seed):
    """The freeze step sets `requires_grad` the wrong way round: the layers meant to
    stay frozen require gradients and the new task's layers do not, so the model
    trains what it should keep and keeps what it should train. The right verdict
    names the frozen classifier (any kind). The thread gives no optimizer settings:
    SGD with momentum 0.9 at lr 0.05.

    Thread: https://github.com/wannabeOG/MAS-PyTorch/issues/1
    """
    torch.manual_seed(seed)
    model = TaskNet()
    frozen = {"features"}  # what the user meant to keep fixed
    for name, module in model.named_children():
        module.requires_grad_(name in frozen)  # the bug: inverted
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    before = snapshot(model)
    step = train_step(model, optimizer, class_loss, seed=seed)
    run_id = quickstart(model, optimizer, step, steps=three_windows(STUCK_WINDOW))
    changed = moved(before, model)
    assert "classifier.weight" not in changed and "features.0.weight" in changed
    judge(request, gradflow_server, run_id)
