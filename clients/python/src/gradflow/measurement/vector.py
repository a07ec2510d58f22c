"""A step's device numbers as pieces of one vector, and that vector on its way to the
host: one transfer a step.

On a device (CUDA) the training thread concatenates the pieces, starts a
non-blocking copy into pinned memory and records an event the reporter thread waits
on. On a CPU there is nothing to wait for, so the training thread does not even
concatenate: it hands the pieces over (:class:`HostPieces`) and the reporter thread
stacks, concatenates and reads them, and computes the pieces made of arithmetic on
copies (:class:`Deferred`: the norm weights' statistics, the low-precision update
check). Every piece is this step's own result or a copy, which nothing changes
afterwards.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple, Union

import torch


class Deferred:
    """Numbers of a CPU step computed on the reporter thread when it reads the step's
    vector, from copies the training thread made: `numel` numbers on `device`, given
    by `compute()`."""

    def __init__(
        self, numel: int, device: torch.device, compute: Callable[[], torch.Tensor]
    ) -> None:
        self.numel = numel
        self.device = device
        self.compute = compute


# A piece of a step's vector: a tensor, a list of 0-dim tensors (a CPU's gradient
# norms, stacked only on the reporter thread), or numbers computed there.
Piece = Union[torch.Tensor, List[torch.Tensor], Deferred]


def numel(piece: Piece) -> int:
    """How many numbers `piece` puts in the vector."""
    if isinstance(piece, list):
        return len(piece)
    return piece.numel if isinstance(piece, Deferred) else piece.numel()


def device_of(piece: Piece) -> torch.device:
    return piece[0].device if isinstance(piece, list) else piece.device


def flat(piece: Piece) -> torch.Tensor:
    """`piece` as a 1-D tensor (stacked or computed now: on the thread that calls)."""
    if isinstance(piece, list):
        return torch.stack(piece)
    if isinstance(piece, Deferred):
        return piece.compute().reshape(-1)
    return piece.reshape(-1)


def wide(device: torch.device) -> torch.dtype:
    """The dtype of sums and of the vector brought to the host: f64, except on a
    device without it (Apple's MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


class HostPieces:
    """A CPU step's numbers, still in pieces: :meth:`tolist` (on the reporter thread)
    concatenates them in the wide dtype and reads them, so the training thread does
    neither."""

    def __init__(self, pieces: List[Piece], dtype: torch.dtype) -> None:
        self.pieces = pieces
        self.dtype = dtype

    def tolist(self) -> List[float]:
        vector = torch.cat([flat(p).to(self.dtype) for p in self.pieces])
        values: List[float] = vector.tolist()
        return values


def to_host(pieces: List[Piece]) -> Tuple[object, Optional[torch.cuda.Event]]:
    """The step's vector (anything with ``tolist()``) and the event the reader waits
    for before reading it (None: readable at once)."""
    device = device_of(pieces[0])
    dtype = wide(device)
    if device.type == "cpu" and all(device_of(p).type == "cpu" for p in pieces):
        return HostPieces(pieces, dtype), None
    vector = torch.cat([flat(p).to(device, dtype, non_blocking=True) for p in pieces])
    if device.type != "cuda":
        return vector, None
    host = torch.empty(vector.shape, dtype=dtype, pin_memory=True)
    host.copy_(vector, non_blocking=True)
    # Blocking: the reporter thread sleeps until the copy lands instead of spinning on
    # a core for the rest of the step (44 ms of CPU a step at 8x2048 tokens on
    # Qwen2.5-0.5B before).
    event = torch.cuda.Event(blocking=True)
    event.record()
    return host, event


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (a small host tensor the client built) on `device`, without waiting for
    the device: a copy from pageable host memory to a CUDA device first waits for
    every kernel already queued on the stream, which on the training thread turns
    the step's host work and the device's into one serial chain (the Adam state's
    per-chunk sizes did that: +240 ms on a sampled step of Qwen2.5-0.5B on an H200).
    Pinned, the copy is queued like a kernel."""
    if t.device == device or t.device.type != "cpu" or device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
