"""DeepSpeed ZeRO (stages 1, 2 and 3): the gradients read through DeepSpeed.

Under ZeRO the model's parameters have no ``.grad`` at the optimizer step: DeepSpeed
reduces every gradient into the partition of the rank that updates it (stages 1 and
2 keep one flat buffer per parameter group; stage 3 also partitions the weights),
so parameter hooks and ``p.grad`` see nothing useful. What a rank holds after the
last backward of a step is its partition of the averaged gradient, which is what it
reports, as an FSDP2 rank reports its shard: every parameter's layout is
``sharded`` and the server adds the ranks' sums of squares. No collective is added:

- stage 3: ``deepspeed.utils.safe_get_local_grad`` (the rank's fp32 partition,
  trimmed of the padding of the last partition);
- stages 1 and 2: the rank's fragment of each parameter in DeepSpeed's averaged
  gradients (the buffer ``safe_get_full_grad`` reads before its all-reduce; a
  parameter with no fragment on this rank contributes no elements).

The read happens when DeepSpeed's optimizer steps (``engine.step()`` at a gradient
accumulation boundary calls it), where the reduced gradients are complete and not
yet consumed: gradflow wraps that optimizer's ``step`` for the run and restores it at
``close``. Under stage 3 the weights themselves are partitioned: the norm weights'
drift and update statistics and the weights' fingerprint (``param_sum``) are not
read (they would need a gather every step); under stages 1 and 2 every rank holds the
whole weights, and both are read as for DDP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
from torch import nn

from .._log import guarded
from ..measurement.measure import Measurer, group_norms
from ..measurement.registration import Param, Registry
from .hooks import ModelHooks


@dataclass
class Zero:
    """A DeepSpeed engine's model and ZeRO optimizer, and its stage."""

    module: nn.Module
    optimizer: Any
    stage: int


def find(model: Any, optimizer: Any) -> Optional[Zero]:
    """The ZeRO setup behind `model` and `optimizer`: a DeepSpeed engine (what
    ``deepspeed.initialize`` returns) alone, or its ``module`` with its ``optimizer``.
    None when neither is DeepSpeed's ZeRO."""
    stage_of = getattr(model, "zero_optimization_stage", None)
    if callable(stage_of) and isinstance(getattr(model, "module", None), nn.Module):
        stage = int(stage_of())
        if stage in (1, 2, 3):
            return Zero(model.module, getattr(model, "optimizer", None), stage)
        return None
    of_optimizer = _optimizer_stage(optimizer)
    if of_optimizer is not None and isinstance(model, nn.Module):
        return Zero(model, optimizer, of_optimizer)
    return None


def _optimizer_stage(optimizer: Any) -> Optional[int]:
    """The ZeRO stage of DeepSpeed's ZeRO optimizer, recognised without importing
    DeepSpeed; None for any other optimizer."""
    names = [c.__name__ for c in type(optimizer).__mro__]
    if "DeepSpeedZeroOptimizer_Stage3" in names:
        return 3
    if "DeepSpeedZeroOptimizer" in names:
        return 2 if getattr(optimizer, "partition_gradients", False) else 1
    return None


def partitioned(model: nn.Module) -> Optional[str]:
    """A parameter whose gradient DeepSpeed's optimizer holds (ZeRO stage 3 partitions
    it: ``ds_id``; stages 1 and 2 map it to their flat partitions: ``_hp_mapping``),
    found on a model given without its engine or ZeRO optimizer: its ``.grad`` is
    None at the step, and gradflow cannot read it."""
    for name, p in model.named_parameters():
        if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
            return name
    return None


# -- reading the gradients -------------------------------------------------------


def _stage3_grad(p: Any) -> Optional[torch.Tensor]:
    """This rank's partition of a ZeRO-3 parameter's averaged gradient, without the
    padding the last partitions carry."""
    from deepspeed.utils import safe_get_local_grad

    g: Optional[torch.Tensor] = safe_get_local_grad(p)
    if g is None:
        return None
    g = g.reshape(-1)
    part = int(p.ds_tensor.ds_numel)
    rank = int(torch.distributed.get_rank(group=getattr(p, "ds_process_group", None)))
    real = max(0, min(part, int(p.ds_numel) - rank * part))
    return g.narrow(0, 0, real)


def _fragment_grad(p: Any) -> Optional[torch.Tensor]:
    """This rank's fragment of a ZeRO-1/2 parameter's averaged gradient (empty when
    the rank's partition holds none of it)."""
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is None:
        empty: torch.Tensor = p.new_zeros(0, dtype=torch.float32)
        return empty
    try:
        fragment: torch.Tensor = mapping.get_lp_grad_fragment(p._index_in_param_group)
        return fragment.reshape(-1)
    except ValueError:  # no averaged gradients: the step was not reduced
        return None


class ZeroMeasurer(Measurer):
    """A :class:`gradflow.measurement.measure.Measurer` whose gradients come from DeepSpeed's
    partitions (see the module)."""

    def __init__(self, registry: Registry, hooks: ModelHooks, stage: int) -> None:
        self.stage = stage
        self._read: Callable[[Any], Optional[torch.Tensor]] = (
            _stage3_grad if stage == 3 else _fragment_grad
        )
        super().__init__(registry, hooks)

    def measure_grads(self) -> None:
        grads: List[torch.Tensor] = []
        present: List[int] = []
        for i, t in enumerate(self._tensors):
            if not t.requires_grad:
                continue
            g = self._read(t)
            if g is not None:
                grads.append(g)
                present.append(i)
        if not present:
            super().measure_grads()  # nothing reduced: what p.grad holds (nothing)
            return
        layout = self._layouts.get(tuple(present)) or self._layout(present, grads)
        self._grads = group_norms(layout, grads)
        self._grad_layout = layout

    def snapshot_norms(self) -> None:
        if self.stage < 3:  # stage 3: the weights are partitioned (see the module)
            super().snapshot_norms()


# -- the registration ------------------------------------------------------------


def adapt(registry: Registry, zero: Zero) -> None:
    """Every parameter's gradient is partitioned across the ranks (``sharded``);
    under stage 3 a parameter's shape is DeepSpeed's (``ds_shape``: the tensor itself
    is empty outside forward and backward)."""
    spec_of = registry.param_spec

    def param_spec(p: Param, membership: Any) -> Any:
        spec = spec_of(p, membership)
        if registry.world_size > 1:
            spec["layout"] = "sharded"
            spec.pop("shard_ranks", None)
        shape = getattr(p.tensor, "ds_shape", None)
        if shape is not None:
            spec["shape"] = [int(d) for d in shape]
        return spec

    registry.param_spec = param_spec  # type: ignore[method-assign]


def measure(instruments: Any, zero: Zero) -> None:
    """The run's measurer, reading DeepSpeed's partitions; under stage 3 no weights'
    fingerprint (it would need the partitioned weights gathered)."""
    old = instruments.measurer
    new = ZeroMeasurer(instruments.registry, instruments.hooks, zero.stage)
    new.partial = old.partial
    new.fingerprint_every = old.fingerprint_every if zero.stage < 3 else 0
    instruments.measurer = new


def attach(instruments: Any, zero: Zero) -> None:
    """The gradients read when DeepSpeed's optimizer steps, what follows its step
    after it: the optimizer step hooks of a plain run, on DeepSpeed's ``step``."""
    if zero.optimizer is None:
        return
    tap = StepTap(
        zero.optimizer,
        lambda: instruments._pre_step(zero.optimizer, (), {}),
        lambda: instruments._post_step(zero.optimizer, (), {}),
    )
    instruments._handles.append(tap)


class StepTap:
    """DeepSpeed's optimizer ``step``, wrapped for the run: `before` reads the
    gradients, `after` what follows the optimizer step."""

    def __init__(
        self, optimizer: Any, before: Callable[[], None], after: Callable[[], None]
    ) -> None:
        self.optimizer = optimizer
        self._had_own = "step" in vars(optimizer)
        original = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            _call(before)
            result = original(*args, **kwargs)
            _call(after)
            return result

        optimizer.step = step
        self._original = original

    def remove(self) -> None:
        if self._had_own:
            self.optimizer.step = self._original
        else:
            vars(self.optimizer).pop("step", None)


@guarded("reading DeepSpeed's gradients")
def _call(fn: Callable[[], None]) -> None:
    fn()
