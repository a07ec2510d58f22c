"""Corpus: a gradient clip called before `loss.backward()`, in a sequence tagger's
hand-written loop. The clip finds no gradient (the loop zeroed them at the end of the
previous iteration), backward then writes the gradients the step uses, unclipped."""

from __future__ import annotations

from typing import Iterator, List

import torch
from corpus_support import FIRST_STEPS, expects, judge, quickstart, seeded, three_windows
from torch import nn
from transformers import BertConfig, BertModel, get_linear_schedule_with_warmup

# The client's clip checks, three times over, and at least the corpus' 300 steps.
STEPS = max(300, three_windows(FIRST_STEPS))
TAGS, VOCAB, LENGTH, BATCH = 9, 64, 16, 32


class BertBiLstmTagger(nn.Module):
    """The thread's BERT-BiLSTM tagger in small (random weights): BERT, a one-layer
    BiLSTM (the thread's 128 hidden units, halved twice), a linear layer over the
    tags. The CRF is left out, its loss kept in scale: a sentence's negative
    log-likelihood, the tags' cross-entropy summed over the sentence, averaged over
    the batch."""

    def __init__(self) -> None:
        super().__init__()
        config = BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=LENGTH,
        )
        self.bert = BertModel(config, add_pooling_layer=False)
        self.lstm = nn.LSTM(32, 32, batch_first=True, bidirectional=True)
        self.head = nn.Linear(64, TAGS)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=tokens).last_hidden_state
        return self.head(self.lstm(hidden)[0])


def tagged_batches(seed: int) -> Iterator[List[torch.Tensor]]:
    """Tokens whose tag is a fixed function of the token and its left neighbour: a
    pattern the tagger learns."""
    g = torch.Generator().manual_seed(7100 + seed)
    while True:
        tokens = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
        left = torch.cat([torch.zeros(BATCH, 1, dtype=torch.long), tokens[:, :-1]], 1)
        yield [tokens, (tokens + 3 * left) % TAGS]


@seeded
@expects("clip_after_step", "gradients", "clip_after_step")
def test_bert_bilstm_tagger_clips_before_backward(request, gradflow_server, gradflow_env, seed):
    """The repository's `train()`: forward, `clip_grad_norm_(model.parameters(),
    max_grad_norm)`, `loss.backward()`, `optimizer.step()`, `scheduler.step()`,
    `model.zero_grad()`. Its settings: AdamW with BERT at lr 3e-5 and the BiLSTM and
    linear layer at 3e-4, weight decay 0.01 (not on biases and LayerNorm), eps 1e-8,
    linear warm-up over 10 % of the steps, batch 32, `max_grad_norm` 1.

    Thread: https://github.com/taishan1994/pytorch_bert_bilstm_crf_ner/issues/9
    """
    torch.manual_seed(seed)
    model = BertBiLstmTagger()
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [], "lr": 3e-5, "weight_decay": 0.01},
        {"params": [], "lr": 3e-5, "weight_decay": 0.0},
        {"params": [], "lr": 3e-4, "weight_decay": 0.01},
        {"params": [], "lr": 3e-4, "weight_decay": 0.0},
    ]
    for name, param in model.named_parameters():
        other = 0 if name.startswith("bert.") else 2
        groups[other + any(n in name for n in no_decay)]["params"].append(param)
    optimizer = torch.optim.AdamW(groups, eps=1e-8)
    scheduler = get_linear_schedule_with_warmup(optimizer, STEPS // 10, STEPS)
    batches = tagged_batches(seed)
    used: List[float] = []
    losses: List[float] = []

    def step(_: int) -> torch.Tensor:
        tokens, tags = next(batches)
        logits = model(tokens).flatten(0, 1)
        loss = nn.functional.cross_entropy(logits, tags.flatten(), reduction="sum") / BATCH
        clipped = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert float(clipped) == 0.0  # nothing to clip: no backward has run yet
        loss.backward()
        used.append(float(nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        optimizer.step()
        scheduler.step()
        model.zero_grad()
        losses.append(float(loss.detach()))
        return loss

    run_id = quickstart(model, optimizer, step, steps=STEPS)
    # The steps used unclipped gradients, many above max_norm, and the tagger trained.
    assert sum(n > 1.0 for n in used) >= STEPS // 10, used[:20]
    assert sum(losses[-30:]) < sum(losses[:30]), (losses[:5], losses[-5:])
    judge(request, gradflow_server, run_id)
