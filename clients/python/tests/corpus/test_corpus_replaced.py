"""Corpus: parameters replaced, re-created or never registered, so the optimizer
steps tensors the model no longer uses (or never sees the ones it does)."""

from __future__ import annotations

import torch
from corpus_support import (
    FIRST_STEPS,
    STUCK_WINDOW,
    Classifier,
    class_loss,
    expects,
    judge,
    moved,
    next_token_loss,
    quickstart,
    seeded,
    snapshot,
    three_windows,
    tiny_qwen,
    train_step,
)
from torch import nn

# The replaced parameters get gradients the optimizer never uses: grad_stuck_zero
# must not call them cut off, over three of its windows.
REPLACED_STEPS = three_windows(STUCK_WINDOW)
# The registration and first-steps checks, three times over.
EARLY_STEPS = three_windows(FIRST_STEPS)


@seeded
@expects("param_not_in_optimizer", "lm_head", "replaced_after_optimizer")
def test_resize_token_embeddings_after_the_optimizer(request, gradflow_server, gradflow_env, seed):
    """New tokens are added with `resize_token_embeddings` after the optimizer was
    built: the optimizer keeps stepping the old matrices, the model uses new ones that
    never change ("my token embeddings were not being updated"). Today's transformers
    resizes the input embedding in place, so the untied LM head is the one replaced.

    The thread gives no optimizer settings: AdamW at lr 1e-3.

    Thread: https://github.com/huggingface/transformers/pull/3532
    """
    model = tiny_qwen(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {}

    def resize():
        model.resize_token_embeddings(80)  # the tokenizer grew: new token rows
        state["before"] = snapshot(model)

    step = train_step(model, optimizer, seed=seed)
    run_id = quickstart(model, optimizer, step, steps=REPLACED_STEPS, before=resize)
    changed = moved(state["before"], model)
    assert "lm_head.weight" not in changed
    # The new head gets gradients, but the optimizer does not hold it.
    assert model.lm_head.weight.grad is not None
    assert id(model.lm_head.weight) not in {id(p) for p in optimizer.param_groups[0]["params"]}
    assert "model.embed_tokens.weight" in changed and "model.layers.0.mlp.up_proj.weight" in changed
    # The new head is measured: backward reaches it, so nothing says the graph is cut
    # (nothing else serious, by the declaration).
    alert = judge(request, gradflow_server, run_id)
    assert alert["evidence"]["params"] == ["lm_head.weight"]


@seeded
@expects("param_not_in_optimizer", "hidden", "replaced_after_optimizer")
def test_a_layer_replaced_after_the_optimizer(request, gradflow_server, gradflow_env, seed):
    """Pruning "speedup" replaces layers with new smaller ones and copies the weights
    in: the optimizer still holds the old layers' parameters, so fine-tuning the
    pruned model updates nothing of the replaced layers.

    The thread gives no optimizer settings: SGD with momentum 0.9 at lr 0.1.

    Thread: https://github.com/microsoft/nni/issues/4521
    """
    model = Classifier(seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = {}

    def speedup():
        old = model.hidden
        new = nn.Linear(old.in_features, old.out_features)
        with torch.no_grad():
            new.weight.copy_(old.weight)
            new.bias.copy_(old.bias)
        model.hidden = new
        state["before"] = snapshot(model)

    step = train_step(model, optimizer, class_loss, seed=seed)
    run_id = quickstart(model, optimizer, step, steps=REPLACED_STEPS, before=speedup)
    changed = moved(state["before"], model)
    assert "hidden.weight" not in changed and "head.weight" in changed
    assert model.hidden.weight.grad is not None
    assert id(model.hidden.weight) not in {id(p) for p in optimizer.param_groups[0]["params"]}
    alert = judge(request, gradflow_server, run_id)
    assert sorted(alert["evidence"]["params"]) == ["hidden.bias", "hidden.weight"]


class TutorialAttention(nn.Module):
    """The tutorial's multi-head attention: its output projection and layer norm are
    built inside `forward`, fresh (random) at every call."""

    def __init__(self, d_model: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.W_Q = nn.Linear(d_model, d_model)
        self.W_K = nn.Linear(d_model, d_model)
        self.W_V = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            w(x).view(b, t, self.heads, -1).transpose(1, 2) for w in (self.W_Q, self.W_K, self.W_V)
        )
        context = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, -1) @ v
        context = context.transpose(1, 2).reshape(b, t, d)
        output = nn.Linear(d, d)(context)  # the bug: a new, untrained layer every call
        return nn.LayerNorm(d)(output + x)


class TutorialModel(nn.Module):
    def __init__(self, vocab: int = 64, d_model: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.attention = TutorialAttention(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.attention(self.embed(tokens)))


@seeded
@expects("params_created_in_forward", "attention", "params_created_in_forward")
def test_layers_built_inside_forward(request, gradflow_server, gradflow_env, seed):
    """`nn.Linear(...)(context)` inside `forward`: the attention's output projection
    is a new random layer at every call, registered nowhere, never trained.

    The thread gives no optimizer settings we can use: Adam at lr 1e-3.

    Thread: https://github.com/graykode/nlp-tutorial/issues/29
    """
    torch.manual_seed(seed)
    model = TutorialModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    assert len(list(model.parameters())) == 9  # embed, 3 projections, head: no output proj

    step = train_step(model, optimizer, next_token_loss, seed=seed)
    run_id = quickstart(model, optimizer, step, steps=EARLY_STEPS)
    # Same input twice, different outputs: part of the model is redrawn each call.
    probe = torch.arange(8).view(1, 8)
    with torch.no_grad():
        outputs = [model(probe) for _ in range(2)]
    assert not torch.allclose(outputs[0], outputs[1])
    alert = judge(request, gradflow_server, run_id)
    # Per forward: the projection's weight and bias, the layer norm's two.
    assert alert["evidence"]["attribute"] == "Linear", alert["evidence"]
    assert alert["evidence"]["params"] >= 4, alert["evidence"]
    assert "__init__" in alert["fix"], alert["fix"]


class ListModel(nn.Module):
    """Hidden layers kept in a plain Python list: not registered."""

    def __init__(self, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(width, 32)
        self.layers = [nn.Linear(32, 32) for _ in range(2)]  # the bug: not nn.ModuleList
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.embed(x))
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


@seeded
@expects("modules_not_registered", "run", "modules_not_registered")
def test_hidden_layers_in_a_python_list(request, gradflow_server, gradflow_env, seed):
    """Layers stored in a Python list are not registered: `model.parameters()` leaves
    them out, so the optimizer never updates them while they get gradients.

    The thread gives no optimizer settings: Adam at lr 1e-2.

    Thread: https://github.com/pytorch/pytorch/issues/59925
    """
    torch.manual_seed(seed)
    model = ListModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    before = model.layers[0].weight.detach().clone()
    step = train_step(model, optimizer, class_loss, seed=seed)
    run_id = quickstart(model, optimizer, step, steps=EARLY_STEPS)
    assert model.layers[0].weight.grad is not None
    assert torch.equal(model.layers[0].weight.detach(), before)
    alert = judge(request, gradflow_server, run_id)
    assert alert["evidence"]["attribute"] == "layers" and "nn.ModuleList" in alert["fix"], alert


class SmallGPT(nn.Module):
    """A GPT whose config says the output projection is tied to the token embedding,
    but which never ties them (the line `lm_head.weight = wte.weight` is missing)."""

    tie_word_embeddings = True

    def __init__(self, vocab: int = 64, d_model: int = 32) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.block = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, d_model), nn.GELU())
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(self.wte.weight)  # same values, two tensors

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.wte(tokens)
        return self.lm_head(h + self.block(h))


@seeded
@expects("tied_weights_untied", "lm_head", "tied_weights_untied")
def test_tied_embeddings_left_untied(request, gradflow_server, gradflow_env, seed):
    """The model is meant to share its token embedding with the LM head, but the
    weights were never tied: they start equal and train apart, a model with twice the
    embedding parameters and not the one configured.

    The thread gives no optimizer settings: AdamW at lr 1e-3.

    Thread: https://github.com/mosaicml/examples/pull/11
    """
    torch.manual_seed(seed)
    model = SmallGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    step = train_step(model, optimizer, next_token_loss, seed=seed)
    run_id = quickstart(model, optimizer, step, steps=EARLY_STEPS)
    assert model.lm_head.weight is not model.wte.weight
    assert not torch.equal(model.lm_head.weight, model.wte.weight)  # drifted apart
    alert = judge(request, gradflow_server, run_id)
    assert "tie_weights" in alert["fix"], alert
