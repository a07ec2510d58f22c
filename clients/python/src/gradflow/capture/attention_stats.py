"""An attention module's largest pre-softmax logit and smallest head entropy, seen in
its own forward pass.

On a sampled step, while a watched attention module runs its forward, a
``TorchFunctionMode`` (thread-local, entered and left by the module's forward hooks)
looks at the torch calls it makes and passes every one through unchanged:

- a softmax (eager attention, Hugging Face's ``eager_attention_forward``): its input is
  the logits with the mask already added (masked positions at the dtype's lowest value
  or −∞, so they never win the max), its output the attention probabilities;
- ``scaled_dot_product_attention`` (SDPA, fused or not): its query and key, scale, mask
  and causal flag; the logits are recomputed from them with math attention (a probe),
  in chunks that bound the memory it takes.

The numbers are computed under ``no_grad`` from detached tensors, so training is
unchanged. What runs where: on a GPU at once (kernels queued on the step's stream); on
a CPU later, on the reporter thread, from the tensors kept (:class:`Held`). Kernels
the mode cannot see (the ``flash_attn`` package, a compiled graph) are not measured.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# Logits materialised at once by a probe, at most (elements): 64 M f32, 256 MiB.
PROBE_CHUNK = 1 << 26

_SOFTMAXES = {F.softmax, torch.softmax, torch.Tensor.softmax}


class Held:
    """A tensor kept for a computation that runs later, with its version counter at
    the time: a tensor changed in place since then is not read (``None``)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()
        self.version = tensor._version

    def get(self) -> Optional[torch.Tensor]:
        return self.tensor if self.tensor._version == self.version else None


# Receives each capture (a function computing its numbers) and the device it runs on.
Sink = Callable[[Callable[[], torch.Tensor], torch.device], None]


class AttentionCapture(TorchFunctionMode):
    """Passes every call through; hands `sink` a function that computes [max logit,
    min head entropy] for each softmax over the keys and each SDPA call it sees."""

    def __init__(self, sink: Sink) -> None:
        super().__init__()
        self.sink = sink

    # Typed here: torch's TorchFunctionMode leaves them unannotated.
    def __enter__(self) -> AttentionCapture:
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: Optional[Any] = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            if func in _SOFTMAXES:
                self._softmax(args, kwargs, out)
            elif func is F.scaled_dot_product_attention:
                self._sdpa(args, kwargs)
        except Exception:  # never break the forward pass: this call is not measured
            pass
        return out

    def _softmax(self, args: Any, kwargs: Any, out: Any) -> None:
        logits = args[0] if args else kwargs.get("input")
        dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
        if not isinstance(logits, torch.Tensor) or not isinstance(out, torch.Tensor):
            return
        if logits.dim() < 3 or dim not in (-1, logits.dim() - 1):
            return
        held_logits, held_probs = Held(logits), Held(out)
        self.sink(lambda: _from_probs(held_logits, held_probs), logits.device)

    def _sdpa(self, args: Any, kwargs: Any) -> None:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        given = dict(zip(names, args))
        given.update(kwargs)
        query, key = given.get("query"), given.get("key")
        if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
            return
        mask = given.get("attn_mask")
        probe = _Probe(
            Held(query),
            Held(key),
            Held(mask) if isinstance(mask, torch.Tensor) else None,
            bool(given.get("is_causal", False)),
            given.get("scale"),
        )
        self.sink(probe.stats, query.device)


def _from_probs(logits: Held, probs: Held) -> torch.Tensor:
    """[max logit, min head entropy] from a softmax's input and output."""
    x, p = logits.get(), probs.get()
    if x is None or p is None:
        return _unknown(logits.tensor.device)
    with torch.no_grad():
        return _measured(x.amax(), _min_head_entropy(p.float()))


def _min_head_entropy(p: torch.Tensor) -> torch.Tensor:
    """The smallest over heads of the mean over queries (and the batch) of
    −Σ_j p_ij ln p_ij, for probabilities `p` of shape (..., heads, queries, keys) or
    (batch·heads, queries, keys)."""
    entropy = torch.special.entr(p).sum(-1)
    if entropy.dim() >= 3:
        per_head = entropy.mean(dim=-1).flatten(0, -2).mean(0)
    else:
        per_head = entropy.mean(dim=-1)
    smallest: torch.Tensor = per_head.amin()
    return smallest


class _Probe:
    """Math attention over SDPA's inputs: the logits q·kᵀ·scale with its mask, a
    chunk of batch rows at a time."""

    def __init__(
        self,
        query: Held,
        key: Held,
        mask: Optional[Held],
        causal: bool,
        scale: Optional[float],
    ) -> None:
        self.query, self.key, self.mask = query, key, mask
        self.causal, self.scale = causal, scale

    def stats(self) -> torch.Tensor:
        q, k = self.query.get(), self.key.get()
        mask = self.mask.get() if self.mask is not None else None
        if q is None or k is None or (self.mask is not None and mask is None):
            return _unknown(self.query.tensor.device)
        with torch.no_grad():
            return self._stats(q, k, mask)

    def _stats(
        self, q: torch.Tensor, k: torch.Tensor, mask: Optional[torch.Tensor]
    ) -> torch.Tensor:
        q, k = q.float(), k.float()
        while q.dim() < 3:
            q, k = q.unsqueeze(0), k.unsqueeze(0)
        if k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)  # grouped queries
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        rows = q.shape[0]
        per_row = max(1, q[0].numel() // q.shape[-1] * k.shape[-2])
        chunk = max(1, PROBE_CHUNK // per_row)
        maxima, minima = [], []
        for start in range(0, rows, chunk):
            end = min(rows, start + chunk)
            logits = (q[start:end] @ k[start:end].transpose(-2, -1)) * scale
            logits = self._masked(logits, mask, start, end)
            maxima.append(logits.amax())
            minima.append(_min_head_entropy(torch.softmax(logits, dim=-1)))
        return _measured(torch.stack(maxima).amax(), torch.stack(minima).amin())

    def _masked(
        self, logits: torch.Tensor, mask: Optional[torch.Tensor], start: int, end: int
    ) -> torch.Tensor:
        low = torch.finfo(logits.dtype).min
        if self.causal:
            queries, keys = logits.shape[-2], logits.shape[-1]
            keep = torch.ones(queries, keys, dtype=torch.bool, device=logits.device).tril()
            logits = logits.masked_fill(~keep, low)
        if mask is None:
            return logits
        if mask.dim() == logits.dim() and mask.shape[0] > 1:
            mask = mask[start:end]  # this chunk's batch rows
        if mask.dtype == torch.bool:
            return logits.masked_fill(~mask, low)
        return (logits + mask.float()).clamp_min(low)


def _unknown(device: torch.device) -> torch.Tensor:
    """Not measured: a tensor changed in place before it was read (its flag 0)."""
    # Filled on the device: a tensor built on the host and copied would wait for the
    # stream (pageable copies to a CUDA device do).
    unknown = torch.full((3,), float("nan"), device=device)
    unknown[2] = 0.0
    return unknown


def _measured(max_logit: torch.Tensor, min_entropy: torch.Tensor) -> torch.Tensor:
    """[max logit, min head entropy, 1]: what every capture yields (WIDTH numbers)."""
    return torch.stack([max_logit.float(), min_entropy.float(), torch.ones_like(min_entropy)])


# Numbers each capture yields: max logit, min head entropy, whether measured.
WIDTH = 3
