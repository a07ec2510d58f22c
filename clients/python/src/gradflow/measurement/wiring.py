"""What is wrong in how the model is wired, seen once when the run registers: facts
only the live objects show, sent as the registration's ``wiring`` (protocol v1.5)
for the server to word as alerts.

- ``freeze_flag_ignored``: ``module.requires_grad = False`` set as a plain attribute,
  which ``nn.Module`` never reads, on a module whose parameters still require grad.
- ``modules_not_registered``: modules held in a plain list, tuple or dict attribute
  (or in such containers nested in one: ``[[nn.Linear(...), nn.Tanh()], ...]``), so
  ``model.parameters()`` (and the optimizer built from it) never sees them.
- ``tied_weights_untied``: a Hugging Face config with ``tie_word_embeddings`` whose
  input and output embeddings are two tensors.
- ``param_group_empty`` (protocol v1.6): a param group with no parameter whose lr
  differs from every group that holds some, while every parameter of the model trains.
- ``tensors_not_registered`` (protocol v1.9): a module attribute holding tensors that
  require grad but are not parameters (``self.w = torch.zeros(..., requires_grad=True)``):
  outside ``parameters()`` and the optimizer, their gradients pile up and they never
  change. :class:`LooseTensors` notes them at registration and says them after the
  first steps if backward has written a gradient into the same tensors and their
  values are unchanged, so that a tensor the forward makes anew each call (an input
  kept for a gradient penalty) or one an unwatched optimizer trains is not one.

Host-side attribute reads, once per run; the only tensor data read is a copy of each
loose tensor of at most 65536 elements, compared once with the tensor after the
first steps.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Set, Tuple

import torch
from torch import nn

from .. import wire
from .._log import swallow

# Findings sent at most (the protocol's limit is 256).
MAX_FINDINGS = 64
# Levels of plain containers looked into for modules: a list of lists of layers is
# two; deeper nesting of modules in plain containers is not seen in practice.
CONTAINER_DEPTH = 3


def findings(model: nn.Module) -> List[wire.WiringFinding]:
    out: List[wire.WiringFinding] = []
    # Held elsewhere in the model (a child keeping a list of its siblings) is fine.
    registered = {id(p) for p in model.parameters()}
    for name, module in model.named_modules():
        out.extend(_freeze_flag(name, module))
        out.extend(_plain_containers(name, module, registered))
    out.extend(_untied_embeddings(model))
    return out[:MAX_FINDINGS]


def _freeze_flag(name: str, module: nn.Module) -> List[wire.WiringFinding]:
    # An instance attribute: nn.Module defines no `requires_grad`, so the assignment
    # landed in the module's __dict__ and changed nothing.
    if vars(module).get("requires_grad") is not False:
        return []
    live = [p for p in module.parameters() if p.requires_grad]
    if not live:
        return []
    return [{"kind": "freeze_flag_ignored", "module": name, "params": len(live)}]


def _plain_containers(
    name: str, module: nn.Module, registered: Set[int]
) -> List[wire.WiringFinding]:
    found: List[wire.WiringFinding] = []
    for attribute, value in vars(module).items():
        if attribute.startswith("_") or not isinstance(value, (list, tuple, dict)):
            continue
        held = list(_modules_within(value, CONTAINER_DEPTH))
        if not held:
            continue
        outside = {id(p): p for m in held for p in m.parameters() if id(p) not in registered}
        if outside:
            found.append(
                {
                    "kind": "modules_not_registered",
                    "module": name,
                    "attribute": attribute,
                    "params": len(outside),
                }
            )
    return found


def _modules_within(value: Any, depth: int) -> Iterator[nn.Module]:
    """The modules in a plain list, tuple or dict `value`, and in the plain
    containers within it down to `depth` levels (a list of [layer, activation]
    pairs)."""
    items = value.values() if isinstance(value, dict) else value
    for item in items:
        if isinstance(item, nn.Module):
            yield item
        elif depth > 1 and isinstance(item, (list, tuple, dict)):
            yield from _modules_within(item, depth - 1)


def _untied_embeddings(model: nn.Module) -> List[wire.WiringFinding]:
    config: Any = getattr(model, "config", None)
    tied = getattr(config, "tie_word_embeddings", None)
    if tied is None:  # a model of its own that says it on itself
        tied = getattr(model, "tie_word_embeddings", False)
    if tied is not True:
        return []
    inputs, outputs = _embeddings(model)
    weight_in = getattr(inputs, "weight", None)
    weight_out = getattr(outputs, "weight", None)
    if weight_in is None or weight_out is None or weight_in is weight_out:
        return []
    names: Dict[int, str] = {id(m): n for n, m in model.named_modules()}
    return [{"kind": "tied_weights_untied", "module": names.get(id(outputs), ""), "params": 2}]


def _embeddings(model: nn.Module) -> Tuple[Optional[nn.Module], Optional[nn.Module]]:
    """The input embedding and the output projection: Hugging Face's accessors, else
    the first ``nn.Embedding`` and the last ``nn.Linear`` of the same shape."""
    try:
        return model.get_input_embeddings(), model.get_output_embeddings()  # type: ignore[operator]
    except (AttributeError, NotImplementedError, TypeError):
        pass
    modules = list(model.modules())
    embedding = next((m for m in modules if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        return None, None
    shape = embedding.weight.shape
    head = next(
        (m for m in reversed(modules) if isinstance(m, nn.Linear) and m.weight.shape == shape),
        None,
    )
    return embedding, head


def empty_groups(model: nn.Module, optimizer: Any) -> List[wire.WiringFinding]:
    """Param groups that hold no parameter and whose lr differs from every group that
    holds some, when every parameter of the model trains in the optimizer (a name
    filter that matched nothing: the parameters meant for the group train at another
    lr). Silent when some parameters are frozen or outside the optimizer: the empty
    group may be kept for them (unfrozen later), and the lr they will get is not
    known. An empty group at the same lr (a no-weight-decay group on a model without
    biases) changes no parameter's lr: silent too."""
    try:
        groups = list(getattr(optimizer, "param_groups", None) or [])
        held = {id(p) for g in groups for p in g.get("params", [])}
        if not held or any(not p.requires_grad or id(p) not in held for p in model.parameters()):
            return []
        lrs = [_lr(g) for g in groups if g.get("params")]
        found: List[wire.WiringFinding] = []
        for i, g in enumerate(groups):
            lr = _lr(g)
            if g.get("params") or lr is None:
                continue
            if all(other is None or not math.isclose(lr, other, rel_tol=1e-9) for other in lrs):
                found.append(
                    {"kind": "param_group_empty", "module": "", "attribute": str(i), "params": 0}
                )
        return found
    except Exception as exc:
        swallow("reading the optimizer's param groups", exc)
        return []


def _lr(group: Dict[str, Any]) -> Optional[float]:
    try:
        lr = float(group.get("lr"))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return lr if math.isfinite(lr) else None


# Calls of LooseTensors.findings before the noted tensors are judged (gf.step and
# the optimizer's pre-step hook each make one: a few steps), and after which they
# are no longer looked at.
LOOSE_SETTLE = 6
LOOSE_LOOKS = 32
# Elements of a noted tensor copied to see whether anything changed its values
# (beside its version counter, which in-place updates bump but `.data` writes do not).
LOOSE_COPY = 1 << 16


class _Seen(NamedTuple):
    """A loose tensor as registration found it."""

    ref: weakref.ref[torch.Tensor]
    version: int
    copy: Optional[torch.Tensor]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Seen:
        small = tensor.numel() <= LOOSE_COPY
        copy = tensor.detach().clone() if small else None
        return cls(weakref.ref(tensor), tensor._version, copy)

    def unchanged(self, tensor: torch.Tensor) -> bool:
        if tensor._version != self.version:
            return False
        return self.copy is None or torch.equal(tensor.detach(), self.copy)


# Per attribute, the loose tensors it held at registration; and a module's name, the
# module and those of its attributes.
_Attributes = List[Tuple[str, List[_Seen]]]
_Noted = Tuple[str, nn.Module, _Attributes]


class LooseTensors:
    """Tensors kept as module attributes that a gradient reaches and nothing updates.
    Noted once at registration; said once per module when, after the first steps,
    the attributes still hold the same tensors, backward has written their ``.grad``
    and their values are as registration found them: one finding names every such
    attribute of the module (comma-separated). A tensor the forward makes anew is
    not the one noted; one that an optimizer gradflow does not watch updates (SAC's
    ``log_alpha``) changes."""

    def __init__(self, model: nn.Module, optimizer: Any) -> None:
        self._noted: List[_Noted] = []
        self._looks = 0
        try:
            self._noted = _loose_tensors(model, optimizer)
        except Exception as exc:
            swallow("looking for tensors that are not parameters", exc)

    def findings(self) -> List[wire.WiringFinding]:
        if not self._noted:
            return []
        self._looks += 1
        if self._looks < LOOSE_SETTLE:
            return []
        try:
            found: List[wire.WiringFinding] = []
            waiting = []
            for name, module, attributes in self._noted:
                kept = _still_held(module, attributes)
                if not kept:
                    continue
                if any(t.grad is not None for _, tensors in kept for t in tensors):
                    found.append(
                        {
                            "kind": "tensors_not_registered",
                            "module": name,
                            "attribute": ", ".join(a for a, _ in kept),
                            "params": sum(len(tensors) for _, tensors in kept),
                        }
                    )
                else:
                    waiting.append((name, module, attributes))
            self._noted = waiting if self._looks < LOOSE_LOOKS else []
            return found
        except Exception as exc:
            swallow("looking for tensors that are not parameters", exc)
            self._noted = []
            return []


def _still_held(module: nn.Module, attributes: _Attributes) -> List[Tuple[str, List[torch.Tensor]]]:
    """The attributes that still hold the tensors noted in them, unchanged: one the
    forward assigned anew is the forward's own tensor, and one whose values changed
    is trained by something, not a weight left behind."""
    kept = []
    for attribute, seen in attributes:
        tensors = [(s, s.ref()) for s in seen]
        held = {id(t) for t in _tensors_in(vars(module).get(attribute))}
        if all(t is not None and id(t) in held and s.unchanged(t) for s, t in tensors):
            kept.append((attribute, [t for _, t in tensors if t is not None]))
    return kept


def _loose_tensors(model: nn.Module, optimizer: Any) -> List[_Noted]:
    """Per module, the attributes holding floating-point leaf tensors (themselves, or
    in a plain list, tuple or dict) that require grad and are neither the model's
    parameters nor in the optimizer's param groups. Buffers and parameters live in
    the module's own tables, not in its ``__dict__``."""
    owned = {id(p) for p in model.parameters()}
    for group in getattr(optimizer, "param_groups", None) or []:
        owned.update(id(p) for p in group.get("params", []))
    noted: List[_Noted] = []
    for name, module in model.named_modules():
        attributes: _Attributes = []
        for attribute, value in vars(module).items():
            loose = [
                _Seen.of(t)
                for t in _tensors_in(value)
                if t.requires_grad
                and t.is_leaf
                and t.is_floating_point()
                and not isinstance(t, nn.Parameter)
                and id(t) not in owned
            ]
            if loose:
                attributes.append((attribute, loose))
        if attributes:
            noted.append((name, module, attributes))
            if len(noted) >= MAX_FINDINGS:
                break
    return noted


def _tensors_in(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []
