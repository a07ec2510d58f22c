"""Corpus: the model is in another mode than the user thinks: evaluation mode while
training, a freeze that did not freeze."""

from __future__ import annotations

import torch
from corpus_support import (
    class_loss,
    feature_batches,
    moved,
    not_caught,
    quickstart,
    snapshot,
    train_step,
    verdict,
)
from torch import nn


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.5))
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def test_model_left_in_eval_mode_after_evaluation(gradflow_server, gradflow_env):
    """`evaluate()` calls `model.eval()` and training never calls `model.train()`
    again: after the first evaluation, the rest of training runs without dropout.

    Thread: https://github.com/shubhamagarwal92/mmd/issues/14
    """
    model = DropoutNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    modes = []

    def evaluate(i):
        if i == 5:  # the periodic evaluation, which never switches back
            model.eval()
            with torch.no_grad():
                model(next(feature_batches(16, 4, seed=9))[0])

    step = train_step(
        model,
        optimizer,
        class_loss,
        before=evaluate,
        after_step=lambda _: modes.append(model.training),
    )
    run_id = quickstart(model, optimizer, step)
    assert modes[:5] == [True] * 5 and not any(modes[5:])  # dropout off from step 5 on
    alert = verdict(gradflow_server, run_id, "model_in_eval_mode", "model", "left_in_eval")
    assert alert["first_step"] == 5 and "model.train()" in alert["fix"], alert


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = Encoder()
        self.logits = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(self.enc(x))


def test_frozen_flag_set_on_the_module_not_its_parameters(gradflow_server, gradflow_env):
    """`frozen=True` sets `encoder.requires_grad = False` on the module, an attribute
    nothing reads: the parameters still require grad and the "frozen" pretrained
    encoder is fine-tuned.

    Threads: https://github.com/catalyst-team/catalyst/issues/79,
    https://github.com/CSCYQJ/MICCAI23-ProtoContra-SFDA/issues/18
    """
    model = Net()
    model.enc.requires_grad = False  # the bug: meant requires_grad_(False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = snapshot(model)
    step = train_step(model, optimizer, class_loss)
    run_id = quickstart(model, optimizer, step)
    assert "enc.net.0.weight" in moved(before, model)
    alert = verdict(gradflow_server, run_id, "freeze_flag_ignored", "enc")
    assert "enc.requires_grad_(False)" in alert["fix"], alert


class TaskNet(nn.Module):
    """A shared feature extractor and a new task's classifier."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.classifier = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@not_caught(
    "missed: a frozen classifier is a legitimate setup; without train= the "
    "registration does not say which modules are meant to learn",
)
def test_freeze_mask_inverted(gradflow_server, gradflow_env):
    """The freeze step sets `requires_grad` the wrong way round: the layers meant to
    stay frozen require gradients and the new task's layers do not, so the model
    trains what it should keep and keeps what it should train.

    Thread: https://github.com/wannabeOG/MAS-PyTorch/issues/1
    """
    model = TaskNet()
    frozen = {"features"}  # what the user meant to keep fixed
    for name, module in model.named_children():
        module.requires_grad_(name in frozen)  # the bug: inverted
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    before = snapshot(model)
    run_id = quickstart(model, optimizer, train_step(model, optimizer, class_loss))
    changed = moved(before, model)
    assert "classifier.weight" not in changed and "features.0.weight" in changed
    verdict(gradflow_server, run_id, subject="classifier")
