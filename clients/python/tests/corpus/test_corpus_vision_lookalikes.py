"""Corpus: healthy image classification whose training loss looks alarming. A face
classifier reads a dataset stored in label order through a shuffle buffer much
smaller than the dataset (what a record file streamed through a buffered shuffle
gives): each batch holds one or two identities, the network follows the labels of
the stream, and the training loss falls over the first batches of every epoch and
rises over its second half, epoch after epoch, while held-out accuracy climbs.

Each seed runs 400 steps (25 epochs of 16 batches): three times `loss_spike`'s window
of 128 readings, the longest of the loss rules involved.
"""

from __future__ import annotations

import random
from typing import Iterator, List, Tuple

import torch
from corpus_loops import fit
from corpus_support import Progress, expects_silence, judge, seeded
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

CLASSES = 8
PER_CLASS = 64
SIDE = 12
BATCH = 32
EPOCHS = 25
STEPS_PER_EPOCH = CLASSES * PER_CLASS // BATCH
STEPS = EPOCHS * STEPS_PER_EPOCH
# One identity's worth of images: the buffer is an eighth of the dataset.
SHUFFLE_BUFFER = PER_CLASS
# How far a sample lies from its class's pattern (the task is learnable, not easy).
NOISE = 0.85


class BufferedShuffle(Sampler[int]):
    """The indices 0..n-1 through a shuffle buffer of `buffer` slots, as a streaming
    loader shuffles (tf.data's `shuffle(buffer_size)`, a record file's prefetch
    queue): the buffer starts with the first `buffer` indices; each draw takes a
    random slot and refills it with the next index of the stream."""

    def __init__(self, n: int, buffer: int, seed: int) -> None:
        self.n = n
        self.buffer = buffer
        self.rng = random.Random(seed)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        slots = list(range(min(self.buffer, self.n)))
        following = len(slots)
        while slots:
            slot = self.rng.randrange(len(slots))
            yield slots[slot]
            if following < self.n:
                slots[slot] = following
                following += 1
            else:
                slots.pop(slot)


def faces(seed: int) -> Tuple[TensorDataset, Tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic one-channel images, one random pattern per identity plus noise: the
    training set stored in label order, and a held-out set of 32 per identity."""
    g = torch.Generator().manual_seed(100 + seed)
    patterns = torch.randn(CLASSES, 1, SIDE, SIDE, generator=g)

    def draw(per_class: int, g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        labels = torch.arange(CLASSES).repeat_interleave(per_class)
        noise = NOISE * torch.randn(len(labels), 1, SIDE, SIDE, generator=g)
        return patterns[labels] + noise, labels

    images, labels = draw(PER_CLASS, g)
    return TensorDataset(images, labels), draw(32, torch.Generator().manual_seed(999))


class SmallResNetStem(nn.Module):
    """Two conv + batch-norm stages and a linear classifier, ResNet's layout in small."""

    def __init__(self) -> None:
        super().__init__()
        self.stage1 = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.stage2 = nn.Sequential(
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1)
        )
        self.fc = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.stage2(self.stage1(x)).flatten(1))


def accuracy(model: nn.Module, held_out: Tuple[torch.Tensor, torch.Tensor]) -> float:
    """Held-out accuracy in eval mode (batch norm's running statistics), back to train."""
    images, labels = held_out
    model.eval()
    with torch.no_grad():
        right = (model(images).argmax(1) == labels).float().mean().item()
    model.train()
    return right


def half_epoch_ratios(losses: List[float]) -> List[float]:
    """For each epoch after the first two (while the network still finds its way),
    the mean loss of its second half over the mean of its first half."""
    half = STEPS_PER_EPOCH // 2
    ratios = []
    for epoch in range(2, EPOCHS):
        first = losses[epoch * STEPS_PER_EPOCH :][:half]
        second = losses[epoch * STEPS_PER_EPOCH + half :][: STEPS_PER_EPOCH - half]
        ratios.append((sum(second) / len(second)) / (sum(first) / len(first)))
    return ratios


@seeded
@expects_silence
def test_a_training_loss_that_rises_within_every_epoch_of_label_ordered_data(
    request, gradflow_server, gradflow_env, seed
):
    """A ResNet face classifier trained at lr 0.1 on a dataset read nearly in label
    order: the loss falls at the start of each epoch and rises over the rest ("the
    loss is rising"; "the loss would change cyclicity in every epoch ... because of
    the data shuffle method ... a data buffer ... if your dataset is in order, their
    label would be easier to be the same"). Healthy: held-out accuracy climbs.

    From the thread: SGD at lr 0.1, momentum 0.9, weight decay 5e-4 (the
    repository's training defaults), step decays of the lr by 10, a buffered shuffle
    of a label-ordered record file. Not from it: a two-stage CNN with batch norm for
    ResNet-100, 8 synthetic identities of 64 images for MS1M, batches of 32 for 512,
    the decays at epochs 15 and 21 of 25 (`MultiStepLR` stepped per epoch).

    Thread: https://github.com/deepinsight/insightface/issues/377
    """
    torch.manual_seed(seed)
    train, held_out = faces(seed)
    loader = DataLoader(
        train, batch_size=BATCH, sampler=BufferedShuffle(len(train), SHUFFLE_BUFFER, seed)
    )
    model = SmallResNetStem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[15, 21], gamma=0.1)
    start = accuracy(model, held_out)
    batches = (batch for _ in range(EPOCHS) for batch in loader)

    def epoch_boundary(i: int) -> None:
        if i > 0 and i % STEPS_PER_EPOCH == 0:
            schedule.step()

    def cross_entropy() -> torch.Tensor:
        images, labels = next(batches)
        return nn.functional.cross_entropy(model(images), labels)

    run_id, losses = fit(model, optimizer, cross_entropy, STEPS, before=epoch_boundary)
    assert len(losses) == STEPS
    ratios = half_epoch_ratios(losses)
    # The alarming shape is real: in at least three epochs of four the second half's
    # loss is above the first half's (measured 20-21 of 23 on seeds 0-2), by a
    # median of at least 5 % (8-13 %).
    assert sum(r > 1 for r in ratios) >= 0.75 * len(ratios), ratios
    assert sorted(ratios)[len(ratios) // 2] > 1.05, ratios
    # Held-out accuracy at least doubles from chance (0.125): 0.57-0.93 measured.
    learned = Progress("held-out accuracy", start, accuracy(model, held_out), by=1.0, higher=True)
    judge(request, gradflow_server, run_id, steps=STEPS, progress=learned)
