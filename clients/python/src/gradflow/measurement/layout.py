"""What a parameter is, read from the live model: its module, role and group."""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

GroupsArg = Union[None, Callable[[str], Optional[str]], Mapping[str, Any]]

_WRAPPER = re.compile(r"For[A-Z]\w*$")

DTYPES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
}


def dtype_name(dtype: torch.dtype) -> Optional[str]:
    """The protocol's name of a floating dtype; None for any other (int8, float8)."""
    return DTYPES.get(dtype)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside DistributedDataParallel / DataParallel, whose names
    would otherwise all start with ``module.``."""
    while type(model).__name__ in ("DistributedDataParallel", "DataParallel") and hasattr(
        model, "module"
    ):
        inner = model.module
        assert isinstance(inner, nn.Module)
        model = inner
    return model


def unwrap_optimizer(optimizer: Any) -> Any:
    """The innermost torch optimizer (Accelerate's AcceleratedOptimizer wraps one and
    forwards ``step`` to it; hooks must sit on the inner one)."""
    seen = 0
    while (
        seen < 8
        and hasattr(optimizer, "optimizer")
        and isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)
    ):
        optimizer = optimizer.optimizer
        seen += 1
    return optimizer


def is_norm(module: nn.Module) -> bool:
    cls = type(module).__name__
    if cls.endswith("Norm"):
        return True
    kinds: Tuple[type, ...] = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)
    rms = getattr(nn, "RMSNorm", None)
    if rms is not None:
        kinds = kinds + (rms,)
    return isinstance(module, kinds)


def role(module: nn.Module, local_name: str, param: torch.Tensor) -> str:
    """``norm`` for a norm layer's weight, then ``bias``, ``embedding``, ``linear``."""
    if is_norm(module):
        if local_name == "weight":
            return "norm"
        return "bias" if local_name == "bias" else "other"
    if local_name == "bias" or local_name.endswith("_bias"):
        return "bias"
    cls = type(module).__name__
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or "Embedding" in cls:
        return "embedding"
    linear_kinds = (nn.Linear, nn.modules.conv._ConvNd)
    if local_name == "weight" and (
        isinstance(module, linear_kinds) or cls.endswith("Linear") or cls == "Conv1D"
    ):
        return "linear"
    return "other"


def _has_own_params(module: nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def container_prefix(model: nn.Module) -> str:
    """The dotted path of the module whose children are the default groups.

    Usually the model itself. A wrapper such as ``Qwen2ForCausalLM`` (a class named
    ``…For<Task>`` with ``base_model_prefix``) or a module with a single
    parameter-holding child and no parameters of its own is looked through, so a
    Hugging Face model gets ``model.layers``, ``model.embed_tokens``, ``lm_head``…
    instead of one group ``model``.
    """
    path = []
    module = model
    for _ in range(4):
        if _has_own_params(module):
            break
        kids = [
            (n, c) for n, c in module.named_children() if next(c.parameters(), None) is not None
        ]
        prefix = getattr(module, "base_model_prefix", None)
        if len(kids) == 1:
            name, child = kids[0]
        elif _WRAPPER.search(type(module).__name__) and prefix in dict(kids):
            name, child = prefix, dict(kids)[prefix]
        else:
            break
        path.append(name)
        module = child
    return ".".join(path)


def group_resolver(model: nn.Module, groups: GroupsArg) -> Callable[[str], str]:
    """``param name -> group``: the user's choice first, then the default."""
    prefix = container_prefix(model)

    def default(name: str) -> str:
        if prefix and name.startswith(prefix + "."):
            rest = name[len(prefix) + 1 :]
            head = rest.split(".", 1)[0]
            # A parameter of the container itself (no further dot) keeps its own name.
            return f"{prefix}.{head}"
        return name.split(".", 1)[0]

    if groups is None:
        return default
    if callable(groups) and not isinstance(groups, Mapping):
        user = groups

        def from_callable(name: str) -> str:
            chosen = user(name)
            return chosen if chosen else default(name)

        return from_callable
    if isinstance(groups, Mapping):
        return _from_mapping(model, groups, default)
    raise TypeError("groups must be a callable (param name -> group) or a mapping")


def _from_mapping(
    model: nn.Module, groups: Mapping[str, Any], default: Callable[[str], str]
) -> Callable[[str], str]:
    """``{group: prefix | module | [prefixes or modules]}``; the longest prefix wins."""
    module_names: Dict[int, str] = {id(m): n for n, m in model.named_modules()}
    prefixes: list[tuple[str, str]] = []
    for group, spec in groups.items():
        items: Sequence[Any] = spec if isinstance(spec, (list, tuple)) else [spec]
        for item in items:
            if isinstance(item, nn.Module):
                if id(item) not in module_names:
                    raise ValueError(f"groups[{group!r}]: the module is not part of the model")
                prefixes.append((module_names[id(item)], group))
            elif isinstance(item, str):
                prefixes.append((item, group))
            else:
                raise TypeError(f"groups[{group!r}]: expected a name prefix or a module")
    prefixes.sort(key=lambda pg: len(pg[0]), reverse=True)

    def resolve(name: str) -> str:
        for prefix, group in prefixes:
            if prefix == "" or name == prefix or name.startswith(prefix + "."):
                return group
        return default(name)

    return resolve
