"""What every case of the blind validation set shares.

A case rebuilds a training run from a public thread: a silent failure, or a healthy
run whose numbers look alarming. It trains through the quickstart API only
(``gradflow.watch``, ``gf.step(loss=...)`` once per optimizer step, ``gf.close()``),
proves on the PyTorch side that the failure happens (or that the healthy run
learned), checks that the server stored every step it was sent, and then reads the
verdict back from ``GET /api/v1/runs/{run_id}/alerts``. Only warning and critical
alerts count.

The expectations were written from the threads, the client README and the alert
table of docs/PROTOCOL.md before gradflow first ran on these cases.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set

import torch
from torch import nn

import gradflow

# Three seeds for every case: a verdict must not hang on one draw of the data.
SEEDS = (0, 1, 2)

SERIOUS = ("warning", "critical")


def dry() -> bool:
    """`GRADFLOW_VALIDATION_DRY=1`: check that the server stored every step, and read
    no verdict. A set is built and its harness checked end to end in this mode, so
    that nobody sees gradflow's verdicts on it before its expectations are committed."""
    return os.environ.get("GRADFLOW_VALIDATION_DRY") == "1"


# -- the PyTorch side ----------------------------------------------------------------


def snapshot(module: nn.Module) -> Dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def moved(before: Dict[str, torch.Tensor], module: nn.Module) -> Set[str]:
    """The parameters of `module` whose values differ from `before`."""
    now = dict(module.named_parameters())
    return {name for name, old in before.items() if not torch.equal(now[name].detach(), old)}


def tensors_equal(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, after))


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


# -- the quickstart ------------------------------------------------------------------


@dataclass
class Run:
    """One watched model of a case: its run id and how many times `gf.step` ran."""

    run_id: str
    steps: int = 0
    watcher: Any = None

    def step(self, loss: Any) -> None:
        self.watcher.step(loss=loss)
        self.steps += 1

    def close(self) -> None:
        self.watcher.close()


def watch(run_id: str, model: nn.Module, optimizer: Any = None, **options: Any) -> Run:
    """`gradflow.watch(model, optimizer, run_id=..., **options)`: the README's first
    line; the server comes from GRADFLOW_SERVER. In the dry mode (see `dry`) the
    client keeps its alerts to itself (`on_alert=None`) and its warnings are not
    shown, so that nothing of a verdict reaches the terminal."""
    if dry():
        options.setdefault("on_alert", None)
        warnings.simplefilter("ignore")
    return Run(run_id, watcher=gradflow.watch(model, optimizer, run_id=run_id, **options))


@dataclass
class Outcome:
    """What a case's training left behind: the runs it reported (by role, e.g.
    `generator`), and the facts the PyTorch-side checks read."""

    runs: Dict[str, Run]
    facts: Dict[str, Any] = field(default_factory=dict)


# -- the server side -----------------------------------------------------------------


def stored_every_step(server: Any, run: Run, timeout: float = 10.0) -> None:
    """The server holds every step the run reported: its step count and its loss
    series both have `run.steps` entries."""
    deadline = time.monotonic() + timeout
    while True:
        stored = server.run(run.run_id)
        if stored["step_count"] == run.steps or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert stored["step_count"] == run.steps, (
        f"{run.run_id}: the client reported {run.steps} steps, the server stored "
        f"{stored['step_count']}"
    )
    series = server.get(
        f"/api/v1/runs/{run.run_id}/series?metric=loss&max_points={2 * run.steps + 10}"
    )
    assert not series["downsampled"]
    assert len(series["points"]) == run.steps, (
        f"{run.run_id}: {len(series['points'])} loss points for {run.steps} steps"
    )


def stored_all_steps(server: Any, outcome: Outcome) -> None:
    for run in outcome.runs.values():
        stored_every_step(server, run)


def serious_alerts(server: Any, run_id: str) -> List[Dict[str, Any]]:
    return [a for a in server.alerts(run_id) if a["severity"] in SERIOUS]


def described(alerts: Iterable[Dict[str, Any]]) -> List[Any]:
    return [(a["kind"], a["subject"], a["severity"], a["evidence"].get("cause")) for a in alerts]


def settled_alerts(server: Any, outcome: Outcome) -> Dict[str, List[Dict[str, Any]]]:
    """Every run's serious alerts once the server stored all of its steps (read twice,
    half a second apart, so that a verdict still on its way is not missed)."""
    stored_all_steps(server, outcome)
    time.sleep(0.5)
    return {role: serious_alerts(server, run.run_id) for role, run in outcome.runs.items()}


@dataclass(frozen=True)
class Diagnosis:
    """The verdict a failure case expects.

    - `run`: the role of the run that must carry it (a case may report several runs);
    - `kind`: the alert kind;
    - `causes`: the `evidence.cause` values that name the cause (PROTOCOL.md's), or
      `accepts_cause` when the rule is not a fixed list;
    - `covers`: subject prefixes: every alert of `kind` must name one of them, and each
      of them must be named by one such alert (the parts of the model that fail).
      Empty: the kind's subject is the run's own (e.g. `model`, `gradients`) and any
      subject in the expected run names the failing model.
    """

    run: str
    kind: str
    causes: Sequence[str] = ()
    covers: Sequence[str] = ()
    accepts_cause: Optional[Callable[[Optional[str]], bool]] = None

    def cause_ok(self, cause: Optional[str]) -> bool:
        if self.accepts_cause is not None:
            return self.accepts_cause(cause)
        return cause in self.causes


def assert_caught(server: Any, outcome: Outcome, expected: Diagnosis) -> None:
    """The failure's verdict: `expected.kind` on the right run, on the right parts,
    with the right cause, and no other warning or critical kind on any run of the
    case. The assertion message starts with the outcome ("missed", "wrong subject",
    "wrong cause", "also raised") and lists everything the server said. In the dry
    mode (see `dry`) it only checks that every step was stored."""
    if dry():
        stored_all_steps(server, outcome)
        return
    said = settled_alerts(server, outcome)
    everything = {role: described(alerts) for role, alerts in said.items()}
    found = [a for a in said[expected.run] if a["kind"] == expected.kind]
    assert found, (
        f"missed: no {expected.kind} on the {expected.run} run; the server said {everything}"
    )
    if expected.covers:
        strays = [
            a["subject"]
            for a in found
            if not any(a["subject"].startswith(part) for part in expected.covers)
        ]
        uncovered = [
            part
            for part in expected.covers
            if not any(a["subject"].startswith(part) for a in found)
        ]
        assert not strays and not uncovered, (
            f"wrong subject: {expected.kind} named {[a['subject'] for a in found]}, "
            f"expected {list(expected.covers)}; the server said {everything}"
        )
    causes = [a["evidence"].get("cause") for a in found]
    assert any(expected.cause_ok(c) for c in causes), (
        f"wrong cause: {expected.kind} gave {causes}, expected "
        f"{list(expected.causes) or 'see the case'}; the server said {everything}"
    )
    others = {
        role: described(a for a in alerts if a["kind"] != expected.kind)
        for role, alerts in said.items()
    }
    others = {role: alerts for role, alerts in others.items() if alerts}
    assert not others, f"also raised: {others}; the server said {everything}"


def assert_silent(server: Any, outcome: Outcome) -> None:
    """A healthy run: no warning or critical alert on any of its runs (info hints are
    allowed), once the server stored every step. In the dry mode (see `dry`) it only
    checks that every step was stored."""
    if dry():
        stored_all_steps(server, outcome)
        return
    said = settled_alerts(server, outcome)
    noisy = {role: described(alerts) for role, alerts in said.items() if alerts}
    assert not noisy, f"false alarm: {noisy}"
