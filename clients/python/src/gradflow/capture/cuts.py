"""Where the autograd graph was cut, seen from the forward pass.

A ``grad_stuck_zero`` alert with cause ``backward_not_reached`` says *what* is wrong;
this module finds *where*. Forward pre-hooks (no change to autograd, so training
stays bit-identical) on each group's root module and on every module that owns
trainable parameters look at the first module of each group to run in a step:

- ``no_grad``: its forward ran with gradients disabled (``torch.no_grad()``,
  ``inference_mode``, ``set_grad_enabled(False)``);
- ``detached_input``: gradients were enabled, but the floating-point tensors it
  received had no autograd history although another watched group had just run
  with gradients (a ``.detach()``, a tensor rebuilt with ``torch.tensor(x.tolist())``,
  a cached value).

A ``detached_input`` right after a ``no_grad`` block (a module's forward running
``with torch.no_grad(): h = self.encoder(h)`` between two groups that train) is the
block's doing: the group that ran with gradients before the block is cut off too. The
block's cut then names that group as its ``upstream``, so that the alerts on both
groups name the block's line, not the module that consumed its output.

A ``no_grad`` cut inside a reentrant activation checkpoint whose inputs do not require
grad (adapters on a frozen base, without ``enable_input_require_grads()``) is also said
at once on the client, naming the checkpoint and the fix: backward will never enter
the block.

Each cut is recorded with the user's call site (the first frame outside torch,
transformers, accelerate, the standard library, installed packages and gradflow,
then its callers) once per module per episode: again only after its group has run
without it on a step with every hook in place. The server keeps the cuts and names
the one behind an alert.

A step's cost is a few hooked module calls per group: once a group's first module has
been looked at (and its first module that owns parameters, with gradients enabled),
the group's hooks are paused for the rest of the step (taken out of their modules, so
those calls take torch's fast path) and put back when the step ends. Inputs are
inspected once per group per step; the stack is walked only when a cut is first
seen. Only the hooks that looked (the modules that ran first in their group) are put
back at most steps: every ``FULL_EVERY``-th step, and after any step on which a group
ran without its first module looking, all of them are, so that a group whose modules
change order is looked at where it now starts within that many steps. Putting back
every hook (219 on a 24-layer Qwen2) cost ~0.1 ms a step on a CPU, each module's hook
dict a first touch out of the caches.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from types import FrameType
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, cast

import torch
from torch import nn

from .. import _torch_compat, wire
from .._log import guarded, notice
from ..measurement.registration import Registry
from .hooks import float_inputs

MAX_FRAMES = 6
# Every this many steps the tracer's hooks are all put back (see the module).
FULL_EVERY = 8


def _library_roots() -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """(the libraries whose frames are never the call site, every installed package
    and the standard library)."""
    named = []
    for package in ("torch", "transformers", "accelerate", "peft", "gradflow"):
        module = sys.modules.get(package)
        path = getattr(module, "__file__", None)
        if path:
            named.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    broad = list(named)
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            broad.append(os.path.abspath(path) + os.sep)
    return tuple(named), tuple(broad)


def user_stack(limit: int = MAX_FRAMES) -> List[Dict[str, Any]]:
    """The user's frames of the current call, innermost first: the frames outside
    the framework libraries, installed packages and the standard library (or, when
    every frame is in one of those, outside the framework libraries only)."""
    named, broad = _library_roots()
    frames = []
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    for skip in (broad, named):
        picked = []
        for f in frames:
            filename = f.f_code.co_filename
            if filename.startswith("<") or os.path.abspath(filename).startswith(skip):
                continue
            picked.append(
                {"file": _shown(filename), "line": f.f_lineno, "function": f.f_code.co_name}
            )
            if len(picked) == limit:
                break
        if picked:
            return picked
    return []


def _shown(filename: str) -> str:
    """A path relative to the working directory when it lies inside it."""
    path = os.path.abspath(filename)
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return path if relative.startswith("..") else relative


class CutTracer:
    """Forward hooks that report where the graph was cut (see the module's doc)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._hooks = _torch_compat.PausableForwardPreHooks()
        self._pending: List[Dict[str, Any]] = []
        # Episodes reported and still going: (module, kind) -> the module's group.
        self._active: Dict[Tuple[str, str], str] = {}
        # Says what the client saw (set to a no-op when alerts are not shown).
        self.notify: Callable[[str], None] = notice
        self._told_reentrant = False
        # The modules whose hooks looked since every hook was last put back, and
        # steps since then.
        self._looked: Set[str] = set()
        self._partial_steps = 0
        # Whether every hook was in place for the step now running.
        self._all_hooked = True
        self._no_grad_checked: Set[str] = set()
        self._input_checked: Set[str] = set()
        self._reset_step()
        self.rebuild()

    def _reset_step(self) -> None:
        self._resume()
        self._no_grad_checked = set()
        self._input_checked = set()
        self._ran_with_grad: List[str] = []
        self._seen: Set[Tuple[str, str]] = set()
        # This step's no_grad blocks: (the group that ran with gradients before the
        # block, or None; the block's cut when it is sent this step, else None).
        self._no_grad_blocks: List[Tuple[Optional[str], Optional[Dict[str, Any]]]] = []

    def _resume(self) -> None:
        """Puts back the hooks paused this step: those that looked, or all of them
        (see the module)."""
        checked = self._input_checked
        complete = all(group in checked for group in self._no_grad_checked)
        if complete and self._partial_steps < FULL_EVERY - 1 and self._looked:
            self._partial_steps += 1
            self._hooks.resume(only=self._looked)
            self._all_hooked = False
            return
        self._all_hooked = True
        self._partial_steps = 0
        self._looked = set()
        self._hooks.resume()

    def rebuild(self) -> None:
        """Hooks the modules that own trainable parameters, and each group's root
        module; after registration and after every amendment."""
        self.remove()
        modules = dict(self.registry.model.named_modules())
        groups: Dict[str, str] = {}  # module -> group, for modules owning trainable params
        trainable_groups: Set[str] = set()
        for p in self.registry.params:
            if p.tensor.requires_grad:
                groups.setdefault(p.module, p.group)
                trainable_groups.add(p.group)
        hooked: Dict[str, Tuple[str, bool]] = {}
        for group in trainable_groups:
            if group in modules:
                hooked[group] = (group, False)
        for module_name, group in groups.items():
            hooked[module_name] = (group, True)
        for module_name, (group, leaf) in hooked.items():
            module = modules.get(module_name)
            if isinstance(module, nn.Module) and type(module).forward is not nn.Module.forward:
                self._hooks.add(module, self._hook(module_name, group, leaf), group, module_name)
        self._looked = set()
        self._partial_steps = 0
        self._all_hooked = True

    def remove(self) -> None:
        self._hooks.remove()

    def _hook(self, module_name: str, group: str, leaf: bool) -> Any:
        tracer = self

        @guarded("watching the forward pass")
        def hook(_module: nn.Module, args: Any, kwargs: Any) -> None:
            tracer._looked.add(module_name)
            if group not in tracer._no_grad_checked:
                tracer._no_grad_checked.add(group)
                if not torch.is_grad_enabled():
                    before = tracer._ran_with_grad[-1] if tracer._ran_with_grad else None
                    cut = tracer._saw(module_name, group, "no_grad", None)
                    tracer._no_grad_blocks.append((before, cut))
                    return
                tracer._ran_with_grad.append(group)
            if not leaf or group in tracer._input_checked or not torch.is_grad_enabled():
                return
            tracer._input_checked.add(group)
            # Both looks of this group are done for the step: its other modules' calls
            # need no hook until the step ends.
            tracer._hooks.pause(group)
            floats = float_inputs(args, kwargs)
            if floats and not any(t.requires_grad for t in floats):
                upstream = [g for g in tracer._ran_with_grad if g != group]
                if upstream:
                    tracer._saw(module_name, group, "detached_input", upstream[-1])
                    tracer._tie_to_no_grad_block(upstream[-1])

        return hook

    def _tie_to_no_grad_block(self, upstream: str) -> None:
        """A module got its input without history after `upstream` ran with gradients:
        when a no_grad block ran in between (after `upstream`, before any other group
        with gradients), the block cut `upstream` off; its cut, sent this step, says so."""
        for before, cut in reversed(self._no_grad_blocks):
            if before == upstream and cut is not None and cut["kind"] == "no_grad":
                cut.setdefault("upstream", upstream)
                return

    def _saw(
        self, module: str, group: str, kind: str, upstream: Optional[str]
    ) -> Optional[Dict[str, Any]]:
        """Records a cut; the cut when it is sent (the first of its episode)."""
        key = (module, kind)
        self._seen.add(key)
        if key in self._active:
            return None  # this episode was reported already
        self._active[key] = group
        cut: Dict[str, Any] = {"module": module, "kind": kind, "group": group}
        if kind == "no_grad":
            starved = reentrant_checkpoint_without_input_grad()
            if starved is not None:
                # The server names the checkpoint and its fix (protocol v1.6).
                cut["via"] = "reentrant_checkpoint"
                if not self._told_reentrant:
                    self._told_reentrant = True
                    self.notify(_reentrant_message(module, starved))
        if upstream is not None:
            cut["upstream"] = upstream
        stack = user_stack()
        if stack:
            cut["stack"] = stack
        self._pending.append(cut)
        return cut

    def take(self) -> List[wire.GraphCut]:
        """The cuts first seen since the last call; ends the episodes of modules whose
        group ran this step without their cut, on a step that had every hook in place
        (on the others a module that now runs first in its group, where the cut is,
        may have had none). Called once per optimizer step."""
        if self._all_hooked:
            ran = self._no_grad_checked
            self._active = {
                key: group
                for key, group in self._active.items()
                if key in self._seen or group not in ran
            }
        self._reset_step()
        pending, self._pending = self._pending, []
        return cast(List[wire.GraphCut], pending)


def _torch_root() -> str:
    return os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def reentrant_checkpoint_without_input_grad() -> Optional[str]:
    """When the forward now running is inside a reentrant activation checkpoint
    (``torch.utils.checkpoint(..., use_reentrant=True)``, which runs the block under
    ``no_grad`` and lets backward in only through inputs that require grad) and none of
    the checkpoint's tensor inputs requires grad: where ``checkpoint(...)`` was called
    (``file:line``, the first frame outside torch), else None. A reentrant checkpoint
    whose input requires grad is healthy (backward recomputes the block)."""
    torch_root = _torch_root()
    frame: Optional[FrameType] = sys._getframe(1)
    inside = None
    while frame is not None:
        code = frame.f_code
        if (
            code.co_name == "forward"
            and "run_function" in code.co_varnames
            and os.path.basename(code.co_filename) == "checkpoint.py"
        ):
            inside = frame
            break
        frame = frame.f_back
    if inside is None:
        return None
    inputs = inside.f_locals.get("args", ())
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    if any(t.requires_grad for t in tensors):
        return None
    caller = inside.f_back
    while caller is not None and os.path.abspath(caller.f_code.co_filename).startswith(torch_root):
        caller = caller.f_back
    if caller is None:
        return "an unknown place"
    return f"{_shown(caller.f_code.co_filename)}:{caller.f_lineno}"


def _reentrant_message(module: str, where: str) -> str:
    return (
        f"{module} runs inside a reentrant activation checkpoint (torch.utils.checkpoint with "
        f"use_reentrant=True, called from {where}) whose inputs do not require grad: backward "
        "never enters the checkpointed block, so its trainable parameters (adapters on a frozen "
        "base) get no gradient. Call model.enable_input_require_grads() before training, or "
        "checkpoint with use_reentrant=False (gradient_checkpointing_enable("
        'gradient_checkpointing_kwargs={"use_reentrant": False})).'
    )
