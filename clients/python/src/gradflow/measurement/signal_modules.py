"""The modules the instability signals are read from, found in the model without user
code, or the ones the user pointed at (``watch(signal_modules=...)``).

- Attention modules: the innermost modules whose class name ends in ``Attention``
  (``LlamaAttention``, ``Qwen2Attention``, ``MixtralAttention``, ``Qwen2MoeAttention``,
  torch's ``MultiheadAttention``, a user's ``CausalSelfAttention``).
- Blocks: the repeated layers that hold them, items of an ``nn.ModuleList`` (a
  decoder layer, ``model.layers.0``).
- Routers: the ``gate`` of a module that has a ``gate`` and ``experts`` (Mixtral's and
  Qwen2-MoE's sparse MoE blocks); the MoE layer is named by that block.
- The output head: ``get_output_embeddings()`` of a Hugging Face causal LM, else a
  module named ``lm_head``.
- The input embedding (whose token ids the ``tokens`` family reads):
  ``get_input_embeddings()`` of a Hugging Face model, else the model's first
  ``nn.Embedding`` (token embeddings come before position embeddings in GPT-2,
  nanoGPT and their kin).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from torch import nn

from .signals import SignalSettings

Named = Tuple[str, nn.Module]


@dataclass(frozen=True)
class Router:
    """An MoE layer's router: `name` names the layer in the record, `module` is the
    router whose output is read, with its expert count and top-k when known (None:
    taken from the output, or 1)."""

    name: str
    module: nn.Module
    experts: Optional[int]
    top_k: Optional[int]


@dataclass(frozen=True)
class SignalModules:
    """Where each forward-pass family is read."""

    attention: List[Named] = field(default_factory=list)
    blocks: List[Named] = field(default_factory=list)
    routers: List[Router] = field(default_factory=list)
    output: Optional[Named] = None
    embedding: Optional[Named] = None

    def families(self) -> Dict[str, bool]:
        """Which forward-pass families have something to read."""
        return {
            "attention": bool(self.attention),
            "activations": bool(self.blocks),
            "moe": bool(self.routers),
            "output_logits": self.output is not None,
            "tokens": self.embedding is not None,
        }


def find(model: nn.Module, settings: SignalSettings) -> SignalModules:
    """The modules of `model` each family reads: the ones the user named for a kind,
    else those recognised. Raises ValueError for a name the model does not have."""
    named = list(model.named_modules())
    given = settings.modules
    attention = _given(model, named, given, "attention")
    if attention is None:
        attention = attention_modules(named)
    blocks = _given(model, named, given, "blocks")
    if blocks is None:
        blocks = blocks_holding(named, attention)
    routers_given = _given(model, named, given, "routers")
    routers = (
        [Router(name, m, None, _top_k(m)) for name, m in routers_given]
        if routers_given is not None
        else moe_routers(named)
    )
    output = _given(model, named, given, "output")
    head = output[0] if output else (None if output is not None else output_head(model, named))
    embedding = _given(model, named, given, "embedding")
    tokens = (
        embedding[0]
        if embedding
        else (None if embedding is not None else input_embedding(model, named))
    )
    return SignalModules(attention, blocks, routers, head, tokens)


def attention_modules(named: List[Named]) -> List[Named]:
    """The innermost modules whose class name ends in ``Attention``."""
    found = [(n, m) for n, m in named if n and type(m).__name__.endswith("Attention")]
    names = [n for n, _ in found]
    return [(n, m) for n, m in found if not any(o.startswith(n + ".") for o in names)]


def blocks_holding(named: List[Named], attention: List[Named]) -> List[Named]:
    """For each attention module, the nearest module above it that is an item of an
    ``nn.ModuleList`` (a decoder layer), once each, in the model's order."""
    lists = {n for n, m in named if isinstance(m, nn.ModuleList)}
    wanted = set()
    for name, _ in attention:
        parts = name.split(".")
        for end in range(len(parts) - 1, 0, -1):
            if ".".join(parts[: end - 1]) in lists and end - 1 > 0:
                wanted.add(".".join(parts[:end]))
                break
    return [(n, m) for n, m in named if n in wanted]


def moe_routers(named: List[Named]) -> List[Router]:
    """The routers of sparse MoE blocks: a module with a ``gate`` and ``experts``."""
    routers = []
    for name, block in named:
        gate = getattr(block, "gate", None)
        experts = getattr(block, "experts", None)
        if not isinstance(gate, nn.Module) or not isinstance(experts, nn.Module):
            continue
        count = _expert_count(block, gate)
        top_k = _top_k(gate) or _top_k(block)
        routers.append(Router(name, gate, count, top_k))
    return routers


def output_head(model: nn.Module, named: List[Named]) -> Optional[Named]:
    """A causal LM's output head: Hugging Face's ``get_output_embeddings()``, else a
    module named ``lm_head``."""
    head = _declared(model, "get_output_embeddings")
    for name, module in named:
        if (head is not None and module is head) or (head is None and name == "lm_head"):
            return name, module
    return None


def input_embedding(model: nn.Module, named: List[Named]) -> Optional[Named]:
    """The module the token ids go into: Hugging Face's ``get_input_embeddings()``,
    else the model's first ``nn.Embedding``."""
    embedding = _declared(model, "get_input_embeddings")
    for name, module in named:
        if module is embedding or (embedding is None and isinstance(module, nn.Embedding)):
            return name, module
    return None


def _declared(model: nn.Module, getter_name: str) -> Any:
    """What a Hugging Face model's getter (``get_input_embeddings``...) returns; None
    without one, or when the model does not implement it."""
    getter = getattr(model, getter_name, None)
    if not callable(getter):
        return None
    try:
        return getter()
    except (NotImplementedError, AttributeError):
        return None


def _expert_count(block: nn.Module, gate: nn.Module) -> Optional[int]:
    for owner, attr in ((gate, "num_experts"), (block, "num_experts")):
        value = getattr(owner, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    if isinstance(gate, nn.Linear):
        return gate.out_features
    weight = getattr(gate, "weight", None)
    return int(weight.shape[0]) if weight is not None and weight.dim() == 2 else None


def _top_k(module: nn.Module) -> Optional[int]:
    for attr in ("top_k", "num_experts_per_tok"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _given(
    model: nn.Module, named: List[Named], given: Dict[str, List[Any]], kind: str
) -> Optional[List[Named]]:
    """The modules the user named for `kind`, by name or as objects; None: not given."""
    if kind not in given:
        return None
    by_name = dict(named)
    by_id = {id(m): n for n, m in named}
    out = []
    for item in given[kind]:
        if isinstance(item, nn.Module):
            name = by_id.get(id(item))
            if name is None:
                raise ValueError(
                    f"signal_modules[{kind!r}]: {type(item).__name__} is not a module of "
                    "the watched model"
                )
            out.append((name, item))
        elif isinstance(item, str) and item in by_name:
            out.append((item, by_name[item]))
        else:
            example = next((n for n, _ in named if n), "layers.0")
            raise ValueError(
                f"signal_modules[{kind!r}]: the model has no module named {item!r} "
                f"(names as model.named_modules() gives them, e.g. {example!r})"
            )
    return out
