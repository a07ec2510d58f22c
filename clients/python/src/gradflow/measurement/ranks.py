"""Multi-rank runs: who this process is under ``torch.distributed``, the run id every
rank agrees on, where a parameter's elements live, and the local tensors a rank reads.

In a run of several ranks every rank reports its own step record: the sums of
squares of the gradient elements it holds, which the server combines (a sharded
parameter's shards add up; a replicated parameter's copies must agree). Nothing here
adds a collective to the training step: a rank reads only what it holds
(``DTensor._local_tensor`` for FSDP2 and tensor-parallel parameters and gradients).

The run id, without a per-step collective:

1. ``run_id=`` given to :func:`gradflow.watch` (the same on every rank), else
2. ``GRADFLOW_RUN_ID``, else
3. ``TORCHELASTIC_RUN_ID`` (torchrun's rendezvous id: a fresh UUID for a single-node
   or ``--standalone`` launch, ``--rdzv-id`` otherwise; it stays the same across
   elastic restarts, so a restarted job goes on with its run), unless it is torchrun's
   placeholder ``none``; the run id is the run's name (or ``run``) and that id, else
4. one broadcast from rank 0 when ``watch`` is called (an object broadcast on the
   default process group): every rank must then call ``watch``.

A rank's ``step_time`` (:class:`StepClock`) is its own work on a step: from the end
of its previous optimizer step to the moment its backward pass had accumulated its
local gradients, leaving out the time a fast rank waits for the others.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

from .. import _env, _torch_compat
from . import vector


@dataclass(frozen=True)
class Ranks:
    """This process in a ``torch.distributed`` job."""

    rank: int
    world_size: int


def current() -> Optional[Ranks]:
    """The rank and world size of the default process group, if one is initialised."""
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return Ranks(int(dist.get_rank()), int(dist.get_world_size()))


def is_dtensor(t: Any) -> bool:
    """A ``DTensor`` (FSDP2's sharded parameters and their gradients, tensor
    parallelism), recognised without importing it."""
    return _torch_compat.is_dtensor(t)


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: a DTensor's local shard, any other tensor itself."""
    return _torch_compat.local_tensor(t)


def local_numel(t: torch.Tensor) -> int:
    return int(local(t).numel())


def _is_shard(placement: Any) -> bool:
    is_shard = getattr(placement, "is_shard", None)
    if callable(is_shard) and is_shard():
        return True
    # FSDP2 with tensor parallelism shards a dimension twice: _StridedShard, whose
    # is_shard() says False.
    return type(placement).__name__ in ("Shard", "_StridedShard")


def layout_of(t: torch.Tensor, world_size: int) -> Tuple[str, Optional[List[int]]]:
    """``("sharded", shard_ranks)`` for a DTensor split along some mesh dimension
    (``shard_ranks`` None when every rank of the run holds a shard), otherwise
    ``("replicated", None)``.

    The ranks whose shards make up the whole tensor are those of the mesh at index 0
    along every dimension the tensor is not sharded on: with HSDP (a mesh of replicas
    × shards) one replica's shard group; the other replicas hold copies."""
    if not is_dtensor(t):
        return "replicated", None
    placements = tuple(getattr(t, "placements", ()) or ())
    sharded = [i for i, p in enumerate(placements) if _is_shard(p)]
    if not sharded:
        return "replicated", None
    mesh = getattr(getattr(t, "device_mesh", None), "mesh", None)
    if not isinstance(mesh, torch.Tensor) or mesh.dim() != len(placements):
        return "sharded", None
    index = tuple(slice(None) if i in sharded else 0 for i in range(mesh.dim()))
    holders = sorted(int(r) for r in mesh[index].reshape(-1).tolist())
    if holders == list(range(world_size)):
        return "sharded", None
    return "sharded", holders


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")


def agree_run_id(
    explicit: Optional[str], name: Optional[str], ranks: Optional[Ranks]
) -> Tuple[str, bool]:
    """The run id (and whether it was chosen by gradflow, to be printed once), the
    same on every rank of a multi-rank run: see the module's rule."""
    if explicit or os.environ.get("GRADFLOW_RUN_ID") or ranks is None or ranks.world_size < 2:
        return _env.run_id(explicit, name)
    elastic = _slug(os.environ.get("TORCHELASTIC_RUN_ID", ""))
    if elastic and elastic.lower() != "none":
        stem = _slug(name or "run")[:64] or "run"
        return f"{stem}-{elastic}"[:128].rstrip("-."), True
    chosen = _env.run_id(None, name)[0] if ranks.rank == 0 else None
    box: List[Optional[str]] = [chosen]
    torch.distributed.broadcast_object_list(box, src=0)
    if not isinstance(box[0], str):
        raise RuntimeError("rank 0 sent no run id")
    return box[0], True


# A moment on a rank's clock: ``time.perf_counter()`` seconds, or a CUDA event
# recorded on the device's current stream (read on the reporter thread).
Stamp = Any


def _stamp(device: Optional[torch.device]) -> Stamp:
    """Now: on the device's stream for a CUDA device (when the work queued so far
    has run), on the host otherwise."""
    if device is not None and device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event
    return time.perf_counter()


def elapsed(start: Stamp, end: Stamp) -> Optional[float]:
    """Seconds from `start` to `end` (on the reporter thread: it waits for a CUDA
    event; the training thread never does); None when they are not on one clock."""
    if isinstance(start, float) and isinstance(end, float):
        return max(0.0, end - start)
    if isinstance(start, float) or isinstance(end, float):
        return None
    end.synchronize()
    return max(0.0, float(start.elapsed_time(end)) / 1e3)


class StepClock:
    """A rank's own work on each optimizer step (``step_time``): from the end of its
    previous optimizer step (the first step: its first training forward, else
    ``watch``) to the end of its backward pass's local gradients: the last
    post-accumulate-grad hook of the step.

    Under DistributedDataParallel those hooks run as each gradient is accumulated on
    this rank, before the bucket's all-reduce completes (it is waited for when the
    backward pass ends), so the time a fast rank waits for a slow one is left out:
    in lockstep data parallelism every rank's wall-clock step is the same, and only
    this shows the straggler. (FSDP2 runs them after its reduce-scatter, and waits
    at each all-gather: its ranks' times include the waits.)

    On the host: one ``time.perf_counter()`` per hook call. On a CUDA device the
    host runs ahead of the device and waits for it at some later sync, so the
    moments are CUDA events on the device's stream instead: one recorded when the
    optimizer step ends, one when each backward pass ends (an autograd final
    callback, queued by the pass's first hook, that runs before DDP's wait for the
    all-reduce). Nothing here waits for the device.
    """

    def __init__(self, device: Optional[torch.device]) -> None:
        self.device = device
        self._began: Stamp = _stamp(device)
        self._first = True  # no optimizer step yet: the first forward starts the work
        self._forward_seen = False
        self._done: Optional[Stamp] = None  # the latest end of a backward pass
        self._stepped: Optional[Stamp] = None  # the end of this step's optimizer step
        self._queued = False  # a CUDA backward pass's end is queued already

    def on_forward(self) -> None:
        """A training forward of the watched model."""
        if self._first and not self._forward_seen:
            self._forward_seen = True
            self._began = _stamp(self.device)

    def on_grad(self, cuda: bool) -> None:
        """A parameter's gradient accumulated (its post-accumulate-grad hook)."""
        if not cuda:
            self._done = time.perf_counter()
            return
        if self._queued:
            return
        device = self.device if self.device is not None else torch.device("cuda")

        def ended() -> None:
            self._queued = False
            try:
                self._done = _stamp(device)
            except Exception:  # never break the backward pass
                self._done = None

        try:
            _torch_compat.queue_callback(ended)
            self._queued = True
        except Exception:
            self._done = None

    def on_optimizer_step(self) -> None:
        """The optimizer's step has just ended."""
        self._stepped = _stamp(self.device)

    def take(self) -> Optional[Tuple[Stamp, Stamp]]:
        """At ``gf.step``: the step's (start, end), None when no backward pass reached
        a watched parameter since the step began; the next step begins."""
        began, done = self._began, self._done
        stepped = self._stepped
        self._began = stepped if stepped is not None else _stamp(self.device)
        self._done = self._stepped = None
        self._first = False
        if done is None or (isinstance(done, float) and isinstance(began, float) and done < began):
            return None
        return began, done


def param_sums(
    tensors: List[torch.Tensor], module_of: List[int], modules: int
) -> Optional[torch.Tensor]:
    """Each module's fingerprint of its weights: the sum of the elements this rank
    holds of its parameters (`tensors[i]` belongs to module `module_of[i]`), in f64
    (f32 on Apple's MPS), on the first parameter's device; None when there is nothing
    to sum. One reduction per parameter, no sync: read with the step's other numbers.
    Replicas of a replicated module hold the same weights, so their sums are equal to
    the bit; the server compares them (``replica_divergence``)."""
    parts: List[torch.Tensor] = []
    index: List[int] = []
    for t, m in zip(tensors, module_of):
        mine = local(t)
        if not mine.is_floating_point() or mine.numel() == 0:
            continue
        wide = torch.float32 if mine.device.type == "mps" else torch.float64
        parts.append(mine.detach().sum(dtype=wide))
        index.append(m)
    if not parts:
        return None
    device, dtype = parts[0].device, parts[0].dtype
    sums = torch.zeros(modules, dtype=dtype, device=device)
    at = vector.to_device(torch.tensor(index, dtype=torch.long), device)
    return sums.index_add_(0, at, torch.stack([p.to(device, dtype) for p in parts]))


def step_clock_device(tensors: List[torch.Tensor]) -> Optional[torch.device]:
    """The device whose clock times a rank's steps: its first trainable parameter's
    (the host's for a CPU one)."""
    for t in tensors:
        if t.requires_grad:
            return t.device
    return tensors[0].device if tensors else None
