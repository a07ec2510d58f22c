"""The instability verdicts of protocol v1.8 on CPU recipes through the real client,
each beside its healthy twin, which must stay silent.

The model is a small pre-LN GPT (2 layers, d = 64, 4 heads, context 32, vocabulary
256, about 0.13 M parameters) trained on a sparse random bigram chain, as in
docs/instabilities.md, where each recipe's numbers were first measured.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from conftest import new_run_id
from torch import nn

import gradflow

VOCAB = 256
CONTEXT = 32
WIDTH = 64
HEADS = 4


class CausalSelfAttention(nn.Module):
    """Eager causal attention (the softmax the client sees), QK-LayerNorm optional."""

    def __init__(self, qk_norm: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        head = WIDTH // HEADS
        self.q_norm = nn.LayerNorm(head) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(head) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            part.view(b, t, HEADS, d // HEADS).transpose(1, 2)
            for part in self.qkv(x).split(d, dim=2)
        )
        q, k = self.q_norm(q), self.k_norm(k)
        logits = (q @ k.transpose(-2, -1)) / math.sqrt(d // HEADS)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        attention = F.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        return self.proj((attention @ v).transpose(1, 2).reshape(b, t, d))


def dense_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))


class Block(nn.Module):
    def __init__(self, qk_norm: bool, mlp: Callable[[], nn.Module] = dense_mlp) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = CausalSelfAttention(qk_norm)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """`mlp` makes each block's feed-forward part (a dense MLP unless given)."""

    def __init__(self, qk_norm: bool = False, mlp: Callable[[], nn.Module] = dense_mlp) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(CONTEXT, WIDTH)
        self.layers = nn.ModuleList(Block(qk_norm, mlp) for _ in range(2))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def bigram_batches(
    steps: int, bad_step: Optional[int] = None, batch: int = 16
) -> Iterator[Tuple[int, torch.Tensor, torch.Tensor]]:
    """Sequences of a sparse random bigram chain (two successors per token); at
    `bad_step`, one batch of a single repeated token (the bad batch)."""
    g = torch.Generator().manual_seed(0)
    successors = torch.randint(0, VOCAB, (VOCAB, 2), generator=g)
    for step in range(steps):
        x = torch.empty(batch, CONTEXT + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, VOCAB, (batch,), generator=g)
        choice = torch.randint(0, 2, (batch, CONTEXT), generator=g)
        for i in range(CONTEXT):
            x[:, i + 1] = successors[x[:, i], choice[:, i]]
        if step == bad_step:
            x[:] = 7
        yield step, x[:, :-1], x[:, 1:]


def train(
    server: Any,
    steps: int,
    *,
    lr: float = 3e-3,
    eps: float = 1e-8,
    beta2: float = 0.95,
    qk_norm: bool = False,
    bad_step: Optional[int] = None,
    signals: Optional[Dict[str, int]] = None,
) -> Tuple[str, List[float]]:
    """Trains the tiny GPT under the real client; its run id and losses."""
    torch.set_num_threads(1)
    model = TinyGPT(qk_norm)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=lr, eps=eps, betas=(0.9, beta2), weight_decay=0.0
    )
    gf = gradflow.watch(
        model,
        optimizer,
        server=server.url,
        run_id=new_run_id("instab"),
        on_alert=None,
        signals=signals,
    )
    losses = []
    for step, tokens, targets in bigram_batches(steps, bad_step):
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        gf.step(loss, batch_ids=[f"shard-0:batch-{step}"])
        losses.append(loss.item())
    gf.close()
    return gf.run_id, losses


def run_gpt(
    server: Any,
    batches: Iterable[Tuple[torch.Tensor, torch.Tensor]],
    *,
    prefix: str,
    signals: Dict[str, int],
    **adamw: Any,
) -> str:
    """Trains a fresh tiny GPT with AdamW(**adamw) on `batches` (tokens, targets)
    under the real client; its run id."""
    torch.set_num_threads(1)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), **adamw)
    gf = gradflow.watch(
        model,
        optimizer,
        server=server.url,
        run_id=new_run_id(prefix),
        on_alert=None,
        signals=signals,
    )
    for tokens, targets in batches:
        loss = F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        gf.step(loss)
    gf.close()
    return gf.run_id


def kinds(server: Any, run_id: str) -> List[Tuple[str, str, str]]:
    return [(a["kind"], a["subject"], a["severity"]) for a in server.serious(run_id)]


def test_a_bad_batch_is_named_at_its_step_with_its_ids(gradflow_server):
    run_id, losses = train(gradflow_server, 200, bad_step=150)
    assert losses[150] > 4 * losses[149]  # the recipe still makes its spike
    alert = gradflow_server.wait_for_alert(run_id, "loss_spike")
    assert (alert["first_step"], alert["subject"]) == (150, "loss")
    assert alert["evidence"]["cause"] == "data_batch"
    assert alert["evidence"]["batch_ids"] == ["shard-0:batch-150"]
    assert "shard-0:batch-150" in alert["detail"]
    # The batch of one repeated token is named by its repeated-token share, against
    # the bigram batches' usual share.
    assert alert["evidence"]["repeated_token_share"] == 1.0
    assert alert["evidence"]["repeated_token_share_usual"] < 0.5
    shares = dict(gradflow_server.series(run_id, "repeated_token_share"))
    assert len(shares) == 200 and shares[150] == 1.0
    # The batch may also move Adam's update (adam_update_spike); nothing else speaks.
    others = {k[0] for k in kinds(gradflow_server, run_id)} - {"loss_spike", "adam_update_spike"}
    assert others == set()


def test_the_same_run_without_the_bad_batch_stays_silent(gradflow_server):
    run_id, _ = train(gradflow_server, 200)
    assert kinds(gradflow_server, run_id) == []
    shares = [v for _, v in gradflow_server.series(run_id, "repeated_token_share")]
    assert len(shares) == 200 and max(shares) < 0.5


def test_attention_logits_growing_at_a_high_lr_are_caught(gradflow_server):
    run_id, _ = train(gradflow_server, 120, lr=1e-1, signals={"attention": 1})
    alert = gradflow_server.wait_for_alert(run_id, "attention_logit_growth")
    assert alert["subject"].startswith("layers.") and alert["subject"].endswith(".attn")
    assert alert["evidence"]["max_logit"] > 100
    assert alert["evidence"]["first_logit"] < 10


@pytest.mark.parametrize(("lr", "qk_norm"), [(3e-3, False), (1e-1, True)])
def test_attention_at_a_sane_lr_or_with_qk_norm_stays_silent(gradflow_server, lr, qk_norm):
    run_id, _ = train(gradflow_server, 120, lr=lr, qk_norm=qk_norm, signals={"attention": 1})
    logits = gradflow_server.series(run_id, "attn_max_logit", "layers.0.attn")
    assert len(logits) == 120
    assert [k for k in kinds(gradflow_server, run_id) if k[0] == "attention_logit_growth"] == []
    if lr < 1e-2:  # at lr 1e-1 QK-norm keeps attention soft, the rest may still alarm
        assert kinds(gradflow_server, run_id) == []


def test_an_eps_above_the_gradients_scale_is_caught(gradflow_server):
    """ε = 1e-3 damps most elements, but the steps stay within a factor of Adam's own
    (update RMS / lr about 0.2): a setting that slows training, said as info."""
    run_id, _ = train(gradflow_server, 60, eps=1e-3, signals={"adam": 5})
    alert = gradflow_server.wait_for_alert(run_id, "adam_eps_dominated", "param group 0")
    assert alert["evidence"]["below_eps"] >= 0.5
    assert alert["evidence"]["eps"] == pytest.approx(1e-3)
    assert alert["severity"] == "info", alert
    assert alert["evidence"]["update_rms_over_lr"] >= 0.02, alert


def test_an_eps_that_shrinks_every_step_is_a_warning(gradflow_server):
    """ε = 1 leaves every step a few hundredths of Adam's at the same lr: the group
    barely trains, and the alert is a warning."""
    run_id, _ = train(gradflow_server, 60, eps=1.0, signals={"adam": 5})
    alert = gradflow_server.wait_for_alert(run_id, "adam_eps_dominated", "param group 0")
    assert alert["severity"] == "warning", alert
    assert alert["evidence"]["update_rms_over_lr"] < 0.02, alert
    assert "barely trains" in alert["detail"], alert


def test_a_sane_eps_stays_silent(gradflow_server):
    run_id, _ = train(gradflow_server, 60, signals={"adam": 5})
    below = gradflow_server.series(run_id, "adam_below_eps", "layers.0.attn.qkv")
    assert len(below) == 12 and all(v < 0.05 for _, v in below)
    assert kinds(gradflow_server, run_id) == []


def test_rows_whose_gradient_is_negligible_are_not_counted_below_eps(gradflow_server):
    """An output head whose rows for ids the data never uses get only a vanishing
    gradient (here 1e-13 of the loss), as the tokens a model learnt to rule out do:
    their √v̂ is below ε = 1e-8 while the used rows' is far above it. Counted, they
    made most of the head "below ε" on a healthy run (docs/instabilities.md); they
    carry none of the gradient and are left out (v1.10)."""
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(16, 64))
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-3)
    gf = gradflow.watch(
        head, optimizer, server=gradflow_server.url, run_id=new_run_id(), signals={"adam": 5}
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(40):
        out = head(torch.randn(32, 16, generator=g))
        loss = (out[:, :8] - 1.0).square().mean() + 1e-13 * out[:, 8:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        gf.step(loss=loss)
    gf.close()
    below = gradflow_server.series(gf.run_id, "adam_below_eps", "0")
    assert len(below) == 8 and all(v == 0.0 for _, v in below), below
    assert kinds(gradflow_server, gf.run_id) == []


def test_an_update_spike_from_a_bad_batch_with_a_slow_second_moment_is_named(gradflow_server):
    # β₂ = 0.999: Adam's second moment lags the batch's gradient, the update jumps.
    run_id, _ = train(gradflow_server, 160, beta2=0.999, bad_step=150, signals={"adam": 1})
    alert = gradflow_server.wait_for_alert(run_id, "adam_update_spike")
    assert alert["first_step"] == 150
    assert alert["evidence"]["ratio"] >= 2


def test_the_same_slow_second_moment_without_the_bad_batch_stays_silent(gradflow_server):
    run_id, _ = train(gradflow_server, 160, beta2=0.999, signals={"adam": 1})
    assert kinds(gradflow_server, run_id) == []


def fp16_steps(server: Any, steps: int, overflow_every: int = 0) -> str:
    """A small classifier under fp16 autocast and a GradScaler on CPU. Every
    `overflow_every`-th step (0: never) its loss is multiplied by 1e30, so the scaled
    gradients overflow and the scale halves; the steps between are clean."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    gf = gradflow.watch(
        model, optimizer, scaler=scaler, server=server.url, run_id=new_run_id("fp16"), on_alert=None
    )
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(32, 16, generator=g)
        y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
        blow_up = 1e30 if overflow_every and step % overflow_every == 0 else 1.0
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), y) * blow_up
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        gf.step(loss)
    gf.close()
    return gf.run_id


def test_a_loss_scale_that_keeps_halving_between_clean_steps_is_caught(gradflow_server):
    run_id = fp16_steps(gradflow_server, 20, overflow_every=2)
    alert = gradflow_server.wait_for_alert(run_id, "loss_scale_collapse", "scaler")
    assert alert["evidence"]["cause"] == "halvings"
    assert alert["evidence"]["halvings"] >= 8
    # Never ten overflows running: the streak's verdict is not this run's.
    assert "scaler_overflow_streak" not in {k[0] for k in kinds(gradflow_server, run_id)}


def test_a_healthy_fp16_scaler_stays_silent(gradflow_server):
    run_id = fp16_steps(gradflow_server, 60)
    assert kinds(gradflow_server, run_id) == []
