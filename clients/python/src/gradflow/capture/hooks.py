"""The hooks gradflow puts on the watched model: what they see during a step.

Backward reaching a module is counted by ``register_post_accumulate_grad_hook`` on
its parameters: no tensor work, and training stays bit-identical (module
full-backward hooks would change its numerics). The hook is the bound ``append`` of
one list, so the autograd engine calls C code, never a Python frame: each parameter
reached is appended, and the hits are counted from that list on the reporter thread.
Only when a hook has more to do (a multi-rank run's step clock and local sums, a
callback queued for the end of the backward pass: :meth:`ModelHooks.arm_backward_end`)
are the hooks Python functions that also append.
A read-only forward pre-hook on the model keeps the step's largest input magnitude
on the device (or, in a loop that calls the groups' root modules itself and never the
model, on each group root: its inputs without autograd history), and a tensor hook
on one parameter looks, just before the first backward after an optimizer step,
whether its gradient still holds values (nothing zeroed it: ``grads_carried_over``),
and before each later backward of the same step whether the gradient the earlier
ones accumulated is gone (reset between the micro-batches of one step:
``grads_reset_between_backwards``). A gradient found at zero is a reset only when the
previous backward left it non-zero, which a post-accumulate hook on the same
parameter remembers: a backward that contributes exactly zero (a REINFORCE time step
whose return is 0) leaves a zero that no reset made. Every hook is removed by
:meth:`ModelHooks.remove`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Set

import torch

from .. import _torch_compat
from ..measurement.measure import count_hits
from ..measurement.ranks import StepClock, is_dtensor
from ..measurement.registration import Param, Registry


class ModelHooks:
    """Hook hits, the backward-end callback, the input peak and the carry-over probe."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        # Set for a multi-rank run (through the properties below, which make the
        # hooks Python functions): times this rank's own work on each step, and each
        # parameter's local gradient summed on the device as its hook runs, before the
        # all-reduce (see local_grads_finite).
        self._clock: Optional[StepClock] = None
        self._local_sums: Optional[Dict[int, torch.Tensor]] = None
        # Every parameter backward reached this step, once per time it was reached:
        # the hooks append to it (see the module's doc).
        self._reached: List[torch.Tensor] = []
        # Whether the hooks are Python functions (see _hook) rather than the list's
        # append.
        self._python_hooks = False
        self._handles: Dict[int, Any] = {}
        self._fresh: Set[int] = set()
        # Set by arm_backward_end: called once when the backward pass now running ends.
        self._at_backward_end: Optional[Callable[[], None]] = None
        # The carry-over probe: one parameter whose gradient is looked at just before
        # the first backward after each optimizer step (see arm_carry_probe).
        self._sentinel: Optional[torch.Tensor] = None
        self._sentinel_hook: Any = None
        self._sentinel_left_hook: Any = None
        # Whether the last backward that reached the sentinel left its gradient
        # non-zero: a device bool, None before one did (or when it was not read).
        self._left_nonzero: Optional[torch.Tensor] = None
        # The sentinel's in-place version when the last backward that reached it
        # ended: a later one that finds it changed finds weights moved between the
        # passes (SAM's climb to w + e(w), an extra-gradient step), whose reset starts
        # a gradient at other weights on purpose, not an accumulation's.
        self._version_left: Optional[int] = None
        # Whether the last optimizer step had exactly one backward pass: then the
        # first backward of the next is not read (a loop keeps its shape), so a loop
        # of one backward per step pays for one look at the sentinel, not two.
        self._one_backward_before = False
        self._probe_armed = False
        # Backward passes that reached the sentinel since the last optimizer step.
        self._backwards = 0
        # None, False, or a device scalar (> 0: carried)
        self.carried: Optional[Any] = None
        # Later backward passes of this step that found the gradient the earlier ones
        # accumulated gone: set to None (counted here) or zeroed (a device count).
        self.resets_seen = 0
        self.resets_zeroed: Optional[torch.Tensor] = None
        # Backward passes that reached the sentinel in the step that just ended.
        self.step_backwards = 0
        # The largest |value| of the floating-point inputs of the watched model's
        # forward passes this step (a device scalar).
        self.input_absmax: Optional[torch.Tensor] = None
        # Forward passes of the watched model with gradients enabled, since watch.
        self.forwards = 0
        self._input_hook: Any = registry.model.register_forward_pre_hook(
            self._on_model_input, with_kwargs=True
        )
        # Whether the model's own forward, or else a group's root, ran this step.
        self._root_ran = False
        self._group_ran = False
        self._group_hooks = [
            module.register_forward_pre_hook(self._on_group_input, with_kwargs=True)
            for module in _group_roots(registry)
        ]

    @property
    def clock(self) -> Optional[StepClock]:
        return self._clock

    @clock.setter
    def clock(self, clock: Optional[StepClock]) -> None:
        self._clock = clock
        if clock is not None:
            self._use_python_hooks()

    @property
    def local_sums(self) -> Optional[Dict[int, torch.Tensor]]:
        return self._local_sums

    @local_sums.setter
    def local_sums(self, sums: Optional[Dict[int, torch.Tensor]]) -> None:
        self._local_sums = sums
        if sums is not None:
            self._use_python_hooks()

    def _use_python_hooks(self) -> None:
        """From now on, hooks that run Python (each parameter's hook hooked again,
        once): a multi-rank run, or a callback at the end of backward."""
        if self._python_hooks:
            return
        self._python_hooks = True
        fresh = set(self._fresh)
        for key in list(self._handles):
            self._handles.pop(key).remove()
        for p in self.registry.params:
            self._hook(p)
        # Hooked again, not newly: the hits they count stay this step's.
        self._fresh = fresh

    def rebuild(self) -> None:
        """After registration or an amendment: hooks on parameters that have none, and
        none left on tensors the model no longer uses (a replaced parameter)."""
        live = {id(p.tensor) for p in self.registry.params}
        for key in [k for k in self._handles if k not in live]:
            self._handles.pop(key).remove()
            self._fresh.discard(key)
        if any(id(t) not in live for t in self._reached):
            self._reached[:] = [t for t in self._reached if id(t) in live]
        if self._sentinel is not None and id(self._sentinel) not in live:
            self._drop_sentinel()
            self._probe_armed = False
        for p in self.registry.params:
            self._hook(p)

    def _hook(self, p: Param) -> None:
        key = id(p.tensor)
        if key in self._handles or not p.tensor.requires_grad:
            return
        register = getattr(p.tensor, "register_post_accumulate_grad_hook", None)
        if register is None:
            return
        reached = self._reached
        if not self._python_hooks:
            # C code: the autograd engine runs no Python frame for this parameter.
            self._handles[key] = register(reached.append)
            self._fresh.add(key)
            return
        hooks = self
        cuda = p.tensor.device.type == "cuda"

        def hook(tensor: torch.Tensor, key: int = key) -> None:
            reached.append(tensor)
            if hooks._clock is not None:
                hooks._clock.on_grad(cuda)
            if hooks._local_sums is not None:
                _keep_local_sum(hooks._local_sums, key, tensor.grad)
            if hooks._at_backward_end is not None:
                callback, hooks._at_backward_end = hooks._at_backward_end, None
                _queue_at_backward_end(callback)

        self._handles[key] = register(hook)
        self._fresh.add(key)

    def arm_backward_end(self, callback: Callable[[], None]) -> None:
        """Runs `callback` once, when the next backward pass that reaches a watched
        parameter has finished: after every gradient of that pass is accumulated (and,
        under DistributedDataParallel, averaged), before the loop clips them."""
        self._use_python_hooks()
        self._at_backward_end = callback

    def local_grads_finite(self) -> Optional[torch.Tensor]:
        """Whether every gradient this rank's backward passes accumulated since the
        last call was finite before the all-reduce: a device scalar (1 or 0), None
        when none was seen. Then starts over for the next step.

        The post-accumulate-grad hook of a parameter runs before the autograd node's
        own post hooks, where DistributedDataParallel marks the gradient ready for its
        bucket's all-reduce, so the sums hold what this rank computed alone: a NaN
        that appears in one rank's backward (with a finite loss) is on that rank only,
        though the all-reduce then spreads it to every rank's gradients."""
        sums = self.local_sums
        if not sums:
            return None
        values = list(sums.values())
        sums.clear()
        device = values[0].device
        stacked = torch.stack([v.to(device) for v in values])
        return torch.isfinite(stacked).all().float()

    def remove(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self._drop_sentinel()
        if self._input_hook is not None:
            self._input_hook.remove()
            self._input_hook = None
        for handle in self._group_hooks:
            handle.remove()
        self._group_hooks = []

    def _on_model_input(self, _module: Any, args: Any, kwargs: Any) -> None:
        """The step's largest input magnitude, on the device (a NaN propagates)."""
        try:
            if not torch.is_grad_enabled():
                return  # evaluation: not the batch the optimizer steps on
            self._root_ran = True
            self.forwards += 1
            if self.clock is not None:
                self.clock.on_forward()
            self._keep_peak(float_inputs(args, kwargs))
        except Exception:  # never break the forward pass
            self.input_absmax = None

    def _on_group_input(self, _module: Any, args: Any, kwargs: Any) -> None:
        """A group's root called by the loop itself (``model.encode(...)``,
        ``model.agent(...)``, never ``model(...)``): its inputs that come from outside
        the model (no autograd history: the batch, not another group's activations)."""
        try:
            if self._root_ran or not torch.is_grad_enabled():
                return
            if not self._group_ran:
                self._group_ran = True
                self.forwards += 1
                if self.clock is not None:
                    self.clock.on_forward()
            self._keep_peak([t for t in float_inputs(args, kwargs) if t.grad_fn is None])
        except Exception:  # never break the forward pass
            self.input_absmax = None

    def _keep_peak(self, tensors: List[torch.Tensor]) -> None:
        peaks = [_absmax(t.detach()) for t in tensors if t.numel() > 0]
        if not peaks:
            return
        peak = torch.stack([p.to(peaks[0].device) for p in peaks]).amax()
        previous = self.input_absmax
        self.input_absmax = peak if previous is None else torch.maximum(previous, peak)

    def arm_carry_probe(self) -> None:
        """After an optimizer step: look at one parameter's gradient just before the
        next backward pass adds to it. Still holding values then means nothing zeroed
        the gradients since the step (``grads_carried_over``). The look is a tensor
        hook that returns nothing (training unchanged) and, when the old gradient is
        there, one ``amax`` on the device, read with the step's other numbers."""
        sentinel = self._sentinel
        if sentinel is None or sentinel.grad is None or not sentinel.requires_grad:
            sentinel = self._pick_sentinel()
            if sentinel is not self._sentinel:
                self._drop_sentinel()
                self._sentinel = sentinel
                if sentinel is not None:
                    self._sentinel_hook = sentinel.register_hook(self._probe)
                    self._sentinel_left_hook = sentinel.register_post_accumulate_grad_hook(
                        self._note_left
                    )
        self._probe_armed = self._sentinel is not None
        self._one_backward_before = self._backwards == 1
        self.step_backwards, self._backwards = self._backwards, 0

    def _drop_sentinel(self) -> None:
        """The carry-over probe's hooks come off; no parameter is looked at."""
        for handle in (self._sentinel_hook, self._sentinel_left_hook):
            if handle is not None:
                handle.remove()
        self._sentinel_hook = self._sentinel_left_hook = None
        self._sentinel = None
        self._left_nonzero = None
        self._version_left = None

    def _pick_sentinel(self) -> Optional[torch.Tensor]:
        """A parameter the optimizer steps that got a gradient this step (one outside
        the optimizer is never zeroed by it, which is another alert)."""
        membership = self.registry._membership()
        for p in self.registry.params:
            t = p.tensor
            # Not a DTensor: FSDP2's sharded parameters are not in the autograd graph
            # (their unsharded copies are), so a hook on one would never fire.
            if t.requires_grad and t.grad is not None and id(t) in membership and not is_dtensor(t):
                return t
        return None

    def _probe(self, _grad: torch.Tensor) -> None:
        """Just before a backward pass adds to the sentinel's gradient. The first one
        after an optimizer step answers ``grads_carried_over``; each later one of the
        same step looks whether the gradient the earlier passes accumulated is still
        there (``zero_grad`` inside the micro-batch loop keeps the last one only)."""
        earlier = self._backwards
        self._backwards += 1
        if earlier > 0:
            self._look_for_reset()
        # Until this backward's own result is read (_note_left).
        self._left_nonzero = None
        if earlier > 0 or not self._probe_armed:
            return
        self._probe_armed = False
        try:
            old = self._sentinel.grad if self._sentinel is not None else None
            if old is None:
                self.carried = False
            else:
                self.carried = _absmax(old.detach())
        except Exception:  # never break the backward pass
            self.carried = None

    def _note_left(self, tensor: torch.Tensor) -> None:
        """After a backward pass added to the sentinel's gradient: whether it left the
        gradient non-zero (one ``aminmax`` on the device, never read here). Not for
        the first backward of a step after a step of one: a loop that turns to several
        backward passes then has its first zero found uncounted, once."""
        self._version_left = tensor._version
        if self._backwards <= 1 and self._one_backward_before:
            return
        try:
            grad = tensor.grad
            self._left_nonzero = None if grad is None else _absmax(grad.detach()) != 0
        except Exception:  # never break the backward pass
            self._left_nonzero = None

    def _look_for_reset(self) -> None:
        """A later backward pass of one optimizer step: a gradient set to None since
        the earlier ones is counted on the host; one found at zero, on the device, and
        only when the previous backward left it non-zero (a pass that added exactly
        zero leaves a zero nobody reset; unread, nothing is counted). Not when the
        weights were changed in place since the previous backward (see
        ``_version_left``): that reset belongs to a method of two passes."""
        try:
            sentinel = self._sentinel
            if sentinel is not None and sentinel._version != self._version_left:
                return
            old = sentinel.grad if sentinel is not None else None
            if old is None:
                self.resets_seen += 1
                return
            left_nonzero = self._left_nonzero
            if left_nonzero is None:
                return
            zeroed = ((_absmax(old.detach()) == 0) & left_nonzero).float().reshape(1)
            previous = self.resets_zeroed
            self.resets_zeroed = zeroed if previous is None else previous + zeroed
        except Exception:  # never break the backward pass
            self.resets_zeroed = None

    def reset(self) -> None:
        """A new step: counts, the input peak and the probe's answer start over."""
        self._at_backward_end = None
        self.carried = None
        self.resets_seen = 0
        self.resets_zeroed = None
        self.step_backwards = 0
        self.input_absmax = None
        self._root_ran = False
        self._group_ran = False
        self._reached.clear()
        self._fresh.clear()

    @property
    def hits(self) -> Dict[int, int]:
        """This step's hook hits, by parameter key (``id`` of its tensor)."""
        return count_hits(self._reached)

    def take_reached(self) -> List[torch.Tensor]:
        """A copy of the parameters backward reached this step (one entry per time),
        for the reporter thread to count (:func:`count_hits`); the hooks go on
        appending to the live list, which :meth:`reset` clears."""
        return list(self._reached)

    @property
    def fresh(self) -> Set[int]:
        """The keys of parameters whose hook was registered during this step."""
        return self._fresh

    def hooked(self) -> Set[int]:
        """The keys of the parameters that have a hook."""
        return set(self._handles)


def _group_roots(registry: Registry) -> List[torch.nn.Module]:
    """The modules named by the registry's groups, other than the model itself."""
    modules = dict(registry.model.named_modules())
    roots = []
    for group in registry.groups():
        module = modules.get(group)
        if module is not None and module is not registry.model and module not in roots:
            roots.append(module)
    return roots


def float_inputs(args: Any, kwargs: Dict[str, Any]) -> List[torch.Tensor]:
    """The floating-point tensors among a forward's arguments (one level into tuples,
    lists and dicts)."""
    found: List[torch.Tensor] = []
    for value in list(args) + list(kwargs.values()):
        items = value.values() if isinstance(value, dict) else value
        if not isinstance(value, (dict, tuple, list)):
            items = [value]
        found.extend(t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point())
    return found


def _absmax(t: torch.Tensor) -> torch.Tensor:
    """The largest |value| of `t` as an f32 device scalar (NaN if it holds one): one
    fused min/max pass, where ``abs().amax()`` would first write a copy of the whole
    batch (most of this probe's cost at large batches)."""
    low, high = torch.aminmax(t)
    return torch.maximum(high, -low).float()


def _keep_local_sum(sums: Dict[int, torch.Tensor], key: int, grad: Optional[torch.Tensor]) -> None:
    """One device reduction of a parameter's accumulated gradient: a NaN or infinity
    in it makes the sum non-finite. Summed in f32 at least, so a half-precision
    gradient's finite values do not overflow; the latest sum of a parameter stands
    for the step (the gradient accumulates over micro-batches)."""
    try:
        # A DTensor's gradient is FSDP2's, whose hooks run after its reduce-scatter:
        # not this rank's own.
        if grad is None or not grad.is_floating_point() or is_dtensor(grad):
            return
        if grad.is_sparse:
            total = torch.sparse.sum(grad).float()
        else:
            total = grad.sum(dtype=torch.float64 if grad.dtype == torch.float64 else torch.float32)
        sums[key] = total
    except Exception:  # never break the backward pass
        pass


def _queue_at_backward_end(callback: Callable[[], None]) -> None:
    """Queues `callback` on the autograd engine's final callbacks of the running
    backward pass. It queues itself once more when it first runs, so that it comes after
    the callbacks others (DistributedDataParallel's reducer) queued after it."""

    def again() -> None:
        _torch_compat.queue_callback(callback)

    _torch_compat.queue_callback(again)
