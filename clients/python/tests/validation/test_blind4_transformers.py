"""transformers (the fourth set): BERT sequence classification whose warm-up schedule
is asked for the learning rate of its last step at every step, so that the lr it
sets is 0 from the first step on; and a VAE around BART whose latent projection is
left out of the optimizer.

The model is the third set's tiny `BertForSequenceClassification` with random
weights (2 layers, hidden size 32); the task is whether a marker token occurs in the sequence.
"""

from __future__ import annotations

from typing import Tuple

import pytest
import torch
from torch import nn
from transformers import BartConfig, BartForConditionalGeneration
from transformers.modeling_outputs import BaseModelOutput

from .support import SEEDS, Diagnosis, Outcome, assert_caught, snapshot, watch
from .test_blind3_transformers import LENGTH, VOCAB, tiny_bert_classifier

pytestmark = pytest.mark.validation

MARKER = 7


def marker_batch(size: int, g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(10, VOCAB, (size, LENGTH), generator=g)
    labels = torch.randint(0, 2, (size,), generator=g)
    for i in range(size):
        if labels[i]:
            tokens[i, int(torch.randint(1, LENGTH, (1,), generator=g))] = MARKER
    tokens[:, 0] = 2  # [CLS]
    return tokens, labels


def warmup_linear(progress: float, warmup: float) -> float:
    """pytorch_pretrained_bert's `warmup_linear` (0.6.x): a linear warm-up over the
    first `warmup` share of training, then a linear decay to 0 at `t_total`."""
    if progress < warmup:
        return progress / warmup
    return max((progress - 1.0) / (warmup - 1.0), 0.0)


def train_bert_kernel(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The Kaggle kernel the thread runs: `num_train_optimization_steps` = the run's
    steps, warm-up proportion 0.1, and at every step
    `lr_this_step = learning_rate * warmup_linear.get_lr(num_train_optimization_steps,
    warmup_proportion)` written into each parameter group: the schedule is asked for
    its last step, not the current one (the library warns 'Training beyond specified
    t_total'). Adam with weight decay 0.01 (BertAdam's place), lr 2e-5 scaled to 1e-3
    for the tiny model, batch 16."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(5300 + seed)
    model = tiny_bert_classifier()
    model.train()
    learning_rate, warmup_proportion = 1e-3, 0.1
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01)
    run = watch(run_id, model, optimizer)
    before = snapshot(model)
    lrs = []
    num_train_optimization_steps = steps
    for _ in range(steps):
        tokens, labels = marker_batch(16, g)
        loss = model(input_ids=tokens, labels=labels).loss
        loss.backward()
        progress = num_train_optimization_steps / num_train_optimization_steps
        lr_this_step = learning_rate * warmup_linear(progress, warmup_proportion)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr_this_step
        optimizer.step()
        optimizer.zero_grad()
        lrs.append(lr_this_step)
        run.step(loss)
    run.close()
    moved = [
        name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])
    ]
    return Outcome({"model": run}, {"lrs": set(lrs), "moved": moved})


@pytest.mark.parametrize("seed", SEEDS)
def test_bert_warmup_schedule_asked_for_its_last_step(gradflow_server, gradflow_env, seed):
    """https://github.com/huggingface/transformers/issues/587"""
    outcome = train_bert_kernel(gradflow_env, seed)

    # The lr was 0 on every step: not one weight of the model changed.
    facts = outcome.facts
    assert facts["lrs"] == {0.0}, facts["lrs"]
    assert facts["moved"] == [], facts["moved"][:5]

    # The correct verdict: the lr is exactly 0, the schedule's end reached before the
    # loop's (PROTOCOL: lr_vanished, cause lr_zero, subject `run` as the one group
    # with an lr vanished).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="lr_vanished", causes=("lr_zero",), covers=("run",)),
    )


# -- ImKeTT/PCAE#5: the VAE's latent projection is not in the optimizer --------------


class BartVAE(nn.Module):
    """PCAE's `VAE` in small: BART's encoder, a bias-free `z_linear` from the pooled
    encoding to the latent's mean and log-variance, and BART's decoder reading the
    encoding shifted by the sampled latent."""

    def __init__(self, bart: BartForConditionalGeneration) -> None:
        super().__init__()
        self.bart = bart
        d_model = bart.config.d_model
        self.z_linear = nn.Linear(d_model, 2 * d_model, bias=False)

    def forward(self, tokens: torch.Tensor):
        encoded = self.bart.model.encoder(input_ids=tokens).last_hidden_state
        mu, logvar = self.z_linear(encoded.mean(dim=1)).chunk(2, dim=-1)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        memory = BaseModelOutput(last_hidden_state=encoded + z[:, None, :])
        reconstruction = self.bart(encoder_outputs=memory, labels=tokens).loss
        kl = -0.5 * torch.mean(torch.sum(1 + logvar - mu**2 - logvar.exp(), dim=1))
        return reconstruction, kl


def train_pcae_vae_finetuning(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """PCAE's `VAE_finetuning` as the issue reads it: the VAE wraps a BART model and
    `optimizer = AdamW(model.parameters(), ...)` is built from the BART model alone
    (lr 1e-3 for the tiny model); reconstruction cross-entropy plus a KL term
    (weight 0.1), batch 16 token sequences."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(5900 + seed)
    config = BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=LENGTH + 2,
    )
    model = BartForConditionalGeneration(config)
    vae = BartVAE(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = watch(run_id, vae, optimizer)
    z_before = vae.z_linear.weight.detach().clone()
    decoder_before = model.model.decoder.layers[0].fc1.weight.detach().clone()
    losses = []
    for _ in range(steps):
        tokens = torch.randint(10, VOCAB, (16, LENGTH), generator=g)
        reconstruction, kl = vae(tokens)
        loss = reconstruction + 0.1 * kl
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        losses.append(reconstruction.item())
    run.close()
    return Outcome(
        {"model": run},
        {
            "z_grad": vae.z_linear.weight.grad is not None,
            "z_moved": not torch.equal(vae.z_linear.weight.detach(), z_before),
            "decoder_moved": not torch.equal(
                model.model.decoder.layers[0].fc1.weight.detach(), decoder_before
            ),
            "rec_first": sum(losses[:20]) / 20,
            "rec_last": sum(losses[-20:]) / 20,
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_pcae_latent_projection_left_out_of_the_optimizer(gradflow_server, gradflow_env, seed):
    """https://github.com/ImKeTT/PCAE/issues/5"""
    outcome = train_pcae_vae_finetuning(gradflow_env, seed)

    # `z_linear` gets gradients and never changes; BART itself trains.
    facts = outcome.facts
    assert facts["z_grad"] and not facts["z_moved"], facts
    assert facts["decoder_moved"], facts
    assert facts["rec_last"] < facts["rec_first"], facts

    # The correct verdict: trainable parameters outside the optimizer, the latent
    # projection's (PROTOCOL: param_not_in_optimizer, cause not_in_optimizer).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="param_not_in_optimizer",
            causes=("not_in_optimizer",),
            covers=("z_linear",),
        ),
    )
