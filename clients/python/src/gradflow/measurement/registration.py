"""The run's registration, built from the live model, optimizer and scaler, and the
amendments that keep it true while training changes them."""

from __future__ import annotations

import itertools
import math
import operator
import socket
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, cast

import torch
from torch import nn

from .. import _torch_compat, wire
from . import autocast, layout, modes, ranks, wiring

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_DTYPE = operator.attrgetter("dtype")
_GRAD = operator.attrgetter("grad")

# replaced() walks the model on every this many calls (two a step) even when no
# registration was seen.
WALK_EVERY = 16

# The parameters' requires_grad and dtype are read at the first check of every this
# many steps, and of any step whose optimizer groups changed, whose model had a
# parameter or module assigned, or whose parameters holding a gradient, or those
# gradients' dtypes, are not those of the last check: a change of either made in
# step n is amended by step n + SIGNATURE_EVERY (a parameter unfrozen before a
# forward, frozen with its gradient set to None, or cast while it trains, on the
# step itself). Reading them every step was most of the
# amendment check's cost (~0.45 ms at 290 tensors on a CPU, passes over every
# parameter after backward), beside the gradients' own read. Where the worker reads
# the gradients (Registry.leave_grads_to_worker) it reads the parameters' too, and
# both are compared on every step, in the optimizer's post-step hook of that step.
SIGNATURE_EVERY = 4


# Which parameters hold a gradient, and those gradients' dtypes, in order.
GradsSeen = Tuple[Tuple[bool, ...], Tuple[torch.dtype, ...]]


def grads_seen(grads: Sequence[Optional[torch.Tensor]]) -> GradsSeen:
    """Which of `grads` are there and their dtypes: C-level maps, no Python frame per
    gradient."""
    presence = tuple(map(operator.is_not, grads, itertools.repeat(None)))
    return presence, tuple(map(_DTYPE, itertools.compress(grads, presence)))


# What the worker saw during the optimizer step: the gradients (GradsSeen), and the
# parameters' requires_grad and dtypes (the signature's first two parts).
StepSeen = Tuple[GradsSeen, Tuple[Tuple[bool, ...], Tuple[torch.dtype, ...]]]


def seen_during_step(
    tensors: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]]
) -> StepSeen:
    """What the registration check compares, read on the worker while the optimizer
    steps (which changes none of it): C-level maps over `tensors` and their `grads`."""
    return grads_seen(grads), (tuple(map(_REQUIRES_GRAD, tensors)), tuple(map(_DTYPE, tensors)))


@dataclass
class Param:
    """One named parameter of the watched model."""

    name: str
    tensor: torch.Tensor
    module: str
    group: str
    role: str


def _finite(x: Any) -> Optional[float]:
    try:
        value = float(x)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _betas(x: Any) -> Optional[List[float]]:
    try:
        b = [float(v) for v in x]
    except (TypeError, ValueError):
        return None
    if len(b) == 2 and all(math.isfinite(v) and 0 <= v < 1 for v in b):
        return b
    return None


def param_group_spec(index: int, group: Dict[str, Any], with_lr: bool = True) -> Dict[str, Any]:
    spec: Dict[str, Any] = {"name": str(index)}
    if with_lr and _finite(group.get("lr")) is not None:
        spec["lr"] = _finite(group.get("lr"))
    if _finite(group.get("weight_decay")) is not None:
        spec["weight_decay"] = _finite(group.get("weight_decay"))
    if "betas" in group and _betas(group["betas"]) is not None:
        spec["betas"] = _betas(group["betas"])
    if _finite(group.get("eps")) is not None:
        spec["eps"] = _finite(group.get("eps"))
    return spec


def scaler_kind(scaler: Any) -> str:
    if scaler is None:
        return "none"
    enabled = getattr(scaler, "is_enabled", None)
    if callable(enabled) and not enabled():
        return "none"
    growth, backoff = _torch_compat.scaler_growth_backoff(scaler)
    return "static" if growth == 1.0 and backoff == 1.0 else "dynamic"


class Registry:
    """The watched model's parameters and what was last told to the server."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any,
        scaler: Any,
        groups: layout.GroupsArg,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self._group_of = layout.group_resolver(model, groups)
        self.params: List[Param] = []
        self._tensors: List[torch.Tensor] = []
        # Each parameter's requires_grad at the last check (None before one), and
        # whether all of them require it.
        self.requires_grad: Optional[Tuple[bool, ...]] = None
        self.all_trainable = False
        self._signature_held = False
        # Steps whose first check did not read the signature since it was last read,
        # and whether the next check must read it whatever that count (the watch's end).
        self._steps_unread = 0
        self._signature_due = False
        # The parameters' gradients as the last check read them (for the gradient
        # read of the same hook: see take_grads), which of them were not None, and
        # the dtypes of those that were.
        self._grads: Optional[List[Optional[torch.Tensor]]] = None
        self._grads_of: Optional[List[torch.Tensor]] = None
        self._grad_presence: Optional[Tuple[bool, ...]] = None
        self._grad_dtypes: Optional[Tuple[torch.dtype, ...]] = None
        # Whether the next check leaves the gradients unread: the worker reads them
        # while the optimizer steps, and :meth:`grads_read_later` compares them.
        self._grads_later = False
        # Ranks in a run whose every rank reports (v1.4): parameters then say how
        # their elements are laid out across the ranks. 1 otherwise.
        self.world_size = 1
        # Whether a parameter or module was registered on one of the model's modules
        # since the last walk of the model (see replaced): set by torch's global
        # registration hooks.
        self._registered = True
        self._module_ids: Set[int] = set()
        self._checks = 0
        self._registration_hooks = _torch_compat.registration_hooks(self._on_registration)
        # Learnable tensors that are not parameters, said once a gradient reached them.
        self._loose = wiring.LooseTensors(model, optimizer)
        # The forward's autocast dtype, known once the loop's first forwards ran.
        self._autocast = autocast.AutocastProbe(model)
        self._rescan()
        self._sent_specs: Dict[str, Dict[str, Any]] = {}
        self._sent_groups: Dict[str, Dict[str, Any]] = {}
        self._sent_param_dtype: Optional[str] = None
        self._signature = self._live_signature()

    # -- reading the live objects ------------------------------------------------

    def _rescan(self) -> None:
        modules = dict(self.model.named_modules())
        params = []
        for name, tensor in self.model.named_parameters():
            module_name, _, local = name.rpartition(".")
            owner = modules.get(module_name, self.model)
            params.append(
                Param(
                    name=name,
                    tensor=tensor,
                    module=module_name or name,
                    group=self._group_of(name),
                    role=layout.role(owner, local, tensor),
                )
            )
        self.params = params
        self._tensors = [p.tensor for p in params]
        self._structure = self._read_structure()
        self._module_ids = {id(m) for m, _, _ in self._structure or []}

    def _read_structure(self) -> Optional[List[Tuple[nn.Module, Dict[str, Any], Tuple[int, ...]]]]:
        """Each module of the model, its children and the identity of its own
        parameters, as registered: what :meth:`replaced` compares with. None for a
        model with sharded (DTensor) parameters, whose modules swap their parameters
        between the sharded and the gathered tensor on their own."""
        if any(_torch_compat.is_dtensor(p.tensor) for p in self.params):
            return None
        return [
            (m, dict(m._modules), tuple(map(id, m._parameters.values())))
            for m in self.model.modules()
        ]

    def replaced(self) -> bool:
        """Whether a parameter name now resolves to another tensor than the one
        registered: a parameter or module replaced, added or removed since (a
        ``resize_token_embeddings``, a layer swapped for a new one). Host-side identity
        checks, one per module and parameter (~180 µs for a 24-layer Qwen2), made
        only when torch's registration hooks saw a parameter or module assigned to
        one of the model's modules since the last walk, and every ``WALK_EVERY``-th
        call regardless: a change the hooks cannot see (``del``, a write to
        ``_parameters``) is still found within a few steps, long before any threshold
        a stale tensor could trip."""
        structure = self._structure
        if structure is None:
            return False
        self._checks += 1
        if self._registration_hooks and not self._registered and self._checks % WALK_EVERY:
            return False
        self._registered = False
        for module, children, own in structure:
            if module._modules != children:
                return True
            if tuple(map(id, module._parameters.values())) != own:
                return True
        return False

    def _on_registration(self, module: Any, _name: str, _value: Any) -> None:
        # Only the watched model's own modules: Hugging Face models build a new
        # ModuleList on every forward (`self.layers[:n]`), which would otherwise make
        # every check walk the model.
        if id(module) in self._module_ids:
            self._registered = True

    def remove(self) -> None:
        """Removes the registration hooks (the watch is over)."""
        for handle in self._registration_hooks:
            handle.remove()
        self._registration_hooks = []
        self._autocast.remove()

    def _membership(self) -> Dict[int, int]:
        """id(parameter) -> index of the optimizer's parameter group holding it."""
        where: Dict[int, int] = {}
        if self.optimizer is None:
            return where
        for index, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                where.setdefault(id(p), index)
        return where

    def release_signature(self) -> None:
        """The step is over (``gf.step``): the next amendment check reads the
        signature again. Until then, the signature read by a step's first check (the
        optimizer's pre-step hook, where the gradients are read against it) stands,
        and the later checks of the step skip reading it: a change made between then
        and ``gf.step`` is seen at the next step's first check, the first step it
        trains."""
        self._signature_held = False

    def read_signature_next(self) -> None:
        """The next amendment check reads the signature whatever the step (the watch
        is ending: nothing comes after to catch a change)."""
        self._signature_due = True
        self._signature_held = False

    def _optimizer_counts(self) -> Tuple[int, int]:
        """The optimizer's group count and the parameters its groups hold: one look
        per group, cheap enough for every step; ``add_param_group`` changes it."""
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        return len(groups), sum(len(g["params"]) for g in groups)

    def take_grads(self, tensors: Sequence[torch.Tensor]) -> Optional[List[Any]]:
        """The gradients of `tensors` as the amendment check just read them, or None
        when it read none (or of other tensors): the gradient read that follows the
        check in the same hook then makes no pass of its own. Taken once."""
        grads, self._grads = self._grads, None
        if grads is None or self._grads_of is not self._tensors or len(tensors) != len(grads):
            return None
        return grads

    def leave_grads_to_worker(self) -> None:
        """The next check leaves the gradients unread: on a CPU the worker reads them
        while the optimizer steps (the first read after backward, which wraps each
        fresh ``.grad`` in a Python object: ~0.4 ms at 290 tensors, which the
        optimizer's own loop pays when nothing read them before it), with the
        parameters' requires_grad and dtypes, and what it saw is compared after the
        step (:meth:`grads_read_later`): read on the training thread before the step,
        the parameters were the first touch after backward (~0.45 ms a read at 290
        tensors)."""
        self._grads_later = True

    def grads_read_later(self, seen: StepSeen) -> bool:
        """What the worker saw during the optimizer step (:func:`seen_during_step`),
        compared as the check would have, on every step: when the parameters holding
        a gradient, those gradients' dtypes, or the parameters' requires_grad or
        dtypes changed, the next check reads the signature (the post-step hook makes
        it), so a cast, a freeze or an unfreeze is amended on its own step. Whether
        that check is due."""
        grads, params = seen
        changed = self._grads_changed(grads)
        self._steps_unread = 0  # compared just now
        if changed or params != self._signature[:2]:
            self._signature_due = True
            self._signature_held = False
            return True
        return False

    def _grads_changed(self, seen: Optional[GradsSeen] = None) -> bool:
        """Reads the gradients (kept for :meth:`take_grads`) unless `seen` says what
        they were: whether the parameters holding one, or those gradients' dtypes,
        are not those of the last check. A pointer comparison and a dtype read each,
        C-level, on the gradients the gradient norms read anyway (their objects just
        touched): a parameter cast while it trains gets a gradient of its new dtype on
        the step of the cast."""
        if seen is None:
            grads = list(map(_GRAD, self._tensors))
            self._grads, self._grads_of = grads, self._tensors
            seen = grads_seen(grads)
        presence, dtypes = seen
        changed = presence != self._grad_presence or dtypes != self._grad_dtypes
        self._grad_presence, self._grad_dtypes = presence, dtypes
        return changed

    def _skips_signature(self, grads_later: bool) -> bool:
        """Whether this step's first check may leave the parameters unread: the
        signature was read fewer than ``SIGNATURE_EVERY`` steps ago, the optimizer's
        groups are as they were then, and so are the parameters that hold a
        gradient and those gradients' dtypes (`grads_later`: those and the
        parameters are compared by :meth:`grads_read_later`, after the optimizer
        step)."""
        if self._signature_due:
            return False
        if grads_later:
            return self._optimizer_counts() == self._signature[2:]
        if self._grads_changed() or self._steps_unread + 1 >= SIGNATURE_EVERY:
            return False
        if self._optimizer_counts() != self._signature[2:]:
            return False
        self._steps_unread += 1
        return True

    def _live_signature(self) -> Tuple[Any, ...]:
        """Changes whenever an amendment may be due: two C-level passes over the
        parameters (~30 µs each at 290 tensors when they are in the caches, ~0.2 ms
        when a training step has just pushed them out), read every
        ``SIGNATURE_EVERY``-th step. Also keeps the parameters' ``requires_grad`` for
        the gradient reads until the next read."""
        tensors = self._tensors
        requires_grad = tuple(map(_REQUIRES_GRAD, tensors))
        self.requires_grad = requires_grad
        self.all_trainable = all(requires_grad)
        self._steps_unread = 0
        self._signature_due = False
        return (requires_grad, tuple(map(_DTYPE, tensors)), *self._optimizer_counts())

    def param_spec(self, p: Param, membership: Dict[int, int]) -> Dict[str, Any]:
        spec: Dict[str, Any] = {
            "name": p.name,
            "module": p.module,
            "group": p.group,
            "role": p.role,
        }
        dtype = layout.dtype_name(p.tensor.dtype)
        if dtype is not None:
            spec["dtype"] = dtype
        spec["shape"] = [int(d) for d in p.tensor.shape]  # a DTensor's is the whole tensor's
        spec["requires_grad"] = bool(p.tensor.requires_grad)
        if self.optimizer is not None:
            index = membership.get(id(p.tensor))
            spec["in_optimizer"] = index is not None
            if index is not None:
                spec["param_group"] = str(index)
        if self.world_size > 1:
            where, holders = ranks.layout_of(p.tensor, self.world_size)
            spec["layout"] = where
            if holders is not None:
                spec["shard_ranks"] = holders
        return spec

    def param_dtype(self) -> Optional[str]:
        """The dtype the optimizer updates: the one holding most elements among the
        trainable parameters it holds (all trainable ones without an optimizer)."""
        membership = self._membership()
        counts: Dict[str, int] = {}
        for p in self.params:
            if not p.tensor.requires_grad:
                continue
            if self.optimizer is not None and id(p.tensor) not in membership:
                continue
            name = layout.dtype_name(p.tensor.dtype)
            if name is not None:
                counts[name] = counts.get(name, 0) + p.tensor.numel()
        if not counts:
            return None
        return max(sorted(counts), key=lambda d: counts[d])

    def groups(self) -> List[str]:
        seen: Dict[str, None] = {}
        for p in self.params:
            seen.setdefault(p.group, None)
        return list(seen)

    # -- what is sent ------------------------------------------------------------

    def registration(
        self,
        name: Optional[str],
        detectors: Optional[Dict[str, int]],
        config: Optional[Any],
        train: Optional[List[str]],
        rank: Optional[int],
        world_size: Optional[int],
        webhooks: Optional[List[wire.Webhook]] = None,
        client_config: Optional[Dict[str, Any]] = None,
        signals: Optional[Dict[str, int]] = None,
    ) -> wire.RunRegistration:
        membership = self._membership()
        specs = [self.param_spec(p, membership) for p in self.params]
        body: Dict[str, Any] = {}
        if name:
            body["name"] = name[:1024]
        body["host"] = socket.gethostname()[:1024]
        if rank is not None and world_size:
            body["rank"], body["world_size"] = rank, world_size
        precision: Dict[str, Any] = {"loss_scaler": scaler_kind(self.scaler)}
        param_dtype = self.param_dtype()
        if param_dtype is not None:
            precision["param_dtype"] = param_dtype
        body["precision"] = precision
        if self.optimizer is not None:
            body["optimizer"] = self._optimizer_spec()
        body["params"] = specs
        if detectors:
            body["detectors"] = dict(detectors)
        if train is not None:
            body["train"] = list(train)
        if webhooks:
            body["webhooks"] = webhooks
        found = wiring.findings(self.model) + wiring.empty_groups(self.model, self.optimizer)
        if found:
            body["wiring"] = found
        if signals:
            body["signals"] = dict(signals)
        mode_dependent = modes.mode_dependent_modules(self.model)
        if mode_dependent is not None:
            body["mode_dependent_modules"] = mode_dependent
        # Only what stays the same when the same job restarts: registering again with
        # the same body is then accepted as the same run.
        cfg: Dict[str, Any] = {"client": "gradflow-python", "torch": torch.__version__}
        cfg.update(client_config or {})
        if config is not None:
            cfg["user"] = config
        body["config"] = cfg
        self._sent_specs = {s["name"]: s for s in specs}
        self._sent_groups = {
            g["name"]: g
            for g in (
                param_group_spec(i, g, with_lr=False) for i, g in enumerate(self._param_groups())
            )
        }
        self._sent_param_dtype = param_dtype
        return cast(wire.RunRegistration, body)

    def _param_groups(self) -> List[Dict[str, Any]]:
        return list(self.optimizer.param_groups) if self.optimizer is not None else []

    def _optimizer_spec(self) -> Dict[str, Any]:
        groups = self._param_groups()
        spec: Dict[str, Any] = {"name": type(self.optimizer).__name__.lower()}
        if groups:
            first = param_group_spec(0, groups[0])
            for key in ("lr", "betas", "eps", "weight_decay"):
                if key in first:
                    spec[key] = first[key]
            for key in ("momentum", "dampening"):
                value = _finite(groups[0].get(key))
                if value is not None:
                    spec[key] = value
        spec["param_groups"] = [param_group_spec(i, g) for i, g in enumerate(groups)]
        return spec

    def amendment(self, seen: Sequence[wire.WiringFinding] = ()) -> Optional[wire.Amendment]:
        """The changes since the registration (or the last amendment), or None.

        Checked through a signature of the parameters' requires_grad and dtype and
        the optimizer's group count, read at most once a step (see
        :meth:`release_signature`): every ``SIGNATURE_EVERY``-th step, and on any
        step whose optimizer groups changed, whose model had a parameter or module
        assigned (a replacement), or whose parameters holding a gradient changed (one
        unfrozen, or frozen with its gradient set to None) or whose gradients' dtypes
        did (a parameter cast while it trains). A parameter frozen, unfrozen or cast
        in step n is thus amended by step n + ``SIGNATURE_EVERY``, one cast while it
        trains on step n
        (tested: ``test_a_change_no_gradient_shows_is_amended_within_the_signature_bound``);
        only a change rebuilds the specs. `seen`: wiring findings the capture layer
        made since the last call (layers built in a forward, the loop's order), sent
        with the amendment, with the learnable tensors that are not parameters once a
        gradient reached them.
        """
        self._grads = None  # a gradient read takes only what this check reads
        grads_later, self._grads_later = self._grads_later, False
        built = list(seen) + self._loose.findings()
        compute_dtype = self._autocast.take()
        if compute_dtype is not None:
            # Sent alone: it changes nothing the signature below compares.
            return self._with_compute_dtype(self._changes(built, grads_later), compute_dtype)
        return self._changes(built, grads_later)

    @staticmethod
    def _with_compute_dtype(amend: Optional[wire.Amendment], compute_dtype: str) -> wire.Amendment:
        out: Dict[str, Any] = dict(amend or {})
        out["precision"] = {**out.get("precision", {}), "compute_dtype": compute_dtype}
        return cast(wire.Amendment, out)

    def _changes(
        self, built: List[wire.WiringFinding], grads_later: bool = False
    ) -> Optional[wire.Amendment]:
        """:meth:`amendment`'s registration changes, with the wiring findings `built`
        (`grads_later`: see :meth:`leave_grads_to_worker`)."""
        replaced = self.replaced()
        if replaced:
            # A parameter was replaced by a new tensor (or added, or removed): the hooks
            # and measurements move to the tensors the model uses now.
            self._rescan()
        elif self._signature_held or self._skips_signature(grads_later):
            self._signature_held = True
            return cast(wire.Amendment, {"wiring": built}) if built else None
        signature = self._live_signature()
        self._signature_held = True
        if signature == self._signature and not replaced:
            return cast(wire.Amendment, {"wiring": built}) if built else None
        if signature[2:] != self._signature[2:] and not replaced:
            # The optimizer changed (add_param_group): the model may have new parameters.
            self._rescan()
            signature = self._live_signature()
        self._signature = signature
        membership = self._membership()
        amend: Dict[str, Any] = {}
        changed = []
        for p in self.params:
            spec = self.param_spec(p, membership)
            if self._sent_specs.get(p.name) != spec:
                changed.append(spec)
                self._sent_specs[p.name] = spec
        live = {p.name for p in self.params}
        for name, sent in list(self._sent_specs.items()):
            if name in live:
                continue
            # It left the model: the protocol keeps it, frozen and outside the optimizer.
            gone = dict(sent, requires_grad=False)
            if self.optimizer is not None:
                gone["in_optimizer"] = False
                gone.pop("param_group", None)
            if gone != sent:
                changed.append(gone)
                self._sent_specs[name] = gone
        groups = []
        for i, g in enumerate(self._param_groups()):
            without_lr = param_group_spec(i, g, with_lr=False)
            if self._sent_groups.get(without_lr["name"]) != without_lr:
                groups.append(param_group_spec(i, g))
                self._sent_groups[without_lr["name"]] = without_lr
        if groups:
            amend["param_groups"] = groups
        if changed:
            amend["params"] = changed
        param_dtype = self.param_dtype()
        if param_dtype is not None and param_dtype != self._sent_param_dtype:
            amend["precision"] = {"param_dtype": param_dtype}
            self._sent_param_dtype = param_dtype
        if built:
            amend["wiring"] = built
        return cast(wire.Amendment, amend) if amend else None

    def lrs(self) -> Dict[str, float]:
        out = {}
        for i, g in enumerate(self._param_groups()):
            lr = g.get("lr")
            if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
                continue  # reading it would wait for the device
            value = _finite(lr)
            if value is not None:
                out[str(i)] = value
        return out
