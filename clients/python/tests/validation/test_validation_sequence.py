"""Recurrent and sequence models: a learned optimizer whose LSTM cells sit in a plain
list, a ConvLSTM whose peephole weights are tensors rather than parameters, and
PyTorch's word language model example, healthy, which steps its weights by hand (no
optimizer) at lr 20 and detaches its hidden state between batches.
"""

from __future__ import annotations

import math
from typing import List, Tuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import (
    SEEDS,
    Diagnosis,
    Outcome,
    assert_caught,
    assert_silent,
    moved,
    snapshot,
    tensors_equal,
    watch,
)

pytestmark = pytest.mark.validation


# -- pytorch-meta-optimizer: LSTM cells in a plain list ------------------------------------


class LayerNormLSTMCell(nn.Module):
    """The repository's LSTM cell with layer norm on the gates and the cell."""

    def __init__(self, num_inputs: int, num_hidden: int) -> None:
        super().__init__()
        self.fc_i2h = nn.Linear(num_inputs, 4 * num_hidden)
        self.fc_h2h = nn.Linear(num_hidden, 4 * num_hidden)
        self.ln_i2h = nn.LayerNorm(4 * num_hidden)
        self.ln_h2h = nn.LayerNorm(4 * num_hidden)
        self.ln_h2o = nn.LayerNorm(num_hidden)

    def forward(
        self, x: torch.Tensor, state: Tuple[torch.Tensor, torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        hx, cx = state
        gates = self.ln_i2h(self.fc_i2h(x)) + self.ln_h2h(self.fc_h2h(hx))
        in_gate, forget_gate, cell_gate, out_gate = gates.chunk(4, 1)
        cx = torch.sigmoid(forget_gate) * cx + torch.sigmoid(in_gate) * torch.tanh(cell_gate)
        hx = torch.sigmoid(out_gate) * torch.tanh(self.ln_h2o(cx))
        return hx, cx


def preprocess_gradients(x: torch.Tensor) -> torch.Tensor:
    """The paper's (and the repository's) gradient preprocessing, p = 10: log-magnitude
    and sign, each clamped."""
    p = 10.0
    log = (x.abs() + 1e-8).log() / p
    sign = x * math.exp(p)
    return torch.stack([log.clamp(min=-1), sign.clamp(-1, 1)], 1)


class MetaOptimizer(nn.Module):
    """The repository's `MetaOptimizer`: linear1 and a layer norm, a stack of
    LayerNormLSTMCells appended to a plain Python list `self.lstms`, linear2 scaled by
    0.1. Applied coordinate-wise to (preprocessed gradient, parameter) it proposes each
    parameter's update."""

    def __init__(self, num_layers: int = 2, hidden_size: int = 10) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.linear1 = nn.Linear(3, hidden_size)
        self.ln1 = nn.LayerNorm(hidden_size)
        self.lstms = []
        for _ in range(num_layers):
            self.lstms.append(LayerNormLSTMCell(hidden_size, hidden_size))
        self.linear2 = nn.Linear(hidden_size, 1)
        self.linear2.weight.data.mul_(0.1)
        self.linear2.bias.data.fill_(0.0)
        self.hx: List[torch.Tensor] = []
        self.cx: List[torch.Tensor] = []

    def reset_lstm(self, keep_states: bool, size: int) -> None:
        if keep_states:
            self.hx = [h.detach() for h in self.hx]
            self.cx = [c.detach() for c in self.cx]
        else:
            self.hx = [torch.zeros(size, self.hidden_size) for _ in self.lstms]
            self.cx = [torch.zeros(size, self.hidden_size) for _ in self.lstms]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.ln1(self.linear1(x)))
        for i, lstm in enumerate(self.lstms):
            self.hx[i], self.cx[i] = lstm(x, (self.hx[i], self.cx[i]))
            x = self.hx[i]
        return self.linear2(x).squeeze(-1)


FEATURES, CLASSES = 8, 4


def optimizee_loss(flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The optimizee, a softmax regression whose weights are the flat vector `flat`."""
    weight = flat[: FEATURES * CLASSES].view(CLASSES, FEATURES)
    bias = flat[FEATURES * CLASSES :]
    return F.cross_entropy(x @ weight.t() + bias, y)


def optimizee_batch(g: torch.Generator, truth: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, FEATURES, generator=g)
    return x, (x @ truth).argmax(1)


def train_meta_optimizer(run_id: str, seed: int, updates: int = 300) -> Outcome:
    """The repository's `main.py`: Adam lr 1e-3 over `meta_optimizer.parameters()`; a
    fresh optimizee every few meta updates, optimised for `optimizer_steps` (20) by the
    meta optimizer with truncated BPTT every `truncated_bptt_step` (5); the meta loss is
    the sum of the optimizee's loss changes; gradients clamped to [-1, 1]."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(1000 + seed)
    meta_optimizer = MetaOptimizer()
    optimizer = torch.optim.Adam(meta_optimizer.parameters(), lr=1e-3)
    cells_before = [p.detach().clone() for cell in meta_optimizer.lstms for p in cell.parameters()]
    registered_before = snapshot(meta_optimizer)
    run = watch(run_id, meta_optimizer, optimizer)
    size = FEATURES * CLASSES + CLASSES
    while run.steps < updates:
        truth = torch.randn(FEATURES, CLASSES, generator=g)
        flat = 0.1 * torch.randn(size, generator=g)
        for k in range(20 // 5):
            meta_optimizer.reset_lstm(keep_states=k > 0, size=size)
            flat = flat.detach()
            loss_sum, prev_loss = 0.0, torch.zeros(())
            for _ in range(5):
                x, y = optimizee_batch(g, truth)
                current = flat.detach().requires_grad_()
                (grad,) = torch.autograd.grad(optimizee_loss(current, x, y), current)
                inputs = torch.cat([preprocess_gradients(grad), flat.detach().unsqueeze(1)], 1)
                flat = flat + meta_optimizer(inputs)
                loss = optimizee_loss(flat, x, y)
                loss_sum = loss_sum + (loss - prev_loss)
                prev_loss = loss.detach()
            meta_optimizer.zero_grad()
            loss_sum.backward()
            for param in meta_optimizer.parameters():
                param.grad.data.clamp_(-1, 1)
            optimizer.step()
            run.step(loss_sum)
            if run.steps >= updates:
                break
    run.close()
    cells_after = [p.detach() for cell in meta_optimizer.lstms for p in cell.parameters()]
    return Outcome(
        {"meta_optimizer": run},
        {
            "cells_unchanged": tensors_equal(cells_before, cells_after),
            "cells_got_gradients": all(
                p.grad is not None for cell in meta_optimizer.lstms for p in cell.parameters()
            ),
            "registered_moved": moved(registered_before, meta_optimizer),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_meta_optimizer_lstm_cells_in_a_list(gradflow_server, gradflow_env, seed):
    """https://github.com/ikostrikov/pytorch-meta-optimizer/issues/11"""
    outcome = train_meta_optimizer(gradflow_env, seed)

    facts = outcome.facts
    # The LSTM cells receive gradients and never change; the layers around them train.
    assert facts["cells_got_gradients"], facts
    assert facts["cells_unchanged"], facts
    assert {"linear1.weight", "linear2.weight"} <= facts["registered_moved"], facts

    # The correct verdict, at registration: a plain list attribute of the model holds
    # modules whose parameters are not the model's (PROTOCOL: modules_not_registered;
    # the model itself holds the list, so the subject is `run`).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="meta_optimizer",
            kind="modules_not_registered",
            causes=("modules_not_registered",),
            covers=("run",),
        ),
    )


# -- Convolutional LSTM: peephole weights that are not parameters -----------------------

SIDE = 8


class ConvLSTMCell(nn.Module):
    """The repository's `ConvLSTMCell`: eight convolutions and the peephole weights
    Wci, Wcf, Wco. Here they are learnable tensors (`requires_grad=True`) kept as plain
    attributes, the variant the thread discusses: not in `parameters()`, so never in
    the optimizer."""

    def __init__(self, input_channels: int, hidden_channels: int, kernel_size: int) -> None:
        super().__init__()
        padding = (kernel_size - 1) // 2
        self.hidden_channels = hidden_channels

        def conv(cin: int, bias: bool) -> nn.Conv2d:
            return nn.Conv2d(cin, hidden_channels, kernel_size, 1, padding, bias=bias)

        self.Wxi, self.Whi = conv(input_channels, True), conv(hidden_channels, False)
        self.Wxf, self.Whf = conv(input_channels, True), conv(hidden_channels, False)
        self.Wxc, self.Whc = conv(input_channels, True), conv(hidden_channels, False)
        self.Wxo, self.Who = conv(input_channels, True), conv(hidden_channels, False)
        self.Wci = torch.zeros(1, hidden_channels, SIDE, SIDE, requires_grad=True)
        self.Wcf = torch.zeros(1, hidden_channels, SIDE, SIDE, requires_grad=True)
        self.Wco = torch.zeros(1, hidden_channels, SIDE, SIDE, requires_grad=True)

    def forward(
        self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        ci = torch.sigmoid(self.Wxi(x) + self.Whi(h) + c * self.Wci)
        cf = torch.sigmoid(self.Wxf(x) + self.Whf(h) + c * self.Wcf)
        cc = cf * c + ci * torch.tanh(self.Wxc(x) + self.Whc(h))
        co = torch.sigmoid(self.Wxo(x) + self.Who(h) + cc * self.Wco)
        return co * torch.tanh(cc), cc

    def init_hidden(self, batch_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        shape = (batch_size, self.hidden_channels, SIDE, SIDE)
        return torch.zeros(shape), torch.zeros(shape)


class ConvLSTM(nn.Module):
    """The repository's `ConvLSTM`: cells set as attributes `cell0`, `cell1`, ... and also
    kept in a plain list `_all_layers` (those cells are registered: the list only
    repeats them); the input is fed again at every one of `step` steps."""

    def __init__(self, input_channels: int, hidden_channels: List[int], step: int) -> None:
        super().__init__()
        self.input_channels = [input_channels] + hidden_channels
        self.hidden_channels = hidden_channels
        self.step = step
        self._all_layers = []
        for i in range(len(hidden_channels)):
            cell = ConvLSTMCell(self.input_channels[i], hidden_channels[i], 3)
            setattr(self, f"cell{i}", cell)
            self._all_layers.append(cell)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        internal_state = []
        for step in range(self.step):
            x = input
            for i in range(len(self.hidden_channels)):
                cell = getattr(self, f"cell{i}")
                if step == 0:
                    internal_state.append(cell.init_hidden(x.size(0)))
                h, c = internal_state[i]
                x, new_c = cell(x, h, c)
                internal_state[i] = (x, new_c)
        return x


class FramePredictor(nn.Module):
    """Four past frames (as channels) through the ConvLSTM, a 1x1 conv to the next frame."""

    def __init__(self) -> None:
        super().__init__()
        self.convlstm = ConvLSTM(4, [8], step=3)
        self.head = nn.Conv2d(8, 1, 1)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.head(self.convlstm(frames))


def moving_squares(size: int, g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """Five frames of a 2x2 square moving one pixel a frame (wrapping around): four
    frames in, the fifth to predict."""
    start = torch.randint(0, SIDE, (size, 1, 2), generator=g)
    velocity = torch.randint(-1, 2, (size, 1, 2), generator=g)
    pos = start + torch.arange(5).view(1, 5, 1) * velocity
    rows = (torch.arange(SIDE).view(1, 1, SIDE, 1) - pos[..., 0, None, None]) % SIDE
    cols = (torch.arange(SIDE).view(1, 1, 1, SIDE) - pos[..., 1, None, None]) % SIDE
    frames = ((rows < 2) & (cols < 2)).float()
    return frames[:, :4], frames[:, 4:]


def train_convlstm(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """Next-frame regression with the repository's ConvLSTM: MSE, Adam lr 1e-3 over
    `model.parameters()`, batches of 16."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(1100 + seed)
    model = FramePredictor()
    cell = model.convlstm.cell0
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    peepholes_before = [
        cell.Wci.detach().clone(),
        cell.Wcf.detach().clone(),
        cell.Wco.detach().clone(),
    ]
    convs_before = snapshot(cell)
    run = watch(run_id, model, optimizer)
    for _ in range(steps):
        frames, target = moving_squares(16, g)
        loss = F.mse_loss(model(frames), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
    run.close()
    peepholes = [cell.Wci, cell.Wcf, cell.Wco]
    return Outcome(
        {"model": run},
        {
            "peepholes_unchanged": tensors_equal(peepholes_before, [p.detach() for p in peepholes]),
            "peephole_grad_norm": sum(p.grad.norm().item() for p in peepholes),
            "convs_moved": len(moved(convs_before, cell)),
            "convs": len(convs_before),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_convlstm_peepholes_are_not_parameters(gradflow_server, gradflow_env, seed):
    """https://github.com/automan000/Convolutional_LSTM_PyTorch/issues/17"""
    outcome = train_convlstm(gradflow_env, seed)

    facts = outcome.facts
    # The peephole weights pile up gradients and never change; the convolutions train.
    assert facts["peephole_grad_norm"] > 0, facts
    assert facts["peepholes_unchanged"], facts
    assert facts["convs_moved"] == facts["convs"], facts

    # When this case was written, PROTOCOL had no kind for learnable tensors that are
    # not parameters. The correct diagnosis is a wiring finding at registration, like
    # `modules_not_registered` for modules in a plain list: a module holds tensors that
    # require grad but are not registered, so no optimizer can hold them. It was
    # written as that kind, on `cell0`, saying that a kind of its own naming the same
    # finding would be as right. PROTOCOL v1.9 added that kind,
    # `tensors_not_registered`: the expectation names it now, on the same subject.
    # The plain list `_all_layers` repeats registered cells and must not be reported:
    # an alert on `run` is a wrong subject.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="tensors_not_registered",
            causes=("tensors_not_registered",),
            covers=("convlstm.cell0",),
        ),
    )


# -- word language model: hand-written SGD at lr 20 ----------------------------------------

NTOKENS, BPTT, BATCH = 30, 35, 20


def markov_corpus(length: int, g: torch.Generator) -> torch.Tensor:
    """Text from a fixed chain where each word has three likely successors."""
    table = torch.Generator().manual_seed(1200)
    successors = torch.stack([torch.randperm(NTOKENS, generator=table)[:3] for _ in range(NTOKENS)])
    words = [0]
    choices = torch.randint(0, 3, (length,), generator=g)
    noise = torch.rand(length, generator=g) < 0.1
    random_words = torch.randint(0, NTOKENS, (length,), generator=g)
    for i in range(length - 1):
        nxt = random_words[i] if noise[i] else successors[words[-1], choices[i]]
        words.append(int(nxt))
    return torch.tensor(words)


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    nbatch = data.size(0) // bsz
    return data[: nbatch * bsz].view(bsz, -1).t().contiguous()


class RNNModel(nn.Module):
    """The example's `RNNModel`: dropout, an embedding encoder, a 2-layer LSTM with
    dropout, a linear decoder, log-softmax; weights initialised uniform in +-0.1."""

    def __init__(
        self, ninp: int = 32, nhid: int = 32, nlayers: int = 2, dropout: float = 0.2
    ) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(NTOKENS, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, NTOKENS)
        self.nhid, self.nlayers = nhid, nlayers
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, data: torch.Tensor, hidden):
        emb = self.drop(self.encoder(data))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, NTOKENS)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int):
        return (
            torch.zeros(self.nlayers, bsz, self.nhid),
            torch.zeros(self.nlayers, bsz, self.nhid),
        )


def repackage_hidden(h):
    """Detach the hidden state from its history (truncated BPTT)."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def evaluate(model: RNNModel, data: torch.Tensor) -> float:
    model.eval()
    total, hidden = 0.0, model.init_hidden(10)
    with torch.no_grad():
        for i in range(0, data.size(0) - 1, BPTT):
            seq_len = min(BPTT, len(data) - 1 - i)
            output, hidden = model(data[i : i + seq_len], hidden)
            total += seq_len * F.nll_loss(output, data[i + 1 : i + 1 + seq_len].view(-1)).item()
    return total / (len(data) - 1)


def train_word_language_model(run_id: str, seed: int, epochs: int = 10) -> Outcome:
    """PyTorch's word_language_model example at its defaults where they matter: lr 20,
    clip 0.25, bptt 35, batch 20, dropout 0.2, no optimizer (`p.data.add_(p.grad,
    alpha=-lr)` after `clip_grad_norm_`), the hidden state detached between batches,
    lr divided by 4 when the validation loss does not improve. 10 epochs of 30 batches.
    Watched without an optimizer, since there is none."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(1300 + seed)
    train_data = batchify(markov_corpus(BATCH * (30 * BPTT + 1), g), BATCH)
    val_data = batchify(markov_corpus(10 * 200, g), 10)
    model = RNNModel()
    criterion = nn.NLLLoss()
    lr, best_val = 20.0, None
    before = evaluate(model, val_data)
    run = watch(run_id, model)
    for _ in range(epochs):
        model.train()
        hidden = model.init_hidden(BATCH)
        for i in range(0, train_data.size(0) - 1, BPTT):
            seq_len = min(BPTT, len(train_data) - 1 - i)
            data, targets = (
                train_data[i : i + seq_len],
                train_data[i + 1 : i + 1 + seq_len].view(-1),
            )
            model.zero_grad()
            hidden = repackage_hidden(hidden)
            output, hidden = model(data, hidden)
            loss = criterion(output, targets)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
            run.step(loss)
        val_loss = evaluate(model, val_data)
        if best_val is None or val_loss < best_val:
            best_val = val_loss
        else:
            lr /= 4.0
    run.close()
    return Outcome({"model": run}, {"val_before": before, "val_after": evaluate(model, val_data)})


@pytest.mark.parametrize("seed", SEEDS)
def test_word_language_model_steps_weights_by_hand(gradflow_server, gradflow_env, seed):
    """https://github.com/pytorch/examples/issues/757"""
    outcome = train_word_language_model(gradflow_env, seed)

    facts = outcome.facts
    # The model learned the chain: validation loss fell from about log(30) toward the
    # chain's entropy.
    assert facts["val_before"] > 3.2, facts
    assert facts["val_after"] < 0.7 * facts["val_before"], facts

    assert_silent(gradflow_server, outcome)
