"""The tiny models and the plain training loop the end-to-end tests share (torch and
transformers); ``conftest`` hands them out on first use."""

from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch import nn
from transformers import Qwen2Config, Qwen2Model

# -- the model ---------------------------------------------------------------------

VOCAB = 64
HIDDEN = 48
ACTIONS = 8
PROMPT = 12


def qwen_config(**overrides: Any) -> Qwen2Config:
    """A tiny random Qwen2 (no hub): 2 layers, hidden 48."""
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    return Qwen2Config(**settings)


class AgentHead(nn.Module):
    """The agent: the prompt's last hidden state -> a norm -> an action."""

    def __init__(self, hidden: int = HIDDEN, actions: int = ACTIONS) -> None:
        super().__init__()
        self.prompt_proj = nn.Linear(hidden, hidden)
        self.norm = nn.RMSNorm(hidden)
        self.hidden = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, actions)

    def forward(self, prompt: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.prompt_proj(prompt))
        x = self.norm(x)
        return self.head(torch.relu(self.hidden(x)) + x)


class PromptAgent(nn.Module):
    """A Qwen2 prompt encoder whose last hidden state feeds the agent head; groups
    `qwen` and `agent`, like gradflow's Rust trainer."""

    def __init__(self, seed: int = 0, detach_prompt: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.qwen = Qwen2Model(qwen_config())
        self.agent = AgentHead()
        self.detach_prompt = detach_prompt

    def encode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.qwen(input_ids=tokens).last_hidden_state[:, -1]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.detach_prompt:
            with torch.no_grad():  # the seed bug: the prompt encoder cut from backward
                prompt = self.encode(tokens)
        else:
            prompt = self.encode(tokens)
        return self.agent(prompt)


def batches(steps: int, batch: int = 8, seed: int = 1):
    """A learnable task: the action is the first token modulo the action count."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (batch, PROMPT), generator=g)
        yield tokens, tokens[:, 0] % ACTIONS


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    gf: Any,
    steps: int,
    scaler: Any = None,
    autocast: Optional[torch.dtype] = None,
    before_step: Any = None,
    after_backward: Any = None,
) -> List[float]:
    """A plain PyTorch loop; returns the losses. `before_step(step)` runs before the
    forward pass, `after_backward(step)` between backward and the optimizer step."""
    losses = []
    for step, (tokens, target) in enumerate(batches(steps)):
        if before_step is not None:
            before_step(step)
        optimizer.zero_grad(set_to_none=True)
        if autocast is not None:
            with torch.autocast("cpu", dtype=autocast):
                logits = model(tokens)
        else:
            logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.float(), target)
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if after_backward is not None:
            after_backward(step)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if gf is not None:
            gf.step(loss=loss)
        losses.append(loss.item())
    return losses
