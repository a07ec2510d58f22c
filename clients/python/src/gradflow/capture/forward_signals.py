"""The instability signals read in the forward pass: attention, block activations,
output logits, MoE routing and the batch's token ids, on the steps their interval
samples.

Hooks are put on the modules only for a sampled step (before its forward, at the
previous ``gf.step``) and taken off at its ``gf.step``: on every other step the
modules run with no hook of gradflow's, at no cost. They are registered once, when
the watch begins, and switched on and off by family
(:class:`gradflow._torch_compat.ParkedForwardHooks`: a dict insertion a hook, not a
registration with its handle, ~0.6 ms of the training thread's at every sampled
step of Qwen2.5-0.5B's 24 layers before). The one exception is the input
embedding's pre-hook that reads the token ids (the ``tokens`` family, due on most
steps): it stays on while the family is measured and returns at once when not due.
A sampled step's hooks run only in training forwards (gradients enabled, not a
checkpointed forward recomputed in backward). Each hook hands over a *capture*: a
function of tensors the forward made that yields a few numbers; on a GPU it is called
at once (kernels queued on the step's stream), on a CPU the reporter thread calls it
(:class:`gradflow.measurement.vector.Deferred`).
The numbers of a module's captures of one step (several with gradient accumulation)
are combined in the record (:mod:`gradflow.measurement.record`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, List, Optional

import torch

from .. import _torch_compat
from ..measurement.signal_modules import Router, SignalModules
from ..measurement.signal_record import Captured
from ..measurement.signals import Schedule
from ..measurement.step_signals import ForwardTaken
from ..measurement.vector import Deferred, Piece
from . import attention_stats
from .attention_stats import AttentionCapture, Held

# Tokens of the output logits read at most per forward (every k-th token beyond).
OUTPUT_TOKENS = 1024

# The families read by hooks switched on for their sampled steps (the token ids'
# hook stays on: see the module's doc).
_HOOKED = ("attention", "activations", "output_logits", "moe")

Capture = Callable[[], torch.Tensor]


class ForwardSignals:
    """Hooks on the signal modules for the sampled steps, and what they captured."""

    def __init__(self, modules: SignalModules, schedule: Schedule) -> None:
        self.modules = modules
        self.schedule = schedule
        self._hooks = _torch_compat.ParkedForwardHooks()
        self._entries: List[Captured] = []
        self._values: List[Any] = []  # per entry: a tensor (device) or a Capture (CPU)
        self._size = 0
        self._open: List[AttentionCapture] = []
        # The token ids are read on most steps (every step by default): their hook
        # stays on and reads only on due steps, rather than coming and going each
        # step (a compiled model would see a new hook every time).
        self._tokens_due = False
        self._tokens_handle: Any = None
        if schedule.intervals.get("tokens") and modules.embedding is not None:
            name, module = modules.embedding
            read = functools.partial(self._tokens, name)
            self._tokens_handle = module.register_forward_pre_hook(
                functools.partial(self._read_ids, read)
            )
        intervals = schedule.intervals
        if intervals.get("attention"):
            for name, module in modules.attention:
                self._hook_attention(name, module)
        if intervals.get("activations"):
            for name, module in modules.blocks:
                self._hook_output("activations", module, functools.partial(self._activation, name))
        if intervals.get("output_logits") and modules.output is not None:
            name, module = modules.output
            read = functools.partial(self._output_logits, name)
            self._hook_output("output_logits", module, read)
        if intervals.get("moe"):
            for router in modules.routers:
                self._hook_output("moe", router.module, functools.partial(self._routing, router))
        # The families whose hooks are switched on for a sampled step.
        self._hooked = [f for f in _HOOKED if intervals.get(f)]

    def arm(self, step: int) -> None:
        """Hooks for `step` if a forward family is due on it (none otherwise)."""
        self.disarm()
        due = self.schedule.due
        for family in self._hooked:
            if due(family, step):
                self._hooks.switch_on(family)
        self._tokens_due = due("tokens", step)

    def disarm(self) -> None:
        self._tokens_due = False
        self._hooks.switch_off()
        while self._open:  # a forward that raised inside an attention module
            self._open.pop().__exit__(None, None, None)

    def take(self) -> Optional[ForwardTaken]:
        """This step's captures as one piece (None: nothing captured); hooks off."""
        self.disarm()
        entries, values, size = self._entries, self._values, self._size
        self._entries, self._values, self._size = [], [], 0
        if not entries:
            return None
        if all(isinstance(v, torch.Tensor) for v in values):
            device = values[0].device
            piece: Piece = torch.cat([v.reshape(-1).to(device, torch.float64) for v in values])
        else:
            piece = Deferred(size, torch.device("cpu"), functools.partial(_compute, values))
        return ForwardTaken(piece, entries)

    def remove(self) -> None:
        self.disarm()
        self._hooks.remove()
        if self._tokens_handle is not None:
            self._tokens_handle.remove()
            self._tokens_handle = None
        self._entries, self._values, self._size = [], [], 0

    # -- capturing ---------------------------------------------------------------

    def _keep(self, family: str, module: str, width: int, capture: Capture, device: Any) -> None:
        value: Any = capture if device.type == "cpu" else capture()
        self._entries.append(Captured(family, module, self._size, width))
        self._values.append(value)
        self._size += width

    def _hook_output(
        self, family: str, module: torch.nn.Module, read: Callable[[Any], None]
    ) -> None:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            if _training_forward():
                _safely(read, output)

        self._hooks.add(module, hook, family)

    def _read_ids(self, read: Callable[[Any], None], _module: Any, args: Any) -> None:
        if self._tokens_due and args and _training_forward():
            _safely(read, args[0])

    def _hook_attention(self, name: str, module: torch.nn.Module) -> None:
        def enter(_module: Any, _args: Any) -> None:
            if not _training_forward():
                return
            sink = functools.partial(self._attention, name)
            mode = AttentionCapture(sink)
            mode.__enter__()
            self._open.append(mode)

        def leave(_module: Any, _args: Any, _output: Any) -> None:
            if self._open:
                self._open.pop().__exit__(None, None, None)

        self._hooks.add_pre(module, enter, "attention")
        self._hooks.add(module, leave, "attention", always_call=True)

    def _attention(self, name: str, capture: Capture, device: torch.device) -> None:
        self._keep("attention", name, attention_stats.WIDTH, capture, device)

    def _activation(self, name: str, output: Any) -> None:
        x = _first_tensor(output)
        if x is not None and x.is_floating_point() and x.numel():
            held = Held(x)
            self._keep("activations", name, 3, functools.partial(_activation, held), x.device)

    def _output_logits(self, name: str, output: Any) -> None:
        x = _first_tensor(output)
        if x is not None and x.is_floating_point() and x.dim() >= 2 and x.numel():
            held = Held(x)
            self._keep("output_logits", name, 4, functools.partial(_logits, held), x.device)

    def _tokens(self, name: str, ids: Any) -> None:
        if isinstance(ids, torch.Tensor) and not ids.is_floating_point() and ids.numel():
            held = Held(ids)
            self._keep("tokens", name, 2, functools.partial(_repeated_tokens, held), ids.device)

    def _routing(self, router: Router, output: Any) -> None:
        logits = _first_tensor(output)
        if logits is None or not logits.is_floating_point() or logits.dim() < 1:
            return
        experts = router.experts or int(logits.shape[-1])
        indices = _indices(output)
        held_indices = Held(indices) if indices is not None else None
        capture = functools.partial(
            _routing, Held(logits), held_indices, experts, router.top_k or 1
        )
        self._keep("moe", router.name, experts + 2, capture, logits.device)


def _training_forward() -> bool:
    return torch.is_grad_enabled() and not _torch_compat.in_backward()


def _safely(read: Callable[[Any], None], output: Any) -> None:
    # Never break the forward pass: a failing read leaves this module not measured.
    with contextlib.suppress(Exception):
        read(output)


def _first_tensor(output: Any) -> Optional[torch.Tensor]:
    """A module's output tensor: itself, or the first of a tuple, list or a
    ``ModelOutput``/dict (a decoder layer may return ``(hidden_states, ...)``)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _indices(output: Any) -> Optional[torch.Tensor]:
    """The top-k expert indices a router returns last, as transformers' routers do."""
    if isinstance(output, (tuple, list)) and len(output) >= 2:
        last = output[-1]
        if isinstance(last, torch.Tensor) and not last.is_floating_point():
            return last
    return None


def _compute(values: List[Any]) -> torch.Tensor:
    """A CPU step's captures, computed now (on the reporter thread)."""
    return torch.cat([(v() if callable(v) else v).reshape(-1).double() for v in values])


def _not_measured(width: int, device: torch.device) -> torch.Tensor:
    return torch.full((width,), float("nan"), device=device)


def _scalar(value: float, device: torch.device) -> torch.Tensor:
    """`value` as an f32 tensor on `device`, written there by a fill kernel: built on
    the host and copied, it would wait for the device to finish the forward so far
    (a copy from pageable memory to a CUDA device waits for the stream)."""
    return torch.full((), float(value), dtype=torch.float32, device=device)


def _activation(held: Held) -> torch.Tensor:
    """[sum of squares, elements, largest |value|] of a block's output."""
    x = held.get()
    if x is None:
        return _not_measured(3, held.tensor.device)
    with torch.no_grad():
        sumsq = torch.linalg.vector_norm(x, dtype=torch.float32).square()
        low, high = torch.aminmax(x)
        absmax = torch.maximum(high, -low).float()
        count = _scalar(x.numel(), x.device)
        return torch.stack([sumsq, count, absmax])


def _logits(held: Held) -> torch.Tensor:
    """[Σ log Z, tokens read, largest |logit|, Σ mean logit] over every k-th token of
    the output (a token's mean logit over the vocabulary: the level the softmax does
    not see)."""
    x = held.get()
    if x is None:
        return _not_measured(4, held.tensor.device)
    with torch.no_grad():
        flat = x.reshape(-1, x.shape[-1])
        stride = max(1, math.ceil(flat.shape[0] / OUTPUT_TOKENS))
        sample = flat[::stride].float()
        logz = torch.logsumexp(sample, dim=-1)
        low, high = torch.aminmax(sample)
        count = _scalar(sample.shape[0], x.device)
        level = sample.mean(dim=-1).sum()
        return torch.stack([logz.sum(), count, torch.maximum(high, -low), level])


def _repeated_tokens(held: Held) -> torch.Tensor:
    """[the largest share of one id within a sequence, max over the sequences; 1]:
    the ids of each sequence sorted, its longest run of equal ids over its length."""
    ids = held.get()
    if ids is None:
        return _not_measured(2, held.tensor.device)
    with torch.no_grad():
        rows = ids.reshape(-1, ids.shape[-1]) if ids.dim() else ids.reshape(1, 1)
        length = rows.shape[-1]
        ranked = rows.sort(dim=-1).values
        position = torch.arange(length, device=ids.device).expand_as(ranked)
        starts = torch.ones_like(ranked, dtype=torch.bool)
        starts[:, 1:] = ranked[:, 1:] != ranked[:, :-1]
        # Where each position's run of equal ids began: the last start at or before it.
        begun = torch.where(starts, position, torch.zeros_like(position)).cummax(dim=-1).values
        longest = (position - begun + 1).max().double()
        return torch.stack([longest / length, torch.ones_like(longest)])


def _routing(logits: Held, indices: Optional[Held], experts: int, top_k: int) -> torch.Tensor:
    """[tokens per expert (experts numbers), Σ (log Z of the router)², tokens]."""
    x = logits.get()
    chosen = indices.get() if indices is not None else None
    if x is None or (indices is not None and chosen is None):
        return _not_measured(experts + 2, logits.tensor.device)
    with torch.no_grad():
        flat = x.reshape(-1, x.shape[-1])
        if chosen is None:
            chosen = flat.topk(min(top_k, flat.shape[-1]), dim=-1).indices
        counts = torch.bincount(chosen.reshape(-1).long(), minlength=experts)[:experts]
        z = torch.logsumexp(flat.float(), dim=-1)
        tokens = _scalar(flat.shape[0], x.device)
        return torch.cat([counts.float(), (z * z).sum().reshape(1), tokens.reshape(1)])
