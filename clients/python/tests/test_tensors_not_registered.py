"""Learnable tensors that are not parameters: ``torch.zeros(..., requires_grad=True)``
kept as a module attribute. The case is automan000/Convolutional_LSTM_PyTorch#17,
a ConvLSTM cell whose peephole weights Wci, Wcf, Wco are such tensors: backward fills
their ``.grad``, but they are outside ``model.parameters()`` and the optimizer built
from it, so they never change. The client notes them at registration and says them
once a gradient reached the same tensors (``tensors_not_registered``).

The look-alike holds what must stay silent beside real weights: the peepholes as
``nn.Parameter``, a buffer, a frozen tensor, a learnable temperature that is not a
parameter but is handed to the optimizer, a learnable offset with an optimizer of
its own that gradflow does not watch (SAC's ``log_alpha``), and an input kept for a
gradient penalty that the forward makes anew (a leaf that requires grad) at every
call."""

from __future__ import annotations

from typing import List, Tuple

import torch
from conftest import new_run_id
from torch import nn
from torch.nn import functional as F

import gradflow

SIDE, CHANNELS, STEPS = 6, 4, 30


class PeepholeCell(nn.Module):
    """One ConvLSTM cell with peephole connections (Shi et al. 2015)."""

    def __init__(self, as_parameters: bool) -> None:
        super().__init__()
        self.gates = nn.Conv2d(1 + CHANNELS, 4 * CHANNELS, 3, padding=1)
        shape = (1, CHANNELS, SIDE, SIDE)
        if as_parameters:
            self.Wci = nn.Parameter(torch.zeros(shape))
            self.Wcf = nn.Parameter(torch.zeros(shape))
            self.Wco = nn.Parameter(torch.zeros(shape))
        else:  # the thread's cell
            self.Wci = torch.zeros(shape, requires_grad=True)
            self.Wcf = torch.zeros(shape, requires_grad=True)
            self.Wco = torch.zeros(shape, requires_grad=True)

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor):
        i, f, g, o = self.gates(torch.cat([x, h], 1)).chunk(4, 1)
        c = torch.sigmoid(f + c * self.Wcf) * c + torch.sigmoid(i + c * self.Wci) * torch.tanh(g)
        h = torch.sigmoid(o + c * self.Wco) * torch.tanh(c)
        return h, c


class FramePredictor(nn.Module):
    def __init__(self, as_parameters: bool, look_alikes: bool = False) -> None:
        super().__init__()
        self.cell = PeepholeCell(as_parameters)
        self.head = nn.Conv2d(CHANNELS, 1, 1)
        self.look_alikes = look_alikes
        if look_alikes:
            self.register_buffer("frame_mean", torch.zeros(1))
            self.frozen_scale = torch.ones(1)  # no grad: a constant
            self.temperature = torch.ones(1, requires_grad=True)  # in the optimizer
            self.offset = torch.zeros(1, requires_grad=True)  # its own optimizer
            self.last_input: torch.Tensor = torch.empty(0)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        if self.look_alikes:
            # Kept for a gradient penalty on the input: a new leaf at every call.
            self.last_input = frames.detach().requires_grad_(True)
            frames = (self.last_input - self.frame_mean) * self.frozen_scale
        batch = frames.shape[0]
        h = c = torch.zeros(batch, CHANNELS, SIDE, SIDE)
        for t in range(frames.shape[1]):
            h, c = self.cell(frames[:, t : t + 1], h, c)
        out = self.head(h)
        return out * self.temperature + self.offset if self.look_alikes else out


def moving_squares(batch: int, g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """Three frames of a 2×2 square moving right by one pixel; the target is the next."""
    frames = torch.zeros(batch, 4, SIDE, SIDE)
    rows = torch.randint(0, SIDE - 1, (batch,), generator=g)
    for b in range(batch):
        for t in range(4):
            frames[b, t, rows[b] : rows[b] + 2, t : t + 2] = 1.0
    return frames[:, :3], frames[:, 3:]


def train(server, model: FramePredictor, extra: List[torch.Tensor], own: List[torch.Tensor]):
    """Adam over the parameters and `extra`, watched; `own` has its own SGD."""
    g = torch.Generator().manual_seed(5)
    optimizer = torch.optim.Adam([*model.parameters(), *extra], lr=1e-2)
    unwatched = torch.optim.SGD(own, lr=1e-2) if own else None
    frames, target = moving_squares(16, g)
    model(frames)  # a forward before watch: the penalty's input exists at registration
    gf = gradflow.watch(model, optimizer, server=server.url, run_id=new_run_id("peephole"))
    losses = []
    for _ in range(STEPS):
        frames, target = moving_squares(16, g)
        loss = F.mse_loss(model(frames), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if unwatched is not None:
            unwatched.step()
            unwatched.zero_grad()
        gf.step(loss=loss)
        losses.append(loss.item())
    gf.close()
    server.wait_for_steps(gf.run_id, STEPS)
    return gf.run_id, losses


def test_peepholes_kept_as_tensors_are_named_with_the_fix(gradflow_server):
    torch.manual_seed(0)
    model = FramePredictor(as_parameters=False)
    cell = model.cell
    before = [t.detach().clone() for t in (cell.Wci, cell.Wcf, cell.Wco)]
    run_id, losses = train(gradflow_server, model, [], [])
    assert losses[-1] < losses[0], "the convolutions train"
    for tensor, old in zip((cell.Wci, cell.Wcf, cell.Wco), before):
        assert torch.equal(tensor.detach(), old), "the peepholes never change"
        assert tensor.grad is not None and tensor.grad.abs().sum() > 0
    alerts = gradflow_server.alerts(run_id)
    found = [a for a in alerts if a["kind"] == "tensors_not_registered"]
    assert [a["evidence"]["attribute"] for a in found] == ["Wci, Wcf, Wco"], alerts
    for alert in found:
        assert alert["subject"] == "cell"
        assert alert["severity"] == "critical"
        assert alert["evidence"]["params"] == 3
        assert "nn.Parameter" in alert["fix"]
    others = [a for a in gradflow_server.serious(run_id) if a["kind"] != "tensors_not_registered"]
    assert others == [], others


def test_parameters_buffers_frozen_and_per_call_tensors_stay_silent(gradflow_server):
    torch.manual_seed(0)
    model = FramePredictor(as_parameters=True, look_alikes=True)
    before = model.cell.Wci.detach().clone()
    run_id, losses = train(gradflow_server, model, [model.temperature], [model.offset])
    assert losses[-1] < 0.8 * losses[0], "training measurably progressed"
    assert not torch.equal(model.cell.Wci.detach(), before), "the peepholes train"
    assert model.offset.item() != 0.0, "the offset trains under its own optimizer"
    assert gradflow_server.serious(run_id) == []
    assert [
        a for a in gradflow_server.alerts(run_id) if a["kind"] == "tensors_not_registered"
    ] == []
