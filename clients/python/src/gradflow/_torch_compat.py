"""Every private PyTorch API gradflow relies on, in one place.

PyTorch has no public hook for these: queueing a callback at the end of the running
backward pass, the multi-tensor norm kernel, a DTensor's local shard, and the
``GradScaler``'s state before ``update()`` consumes it. When a torch upgrade breaks
one of them, this is the one file to read and fix; the rest of gradflow calls the
functions below and never touches a private name itself.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Set

import torch

# -- the autograd engine -------------------------------------------------------------


def queue_callback(callback: Callable[[], None]) -> None:
    """Queues `callback` to run when the backward pass now running has finished
    (``Variable._execution_engine.queue_callback``); only valid inside a backward."""
    engine = torch.autograd.Variable._execution_engine
    engine.queue_callback(callback)


def in_backward() -> bool:
    """Whether this thread is running a backward pass now (a checkpointed forward
    recomputed during backward is then not a new forward): the engine's current
    graph task id, -1 outside one; False where this torch has no such call."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


# -- norms ---------------------------------------------------------------------------


def foreach_norm(grads: List[torch.Tensor], ord: float = 2) -> List[torch.Tensor]:
    """The `ord`-norm (2, 1 or inf) of each tensor, in f32 (``torch._foreach_norm``:
    multi-tensor kernels; its ``dtype=`` argument came later, and without it the norms
    come in the tensors' own dtype)."""
    foreach = torch._foreach_norm
    try:
        return list(foreach(grads, ord, dtype=torch.float32))
    except (TypeError, RuntimeError):
        return [n.float() for n in foreach(grads, ord)]


def foreach_max(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """The largest element of each of non-negative `tensors`, in f32
    (``torch._foreach_max``, torch 2.6 on; the inf-norm, which also takes the absolute
    values, where this torch has none)."""
    foreach = getattr(torch, "_foreach_max", None)
    if foreach is None:
        return foreach_norm(tensors, float("inf"))
    return [n.float() for n in foreach(tensors)]


def segment_sum(values: torch.Tensor, lengths: List[int]) -> Optional[torch.Tensor]:
    """The sum of each run of `lengths` consecutive elements of `values` in one call
    (``torch.segment_reduce``, a prototype), or None where this torch lacks it."""
    reduce = getattr(torch, "segment_reduce", None)
    if reduce is None:
        return None
    try:
        sums: torch.Tensor = reduce(
            values, "sum", lengths=torch.tensor(lengths, device=values.device)
        )
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    return sums


def flatten_dense(tensors: List[torch.Tensor]) -> torch.Tensor:
    """The elements of `tensors`, one tensor after another, in one new 1-D tensor: one
    call into C++ (``torch._utils._flatten_dense_tensors``, what DDP's buckets use)
    instead of a reshape a tensor from Python; a concatenation of reshapes where this
    torch has none. Always a copy (torch's returns a view of a lone tensor)."""
    flatten = getattr(torch._utils, "_flatten_dense_tensors", None)
    if len(tensors) == 1:
        return tensors[0].reshape(-1).clone()
    if flatten is None:
        return torch.cat([t.reshape(-1) for t in tensors])
    flat: torch.Tensor = flatten(tensors)
    return flat


# -- module registration -------------------------------------------------------------


def registration_hooks(callback: Callable[[Any, str, Any], None]) -> List[Any]:
    """Calls `callback(module, name, value)` whenever any module registers a parameter
    or a submodule (``torch.nn.modules.module``'s global registration hooks, torch
    2.0 and later); the handles to remove them. An empty list where torch has none:
    the caller then cannot tell when nothing was registered."""
    from torch.nn.modules import module

    handles = []
    for name in (
        "register_module_parameter_registration_hook",
        "register_module_module_registration_hook",
    ):
        register = getattr(module, name, None)
        if register is not None:
            handles.append(register(callback))
    return handles


# -- module forward pre-hooks ---------------------------------------------------------


class _HookSlots:
    """Module hooks registered once, kept by key with the dict each lives in, so
    that they can be taken out of their modules and put back (an entry each)
    without a new registration; ``_keys``: the keys moved, to undo."""

    def __init__(self) -> None:
        self._handles: List[Any] = []
        # key -> (the module's hook dict, the hook's id, the hook)
        self._slots: Dict[Any, List[Any]] = {}
        self._keys: List[Any] = []

    def _keep(self, key: Any, hooks: Any, handle: Any, hook: Callable[..., Any]) -> None:
        self._handles.append(handle)
        self._slots.setdefault(key, []).append((hooks, handle.id, hook))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._slots = {}
        self._keys = []


class PausableForwardPreHooks(_HookSlots):
    """Forward pre-hooks (with kwargs) that can be taken out of their modules for the
    rest of a step and put back, by key: a module whose hook dict is empty takes
    ``Module._call_impl``'s fast path, so a paused hook costs its module nothing (a
    hooked module call costs a few µs more than a bare one, whatever the hook does).
    A pause removes the hook's entry from ``module._forward_pre_hooks`` (the slow
    path iterates a copy of it, so a hook may pause its own module); a resume puts
    it back, after any hook registered since (these hooks only read). A resume may
    put back only the hooks of some names (:meth:`resume` with `only`): the others
    stay out until a resume of them all."""

    def __init__(self) -> None:
        super().__init__()
        # name -> its hook's slot, for the hooks added with a name.
        self._named: Dict[str, Any] = {}
        # Whether some hook was left out by a resume of some names only.
        self._left_out = False

    def add(
        self, module: torch.nn.Module, hook: Callable[..., Any], key: Any, name: Any = None
    ) -> None:
        handle = module.register_forward_pre_hook(hook, with_kwargs=True)
        self._keep(key, module._forward_pre_hooks, handle, hook)
        if name is not None:
            self._named[name] = self._slots[key][-1]

    def pause(self, key: Any) -> None:
        """Takes every hook of `key` out of its module until :meth:`resume`."""
        slots = self._slots.get(key)
        if not slots:
            return
        for hooks, hook_id, _hook in slots:
            hooks.pop(hook_id, None)
        self._keys.append(key)

    def resume(self, only: Optional[Set[Any]] = None) -> None:
        """Puts every paused hook back; with `only`, the hooks of those names alone
        (the rest stay out until a resume without it puts every hook back)."""
        paused, self._keys = self._keys, []
        if only is not None:
            if paused:
                self._left_out = True
                for name in only:
                    slot = self._named.get(name)
                    if slot is not None:
                        slot[0][slot[1]] = slot[2]
            return
        if self._left_out:
            self._left_out = False
            paused = list(self._slots)
        for key in paused:
            for hooks, hook_id, hook in self._slots.get(key, ()):
                hooks[hook_id] = hook

    def remove(self) -> None:
        super().remove()
        self._named = {}
        self._left_out = False


class ParkedForwardHooks(_HookSlots):
    """Forward hooks and pre-hooks registered once and switched on by key for a
    step, then all off: a switch moves each hook between its entry in the module's
    hook dict and its slot here (a dict insertion or removal each), instead of
    registering it anew with its handle and taking it off again (a handle's weak
    references and extra dicts, a few µs a hook). A hook switched on runs after any
    registered since (these hooks only read). ``always_call`` stays marked in
    torch's own dict while the hook is off, where ``Module._call_impl`` looks only at
    ids of hooks in place."""

    def add_pre(self, module: torch.nn.Module, hook: Callable[..., Any], key: Any) -> None:
        handle = module.register_forward_pre_hook(hook)
        self._park(key, module._forward_pre_hooks, handle, hook)

    def add(
        self,
        module: torch.nn.Module,
        hook: Callable[..., Any],
        key: Any,
        always_call: bool = False,
    ) -> None:
        handle = module.register_forward_hook(hook, always_call=always_call)
        self._park(key, module._forward_hooks, handle, hook)

    def _park(self, key: Any, hooks: Any, handle: Any, hook: Callable[..., Any]) -> None:
        """Off until its key is switched on."""
        self._keep(key, hooks, handle, hook)
        hooks.pop(handle.id, None)

    def switch_on(self, key: Any) -> None:
        slots = self._slots.get(key)
        if not slots:
            return
        for hooks, hook_id, hook in slots:
            hooks[hook_id] = hook
        self._keys.append(key)

    def switch_off(self) -> None:
        """Every hook switched on goes off."""
        on, self._keys = self._keys, []
        for key in on:
            for hooks, hook_id, _hook in self._slots.get(key, ()):
                hooks.pop(hook_id, None)


# -- DTensor -------------------------------------------------------------------------


def is_dtensor(t: Any) -> bool:
    """A ``DTensor`` (FSDP2's sharded parameters and their gradients, tensor
    parallelism), recognised without importing it."""
    return isinstance(getattr(t, "_local_tensor", None), torch.Tensor) and hasattr(t, "placements")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (``_local_tensor``: a plain tensor, read through no
    DTensor dispatch and no collective), any other tensor itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


# -- GradScaler ----------------------------------------------------------------------


def scaler_growth_backoff(scaler: Any) -> tuple[float, float]:
    """The scaler's growth and backoff factors (``_growth_factor``,
    ``_backoff_factor``), torch's defaults when absent."""
    return (
        float(getattr(scaler, "_growth_factor", 2.0)),
        float(getattr(scaler, "_backoff_factor", 0.5)),
    )


def scaler_unscale_pending(scaler: Any, optimizer: Any) -> bool:
    """Whether ``scaler.step(optimizer)`` will unscale first: the optimizer's stage in
    ``_per_optimizer_states`` is still ``READY``."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None:
        return False
    stage = states[id(optimizer)].get("stage")
    return getattr(stage, "name", None) == "READY"


def scaler_state(scaler: Any) -> Optional[torch.Tensor]:
    """[scale, growth tracker, found_inf summed over devices and optimizers] as f32 on
    the scale's device, read without a host sync from ``_scale``, ``_growth_tracker``
    and ``_per_optimizer_states``; found_inf is NaN before any unscale. None when the
    scaler has no scale yet."""
    scale = getattr(scaler, "_scale", None)
    tracker = getattr(scaler, "_growth_tracker", None)
    if scale is None or tracker is None:
        return None
    found: Optional[torch.Tensor] = None
    states: Dict[Any, Dict[str, Any]] = getattr(scaler, "_per_optimizer_states", {})
    for state in states.values():
        for value in state.get("found_inf_per_device", {}).values():
            value = value.to(scale.device, torch.float32).reshape(())
            found = value if found is None else found + value
    if found is None:
        found = torch.full((), float("nan"), device=scale.device)
    return torch.stack(
        [scale.detach().float().reshape(()), tracker.detach().float().reshape(()), found]
    )


# -- the training loop's order (loop_order.py) ----------------------------------------


def wrap_clip_grads(observe: Callable[[Any, Any, Any], None]) -> Optional[Callable[[], None]]:
    """Makes ``clip_grad_norm_`` call ``observe(parameters, max_norm, total_norm)``
    before it clips: it calls the module-level ``_clip_grads_with_norm_`` of
    ``torch.nn.utils.clip_grad`` by its global name (torch >= 2.6), so a
    ``clip_grad_norm_`` imported before ``watch`` is seen too. Returns the function
    that restores the original (a no-op if something wrapped it since), or None when
    this torch has no such function."""
    from torch.nn.utils import clip_grad

    def clip(inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if len(args) >= 3:
            observe(args[0], args[1], args[2])
        return inner(*args, **kwargs)

    return _chain(clip_grad, "_clip_grads_with_norm_", clip)


def wrap_clip_values(observe: Callable[[Any, Any], None]) -> Optional[Callable[[], None]]:
    """Makes ``torch.nn.utils.clip_grad_value_`` call ``observe(parameters,
    clip_value)`` before it clamps. torch has no inner function of its own to hook, so
    the public name is wrapped: a ``clip_grad_value_`` imported by name before
    ``watch`` is not seen. An iterator of parameters is read into a list once, here,
    so that every observer and the clip itself see all of it. Returns the restoring
    function, or None when this torch has no ``clip_grad_value_``."""

    def clip(inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if args:
            parameters = args[0]
            if not isinstance(parameters, (torch.Tensor, list, tuple)):
                parameters = list(parameters)  # read twice: by the observer and the clip
            args = (parameters,) + args[1:]
            limit = args[1] if len(args) >= 2 else kwargs.get("clip_value")
            observe(parameters, limit)
        return inner(*args, **kwargs)

    return _chain(torch.nn.utils, "clip_grad_value_", clip)


def wrap_plateau_steps(
    observe: Callable[[Any, Any, List[float]], None],
) -> Optional[Callable[[], None]]:
    """Makes ``ReduceLROnPlateau.step`` call ``observe(scheduler, metrics,
    lrs_before)`` after it ran (``lrs_before``: its optimizer's group lrs before the
    call, so a cut is seen). The class's method is wrapped, so every instance is seen,
    built before ``watch`` or after. Returns the restoring function, or None when this
    torch has no ``ReduceLROnPlateau``."""
    plateau = getattr(torch.optim.lr_scheduler, "ReduceLROnPlateau", None)
    if plateau is None:
        return None

    def step(inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        scheduler = args[0] if args else None
        try:
            groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", None)
            before = [float(g["lr"]) for g in groups or ()]
        except Exception:  # never the user's step's fault: observe sees no lrs
            before = []
        out = inner(*args, **kwargs)
        observe(scheduler, args[1] if len(args) >= 2 else kwargs.get("metrics"), before)
        return out

    return _chain(plateau, "step", step)


def wrap_loss_function(
    name: str, observe: Callable[[str, Any, Any], None]
) -> Optional[Callable[[], None]]:
    """Makes ``torch.nn.functional.<name>`` (a loss of ``input`` and ``target``, e.g.
    ``mse_loss``) call ``observe(name, input, target)`` before it computes. The loss
    modules (``nn.MSELoss``...) call the functional by its module attribute, so they
    are seen too. Returns the restoring function, or None when there is no such
    function."""

    def loss(inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        given = args[0] if args else kwargs.get("input")
        target = args[1] if len(args) >= 2 else kwargs.get("target")
        observe(name, given, target)
        return inner(*args, **kwargs)

    return _chain(torch.nn.functional, name, loss)


def _chain(owner: Any, name: str, around: Callable[..., Any]) -> Optional[Callable[[], None]]:
    """Replaces ``owner.<name>`` by a wrapper that calls ``around(inner, *args,
    **kwargs)``, ``inner`` being what it replaced. Several such wrappers stack (each
    reads its ``__wrapped__`` at every call), and each one's restore takes it out of
    the stack wherever it is, so observers can come and go in any order. Returns that
    restore, or None when ``owner`` has no ``name``."""
    original = getattr(owner, name, None)
    if original is None:
        return None

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # Read at each call: restoring a wrapper beneath this one relinks it.
        return around(wrapper.__wrapped__, *args, **kwargs)  # type: ignore[attr-defined]

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper._gradflow_wrapper = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)

    def restore() -> None:
        current = getattr(owner, name, None)
        if current is wrapper:
            setattr(owner, name, wrapper.__wrapped__)  # type: ignore[attr-defined]
            return
        # Wrapped since by another of these wrappers: take this one out of the chain
        # beneath it. Anything else is left.
        while getattr(current, "_gradflow_wrapper", False):
            inner = current.__wrapped__  # type: ignore[union-attr]
            if inner is wrapper:
                current.__wrapped__ = wrapper.__wrapped__  # type: ignore[union-attr]
                return
            current = inner

    return restore


def grad_version(t: torch.Tensor) -> int:
    """The tensor's in-place version counter (``_version``): an in-place write, such
    as ``backward`` accumulating into ``.grad``, bumps it."""
    return int(t._version)


def scaler_scale(scaler: Any) -> Optional[float]:
    """The scaler's current scale (``_scale``, read with a host sync), or None."""
    scale = getattr(scaler, "_scale", None)
    return None if scale is None else float(scale)


def lr_scheduler_types() -> tuple[type, ...]:
    """The LR scheduler base class (``LRScheduler``, ``_LRScheduler`` before torch 2.0)."""
    module = torch.optim.lr_scheduler
    base = getattr(module, "LRScheduler", None) or module._LRScheduler
    return (base,)
