"""What every case of the failure corpus shares.

A case is a silent failure a user reported in a public thread, rebuilt on CPU with a
tiny model from a config (random weights, no hub download). It runs through the
quickstart API only (``gradflow.watch(model, optimizer[, scaler])``, ``gf.step(loss=...)``,
``gf.close()``, no thresholds, no ``train=``), proves that the failure happens on the
PyTorch side, then reads the server's verdict back from its REST API.

The session server and ``gradflow_env`` (the run id and server address through
``GRADFLOW_*``) come from ``tests/conftest.py``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
    TypeVar,
    Union,
)

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer, TrainingArguments

import gradflow
from gradflow.integrations.transformers import GradflowCallback

# The former one length for all (`grad_stuck_zero`'s 50 step numbers and two). A case
# now runs for three times the longest window of the detectors involved, below.
STEPS = 52

# The detectors' windows, from PROTOCOL.md's alert table: a case runs for three times
# the longest of those involved in its verdict (a healthy look-alike: in its twin
# failure's), so that the verdict is not an artefact of a run sized to one rule.
STUCK_WINDOW = 50  # grad_stuck_zero, unused_parameters
NORM_WINDOW = 20  # norm_weight_frozen, update_rounded_away, model_in_eval_mode
OVERFLOW_WINDOW = 10  # scaler_overflow_streak
FIRST_STEPS = 12  # the client's clip and scheduler checks; registration checks
RESET_WINDOW = 3  # accumulation_reset, grads_not_zeroed (reports running)
RESET_STEPS = 12  # four times RESET_WINDOW, in optimizer steps
SPIKE_WINDOW = 128  # loss_spike
SEEDS = [0, 1, 2]


def three_windows(window: int) -> int:
    """The run length for a case whose longest involved window is `window`."""
    return 3 * window


seeded = pytest.mark.parametrize("seed", SEEDS)

VOCAB = 64
SEQ = 8
BATCH = 4


def tiny_qwen(seed: int = 0, **overrides: Any) -> Qwen2ForCausalLM:
    """A random two-layer Qwen2 causal LM, hidden 32: groups `model.embed_tokens`,
    `model.layers`, `model.norm`, `lm_head`."""
    settings: Dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**settings))
    model.train()
    return model


def token_batches(seed: int = 1, vocab: int = VOCAB) -> Iterator[torch.Tensor]:
    """Endless random token batches (a language-modelling task: labels = inputs)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def counting_batches(seed: int = 1, vocab: int = VOCAB) -> Iterator[torch.Tensor]:
    """Endless batches of sequences that count up from a random token (mod `vocab`):
    a language-modelling task whose next token can be learnt, so that a healthy run's
    held-out loss measurably falls (on random tokens it cannot)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab, (BATCH, 1), generator=g)
        yield (start + torch.arange(SEQ)) % vocab


def feature_batches(width: int, classes: int, seed: int = 1, batch: int = BATCH * 2):
    """Endless (features, class) batches of a learnable task: the class is the sign
    pattern of the first features."""
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(batch, width, generator=g)
        yield x, ((x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()) % classes


def held_out_tokens(count: int = 64) -> torch.Tensor:
    """A held-out batch of the counting task (the same for every seed)."""
    g = torch.Generator().manual_seed(999)
    start = torch.randint(0, VOCAB, (count, 1), generator=g)
    return (start + torch.arange(SEQ)) % VOCAB


def held_out_features(width: int = 16, classes: int = 4, count: int = 256) -> Any:
    """A held-out batch of `feature_batches`' task (the same for every seed)."""
    return next(feature_batches(width, classes, seed=999, batch=count))


def held_out_loss(model: nn.Module, loss_of: Callable[[nn.Module, Any], torch.Tensor], batch: Any):
    """The model's loss on a held-out batch, without a gradient and in its own mode."""
    with torch.no_grad():
        return float(loss_of(model, batch))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """A Hugging Face causal LM's own loss (labels = inputs)."""
    return model(input_ids=tokens, labels=tokens).loss


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a plain module returning logits."""
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )


def class_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x).float(), y)


class Classifier(nn.Module):
    """features -> `embed` -> `hidden` -> `head`: the plain model of most cases."""

    def __init__(self, width: int = 16, hidden: int = 32, classes: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(width, hidden)
        self.hidden = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(torch.relu(self.embed(x)))))


def train_step(
    model: nn.Module,
    optimizer: Any,
    loss_of: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None,
    data: Optional[Iterator[Any]] = None,
    *,
    scaler: Any = None,
    autocast: Optional[torch.dtype] = None,
    before: Optional[Callable[[int], None]] = None,
    after_backward: Optional[Callable[[int], None]] = None,
    after_step: Optional[Callable[[int], None]] = None,
    seed: int = 0,
) -> Callable[[int], torch.Tensor]:
    """One iteration of the README's loop, as `step(i) -> loss` for `quickstart`:
    zero_grad, forward (under `autocast`), backward (scaled by `scaler`), optimizer
    step. `loss_of(model, batch)` defaults to the LM loss over token batches (drawn
    from `seed`); the hooks put a case's bug where the user's code had it."""
    loss_of = loss_of or lm_loss
    if data is None:
        lm = loss_of in (lm_loss, next_token_loss)
        data = token_batches(seed + 1) if lm else feature_batches(16, 4, seed + 1)

    def step(i: int) -> torch.Tensor:
        if before is not None:
            before(i)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = loss_of(model, next(data))
        (loss if scaler is None else scaler.scale(loss)).backward()
        if after_backward is not None:
            after_backward(i)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        if after_step is not None:
            after_step(i)
        return loss

    return step


@dataclass
class AmpLoop:
    """The classifier trained under fp16 autocast with a `GradScaler`, SGD at lr 0.1:
    the loop of the AMP clipping cases, `step` ready for `quickstart`."""

    model: nn.Module
    optimizer: Any
    scaler: Any
    step: Callable[[int], torch.Tensor] = field(init=False)


def amp_loop(seed: int, clip: Callable[[AmpLoop], None]) -> AmpLoop:
    """`AmpLoop` whose `clip(loop)` runs between backward and the scaler's step."""
    model = Classifier(hidden=64, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    loop = AmpLoop(model, optimizer, scaler)
    loop.step = train_step(
        model,
        optimizer,
        class_loss,
        scaler=scaler,
        autocast=torch.float16,
        after_backward=lambda _: clip(loop),
        seed=seed,
    )
    return loop


class LoRALinear(nn.Module):
    """A minimal LoRA adapter (PEFT's layout): the frozen base projection plus
    `lora_B(lora_A(x))`, B starting at zero."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x))


def add_lora(model: Qwen2ForCausalLM) -> List[nn.Parameter]:
    """Freezes the model and puts adapters on every layer's q and v projections, as
    `get_peft_model` does; returns the adapters' parameters."""
    model.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)
    return [p for n, p in model.named_parameters() if "lora_" in n]


class CheckpointedLayer(nn.Module):
    """A decoder layer run under `torch.utils.checkpoint`, as transformers 4.x's
    `gradient_checkpointing_enable()` did (reentrant by default, and no hook making
    the embedding's output require grad; transformers 5 adds that hook itself)."""

    def __init__(self, layer: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.layer = layer
        self.reentrant = reentrant

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(
            lambda h: self.layer(h, *args, **kwargs), hidden_states, use_reentrant=self.reentrant
        )


def checkpoint_layers(model: Qwen2ForCausalLM, reentrant: bool) -> None:
    # No KV cache under checkpointing (transformers turns it off too): the recompute
    # would attend to the values cached by the first, gradient-free pass.
    model.config.use_cache = False
    model.model.layers = nn.ModuleList(
        CheckpointedLayer(layer, reentrant) for layer in model.model.layers
    )


# -- a framework's own loop -------------------------------------------------------------


class TokenRows(torch.utils.data.Dataset):
    """`count` rows drawn from token batches, as a `Trainer` dataset (labels = inputs)."""

    def __init__(self, batches: Iterator[torch.Tensor], count: int) -> None:
        self.ids = torch.cat([next(batches) for _ in range(-(-count // BATCH))])[:count]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def hf_trainer(
    model: nn.Module,
    out: Any,
    steps: int,
    seed: int,
    batches: Iterator[torch.Tensor],
    **arguments: Any,
) -> Tuple[Trainer, GradflowCallback]:
    """The Hugging Face `Trainer` over `steps` optimizer steps of `batches`, watched
    as its users watch it (`GradflowCallback()`, the run from `GRADFLOW_*`): the
    trainer, not yet trained, and the callback. `arguments` are `TrainingArguments`'."""
    settings: Dict[str, Any] = dict(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=seed,
    )
    settings.update(arguments)
    rows = BATCH * steps * settings.get("gradient_accumulation_steps", 1)
    trainer = Trainer(
        model=model, args=TrainingArguments(**settings), train_dataset=TokenRows(batches, rows)
    )
    callback = GradflowCallback()
    trainer.add_callback(callback)
    return trainer, callback


# -- the failure, on the PyTorch side ------------------------------------------------


def snapshot(module: nn.Module) -> Dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def moved(before: Dict[str, torch.Tensor], module: nn.Module) -> Set[str]:
    """The parameters of `module` whose values differ from `before` (by name)."""
    now = dict(module.named_parameters())
    return {
        name
        for name, old in before.items()
        if name in now
        and (now[name].shape != old.shape or not torch.equal(now[name].detach(), old))
    }


# -- the quickstart ------------------------------------------------------------------


def quickstart(
    model: nn.Module,
    optimizer: Any,
    step: Callable[[int], Any],
    steps: int = STEPS,
    scaler: Any = None,
    before: Optional[Callable[[], None]] = None,
) -> str:
    """The README's two lines around the user's loop: `watch` once, `gf.step(loss=)`
    after every optimizer step (`step(i)` is one iteration of the user's loop and
    returns its loss), `close`. `before()` runs after `watch` and before the loop (a
    change the user made once the run was watched). Returns the run id."""
    options = {} if scaler is None else {"scaler": scaler}
    with one_thread():
        gf = gradflow.watch(model, optimizer, **options)
        if before is not None:
            before()
        for i in range(steps):
            gf.step(loss=step(i))
        gf.close()
    return gf.run_id


@contextmanager
def one_thread() -> Iterator[None]:
    """Runs torch on one intra-op thread: a tiny model's step is latency-bound, and
    on a machine shared with other builds a second thread waits for a core (a tiny
    Qwen2 step took 24 ms on one thread, 320 ms on two, under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# -- the verdict, from the server ----------------------------------------------------


def described(alerts: List[Dict[str, Any]]) -> List[Any]:
    return [(a["kind"], a["subject"], a["severity"], a["evidence"].get("cause")) for a in alerts]


def verdict(
    server: Any,
    run_id: str,
    kind: Optional[str] = None,
    subject: Optional[str] = None,
    cause: Optional[str] = None,
    wait: float = 2.0,
) -> Dict[str, Any]:
    """The run's warning or critical alert of `kind` (on a subject starting with
    `subject`, with `evidence.cause` == `cause`; `None` matches any); fails with every
    alert the run has when there is none. A case gradflow misses expects any serious
    alert, so that it fails, strict xfail, as soon as something is said."""
    deadline = time.monotonic() + wait
    while True:
        alerts = server.alerts(run_id)
        for alert in alerts:
            if (
                (kind is None or alert["kind"] == kind)
                and alert["severity"] in ("warning", "critical")
                and (subject is None or alert["subject"].startswith(subject))
                and (cause is None or alert["evidence"].get("cause") == cause)
            ):
                return alert
        if time.monotonic() > deadline:
            pytest.fail(
                f"expected {kind or 'an alert'} on {subject or 'any subject'} (cause {cause}); "
                f"the server says {described(alerts)}"
            )
        time.sleep(0.2)


def not_caught(reason: str) -> Any:
    """Marks a case gradflow does not catch today: a strict xfail that only a missing
    or wrong verdict satisfies (`verdict` fails through `pytest.fail`), so a broken
    PyTorch-side check still fails the test. `reason` starts with "missed:" or
    "wrong cause:", as the table in docs/failure-corpus.md says."""
    return pytest.mark.xfail(strict=True, raises=pytest.fail.Exception, reason=reason)


def silent(server: Any, run_id: str) -> None:
    """A healthy run: no warning or critical alert (info hints are allowed)."""
    serious = server.serious(run_id)
    assert not serious, f"false alarm: {described(serious)}"


def silent_and_stored(server: Any, run_id: str, steps: int) -> None:
    """A healthy run that was measured: the server stored every one of its `steps`
    steps (a delivery failure is not silence), and it raised no warning or critical
    alert."""
    stored = server.run(run_id)["step_count"]
    assert stored == steps, f"the server stored {stored} of {steps} steps"
    silent(server, run_id)


# -- what a case declares, and the one check that holds it to it -----------------------

# A kind or cause no rule names yet: a missed case whose right verdict has no alert
# kind matches any (so that its strict xfail fails the day something is said).
ANY = "any"
# The table's cells for a healthy look-alike, which declares silence.
NONE = "—"

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Expected:
    """What gradflow must say about a case: a warning or critical alert of `kind`, with
    `evidence.cause` == `cause`, on each of `subjects` (exactly), and nothing else
    serious but alerts of the kinds in `also` (named consequences of the same fault);
    or, with no kind, silence (a healthy look-alike)."""

    kind: Optional[str]
    subjects: Tuple[str, ...] = ()
    cause: Optional[str] = None
    also: FrozenSet[str] = frozenset()

    @property
    def silence(self) -> bool:
        return self.kind is None

    def cells(self) -> Tuple[str, Tuple[str, ...], str]:
        """Kind, subjects and cause as docs/failure-corpus.md's table writes them."""
        if self.kind is None:
            return NONE, (), NONE
        return self.kind, self.subjects, self.cause or NONE

    def names(self, alert: Dict[str, Any]) -> bool:
        return (
            self.kind in (ANY, alert["kind"])
            and alert["subject"] in self.subjects
            and self.cause in (ANY, alert["evidence"].get("cause"))
        )


def expects(
    kind: str, subject: Union[str, Sequence[str]], cause: str, *, also: Iterable[str] = ()
) -> Callable[[F], F]:
    """Declares a failure case's verdict on the test function (read by `judge` in its
    body and by test_corpus_table against the doc's table): `kind` on `subject` (or on
    each of several), with `cause`; `also` lists the kinds that may come with it."""
    subjects = (subject,) if isinstance(subject, str) else tuple(subject)
    declared = Expected(kind, subjects, cause, frozenset(also))
    return lambda function: _declare(function, declared)


def expects_silence(function: F) -> F:
    """Declares a healthy look-alike: no warning or critical alert."""
    return _declare(function, Expected(None))


def _declare(function: F, declared: Expected) -> F:
    function.expected = declared  # type: ignore[attr-defined]
    return function


def declaration(function: Callable[..., Any]) -> Expected:
    declared = getattr(function, "expected", None)
    if not isinstance(declared, Expected):
        raise AssertionError(
            f"{function.__name__} declares no verdict (@expects or @expects_silence)"
        )
    return declared


@dataclass(frozen=True)
class Progress:
    """What shows that a healthy run trained: `measure` went from `start` to `end`,
    better by at least the fraction `by` (lower is better unless `higher`)."""

    measure: str
    start: float
    end: float
    by: float = 0.0
    higher: bool = False

    def shown(self) -> bool:
        if self.higher:
            return self.end > self.start * (1 + self.by)
        return self.end < self.start * (1 - self.by)


def judge(
    request: Any,
    server: Any,
    run_id: str,
    *,
    steps: Optional[int] = None,
    progress: Optional[Progress] = None,
    wait: float = 2.0,
) -> Optional[Dict[str, Any]]:
    """Holds run `run_id` to what its test declared (`request` is the test's pytest
    request). A failure case: the declared alert on each declared subject, and nothing
    else serious but the `also` kinds; returns the first subject's alert. A look-alike
    (`steps` and `progress` required): the server stored every one of `steps` steps,
    training measurably progressed, and nothing serious was said. A verdict that does
    not hold fails through `pytest.fail` (what `not_caught`'s strict xfail expects);
    a broken PyTorch-side or delivery check through an assertion."""
    declared = declaration(request.function)
    if declared.silence:
        if steps is None or progress is None:
            raise TypeError("a look-alike's judge needs the run's `steps` and its `progress`")
        stored = server.run(run_id)["step_count"]
        assert stored == steps, f"the server stored {stored} of {steps} steps"
        assert progress.shown(), f"training did not measurably progress: {progress}"
        serious = server.serious(run_id)
        if serious:
            pytest.fail(f"false alarm: {described(serious)}")
        return None
    deadline = time.monotonic() + wait
    while True:
        serious = server.serious(run_id)
        found = {a["subject"]: a for a in serious if declared.names(a)}
        missing = [s for s in declared.subjects if s not in found]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if missing:
        pytest.fail(
            f"expected {declared.kind} on {missing} (cause {declared.cause}); "
            f"the server says {described(server.alerts(run_id))}"
        )
    others = [a for a in serious if not declared.names(a) and a["kind"] not in declared.also]
    if others:
        pytest.fail(f"besides {declared.kind} on {declared.subjects}, also {described(others)}")
    return found[declared.subjects[0]]
