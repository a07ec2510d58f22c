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
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

from . import _env


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
    return isinstance(getattr(t, "_local_tensor", None), torch.Tensor) and hasattr(t, "placements")


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: a DTensor's local shard (a plain tensor, so that
    reading it goes through no DTensor dispatch and no collective), any other tensor
    itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


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
