"""Multi-rank runs, as torchrun starts them: real processes (CPU, gloo), every rank
reporting its own record under DistributedDataParallel and FSDP2 (``fully_shard``).

With no server reachable every rank spools, so the records are read from the
per-rank spool files: the client's real format, exactly what it would have sent.
Combined as the server combines ranks (a sharded module's sums of squares added
over the ranks, a replicated one's taken from any rank: the copies must agree), they
must equal the gradient norms of the same model trained in one process on the same
data.

Against the real server, the run it combines from the ranks' records must equal the
single process too, and each of its multi-rank verdicts must come from a rank made
to fail (a NaN on one rank, a rank killed, a slow rank, a desynchronised replica, a
hand-written client reading shards as whole tensors), while healthy runs raise
nothing. Select these tests with ``-k multirank``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from conftest import ServerProcess, free_port, new_run_id
from multirank_worker import LR, Tiny, batch
from torch import nn

WORKER = Path(__file__).with_name("multirank_worker.py")
NORMS = ("block.ln.weight", "norm.weight", "out_norm.weight")


def torchrun(
    nproc: int,
    tmp_path: Path,
    *args: str,
    server: Optional[str] = None,
    run_id: str = "",
    fails: bool = False,
) -> Tuple[str, List[Dict[str, Any]], float]:
    """Runs the worker on `nproc` ranks; returns its output (printed, so that pytest
    shows it when the test fails), what each rank wrote, and the wall time. The job
    must succeed, or with `fails` fail (then the ranks that finished wrote theirs)."""
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADFLOW_")}
    env.update(
        GRADFLOW_SERVER=server or f"http://127.0.0.1:{free_port()}",  # none: every rank spools
        GRADFLOW_SPOOL_DIR=str(tmp_path / "spool"),
        GRADFLOW_CLOSE_TIMEOUT="1" if server is None else "15",
        OMP_NUM_THREADS="1",
    )
    if run_id:
        env["GRADFLOW_RUN_ID"] = run_id
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={nproc}", str(WORKER), "--out", str(out), *args]
    started = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    output = f"$ {' '.join(command)}\n{done.stdout}{done.stderr}"
    print(output)
    assert (done.returncode != 0) == fails, output
    written = [out / f"rank{r}.json" for r in range(nproc)]
    ranks = [json.loads(path.read_text()) for path in written if path.exists() or not fails]
    return output, ranks, took


def spooled(ranks: List[Dict[str, Any]]) -> Tuple[List[List[Dict]], List[Dict[str, Any]]]:
    """Each rank's spooled step records and the registration beside them."""
    records, registrations = [], []
    for info in ranks:
        path = Path(info["spool"])
        assert f".rank{info['rank']}." in path.name, "each rank spools to a file of its own"
        records.append([json.loads(line) for line in path.read_text().splitlines()])
        sidecar = json.loads(Path(str(path) + ".registration.json").read_text())
        assert sidecar["run_id"] == info["run_id"]
        registrations.append(sidecar["registration"])
    return records, registrations


def reference(steps: int) -> List[Dict[str, Any]]:
    """The same model trained in one process on the whole batches: per step the loss,
    each module's gradient norm and each norm weight's numbers, in f64."""
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    params = dict(model.named_parameters())
    init = {n: params[n].detach().double().clone() for n in NORMS}
    out = []
    for step in range(steps):
        tokens, target = batch(step)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(tokens), target)
        loss.backward()
        sumsq: Dict[str, float] = defaultdict(float)
        for name, p in params.items():
            sumsq[name.rpartition(".")[0]] += float(p.grad.double().square().sum())
        before = {n: params[n].detach().double().clone() for n in NORMS}
        grads = {n: float(params[n].grad.double().norm()) for n in NORMS}
        optimizer.step()
        norms = {}
        for n in NORMS:
            after = params[n].detach().double()
            norms[n] = {
                "grad_norm": grads[n],
                "update_norm": float((after - before[n]).norm()),
                "drift": float((after - init[n]).abs().max()),
                "mean": float(after.mean()),
                "numel": after.numel(),
            }
        modules = {m: math.sqrt(s) for m, s in sumsq.items()}
        numels = defaultdict(int)
        for name, p in params.items():
            numels[name.rpartition(".")[0]] += p.numel()
        out.append({"loss": loss.item(), "modules": modules, "numel": numels, "norms": norms})
    return out


def module_layouts(registration: Dict[str, Any]) -> Dict[str, Tuple[str, Optional[List[int]]]]:
    """Each module's layout and the ranks whose shards make it up (None: all), from
    its parameters' (one layout a module in these models)."""
    layouts: Dict[str, set] = defaultdict(set)
    for p in registration["params"]:
        holders = p.get("shard_ranks")
        layouts[p["module"]].add((p.get("layout", "replicated"), tuple(holders or ())))
    assert all(len(kinds) == 1 for kinds in layouts.values()), layouts
    out = {}
    for module, kinds in layouts.items():
        layout, holders = kinds.pop()
        out[module] = (layout, list(holders) or None)
    return out


def combine(
    records: List[List[Dict]], layouts: Dict[str, Tuple[str, Optional[List[int]]]], step: int
) -> Tuple[Dict[str, float], Dict[str, int], Dict[str, Dict[str, float]]]:
    """One step's records of every rank, combined as the server combines them:
    per module sqrt(Σ sumsq) over the ranks holding its shards when sharded, any
    rank's value when replicated (all ranks' must then be equal); per norm weight the
    same for its gradient and update, the largest drift and the numel-weighted mean."""
    at = [next(r for r in rank if r["step"] == step) for rank in records]

    def holding(module: str) -> List[Dict[str, Any]]:
        layout, holders = layouts[module]
        if layout != "sharded":
            return at[:1]
        return [at[r] for r in holders] if holders is not None else at

    norms, numels = {}, {}
    for module, (layout, _) in layouts.items():
        entries = [next(m for m in rec["modules"] if m["module"] == module) for rec in at]
        if layout != "sharded":
            assert len({e["grad_sumsq"] for e in entries}) == 1, (
                f"replicated {module} differs across ranks at step {step}: {entries}"
            )
        picked = [
            next(m for m in rec["modules"] if m["module"] == module) for rec in holding(module)
        ]
        # float(): a non-finite sum is spelled "NaN" or "Infinity"
        norms[module] = math.sqrt(sum(float(e["grad_sumsq"]) for e in picked))
        numels[module] = sum(e["numel"] for e in picked)
    weights = {}
    for name in NORMS:
        pick = [
            next(p for p in rec["params"] if p["name"] == name)
            for rec in holding(name.rpartition(".")[0])
        ]
        weights[name] = {
            "grad_norm": math.sqrt(sum(e["grad_norm"] ** 2 for e in pick)),
            "update_norm": math.sqrt(sum(e["update_norm"] ** 2 for e in pick)),
            "drift": max(e["drift"] for e in pick),
            "mean": sum(e["mean"] * e["numel"] for e in pick if e["numel"])
            / sum(e["numel"] for e in pick),
            "numel": sum(e["numel"] for e in pick),
        }
    return norms, numels, weights


def check_against_one_process(
    records: List[List[Dict]],
    registrations: List[Dict[str, Any]],
    steps: int,
    skip: Tuple[int, str] = (-1, ""),
) -> None:
    expected = reference(steps)
    layouts = module_layouts(registrations[0])
    for step in range(steps):
        norms, numels, weights = combine(records, layouts, step)
        want = expected[step]
        for module, norm in want["modules"].items():
            if (step, module) == skip:
                continue
            assert norms[module] == pytest.approx(norm, rel=1e-5), (step, module)
            assert numels[module] == want["numel"][module], (step, module)
        for name, numbers in want["norms"].items():
            got = weights[name]
            assert got["numel"] == numbers["numel"], (step, name)
            for key in ("grad_norm", "update_norm", "drift", "mean"):
                assert got[key] == pytest.approx(numbers[key], rel=1e-4), (step, name, key)
        losses = [next(r for r in rank if r["step"] == step)["loss"] for rank in records]
        assert sum(losses) / len(losses) == pytest.approx(want["loss"], rel=1e-5)


def check_records(records: List[List[Dict]], steps: int, world_size: int) -> None:
    """What every rank's records say of themselves: rank, steps, step times, local
    norms as the square roots of the local sums."""
    assert len(records) == world_size
    for rank, recs in enumerate(records):
        assert [r["step"] for r in recs] == list(range(steps))
        assert all(r["rank"] == rank for r in recs)
        # The first step's own work is timed from the first forward.
        times = [r["step_time"] for r in recs]
        assert all(0 < t < 30 for t in times), times
        for rec in recs:
            for m in rec["modules"]:
                if isinstance(m["grad_sumsq"], float):
                    assert m["grad_norm"] == pytest.approx(math.sqrt(m["grad_sumsq"]), rel=1e-12)
                    assert m["nonfinite"] == 0 and m["hook_hits"] == 1


def test_multirank_ddp_every_rank_reports_replicated_sums(tmp_path):
    steps = 5
    output, ranks, took = torchrun(2, tmp_path, "--wrap", "ddp", "--name", "mr-ddp")
    # torchrun's rendezvous id names the run, the same on both ranks, no collective.
    elastic = ranks[0]["elastic_id"]
    assert elastic and all(r["run_id"] == f"mr-ddp-{elastic}" for r in ranks), ranks
    records, registrations = spooled(ranks)
    for rank, registration in enumerate(registrations):
        assert (registration["rank"], registration["world_size"]) == (rank, 2)
        assert registration["host"]
        assert {p["layout"] for p in registration["params"]} == {"replicated"}
        assert all("shard_ranks" not in p for p in registration["params"])
        assert {p["name"]: p["shape"] for p in registration["params"]}["embed.weight"] == [13, 10]
    check_records(records, steps, 2)
    # After DDP's all-reduce both ranks hold the same gradients: equal sums, exactly.
    for step in range(steps):
        a, b = (rank[step] for rank in records)
        assert [m["grad_sumsq"] for m in a["modules"]] == [m["grad_sumsq"] for m in b["modules"]]
        assert [m["numel"] for m in a["modules"]] == [m["numel"] for m in b["modules"]]
        grads = [[p["grad_norm"] for p in rec["params"]] for rec in (a, b)]
        assert grads[0] == grads[1]
    check_against_one_process(records, registrations, steps)
    assert "NOT delivered: 5 still queued" in output
    print(f"DDP, 2 ranks: {took:.1f} s")


def test_multirank_fsdp2_shards_add_up_to_the_single_process_norms(tmp_path):
    steps = 5
    _, ranks, took = torchrun(2, tmp_path, "--wrap", "fsdp", "--name", "mr-fsdp")
    assert len({r["run_id"] for r in ranks}) == 1
    records, registrations = spooled(ranks)
    for rank, registration in enumerate(registrations):
        assert (registration["rank"], registration["world_size"]) == (rank, 2)
        assert {p["layout"] for p in registration["params"]} == {"sharded"}
        # Shapes are the whole tensors', not the shards'.
        shapes = {p["name"]: p["shape"] for p in registration["params"]}
        assert shapes["embed.weight"] == [13, 10] and shapes["head.bias"] == [5]
        assert [p for p in registration["params"] if p["name"] == "norm.weight"][0][
            "role"
        ] == "norm"
    check_records(records, steps, 2)
    # Each rank holds its own shard: the shards' elements add up to the tensors'.
    first = [rank[0] for rank in records]
    embed = [next(m for m in rec["modules"] if m["module"] == "embed") for rec in first]
    assert [e["numel"] for e in embed] == [70, 60]  # 13 rows of 10: 7 and 6
    assert embed[0]["grad_sumsq"] != embed[1]["grad_sumsq"]
    check_against_one_process(records, registrations, steps)
    print(f"FSDP2, 2 ranks: {took:.1f} s")


def test_multirank_fsdp2_on_four_ranks_with_an_empty_shard_and_a_nan(tmp_path):
    """Four ranks agree on a run id by broadcast (no torchrun id); a 5-element norm
    weight sharded 2, 2, 1, 0 leaves rank 3 an empty shard; on the last step rank 1's
    shard of the head's gradient holds a NaN, which only its record shows."""
    steps = 4
    nan_step, nan_rank = steps - 1, 1
    _, ranks, took = torchrun(
        4,
        tmp_path,
        *("--wrap", "fsdp", "--name", "mr-fsdp4", "--steps", str(steps)),
        *("--nan", f"{nan_step}:{nan_rank}", "--no-elastic-id"),
    )
    run_ids = {r["run_id"] for r in ranks}
    assert len(run_ids) == 1, ranks
    (run_id,) = run_ids
    assert run_id.startswith("mr-fsdp4-") and ranks[0]["elastic_id"] not in run_id
    records, registrations = spooled(ranks)
    assert [r["rank"] for r in registrations] == [0, 1, 2, 3]
    check_records(records, steps, 4)
    out_norm = [
        next(p for p in rank[0]["params"] if p["name"] == "out_norm.weight") for rank in records
    ]
    assert [p["numel"] for p in out_norm] == [2, 2, 1, 0]
    assert "mean" not in out_norm[3] and out_norm[3]["grad_norm"] == 0.0
    last = [rank[nan_step] for rank in records]
    heads = [next(m for m in rec["modules"] if m["module"] == "head") for rec in last]
    assert heads[nan_rank]["grad_sumsq"] == "NaN" and heads[nan_rank]["grad_norm"] == "NaN"
    assert "nonfinite" not in heads[nan_rank], "a non-finite sum does not say how many"
    for rank, head in enumerate(heads):
        if rank != nan_rank:
            assert isinstance(head["grad_sumsq"], float) and head["nonfinite"] == 0, head
    flagged = [rec["metrics"]["grad_nonfinite_modules"] for rec in last]
    assert flagged == [1.0 if r == nan_rank else 0.0 for r in range(4)]
    check_against_one_process(records, registrations, steps, skip=(nan_step, "head"))
    print(f"FSDP2, 4 ranks: {took:.1f} s")


def test_multirank_hsdp_counts_one_replica_s_shards(tmp_path):
    """HSDP on four ranks (2 replicas × 2 shards): parameters are sharded over one
    replica's ranks (shard_ranks [0, 1]); the other replica's ranks hold equal copies."""
    steps = 3
    _, ranks, took = torchrun(
        4, tmp_path, "--wrap", "hsdp", "--name", "mr-hsdp", "--steps", str(steps)
    )
    records, registrations = spooled(ranks)
    for registration in registrations:
        assert {(p["layout"], tuple(p["shard_ranks"])) for p in registration["params"]} == {
            ("sharded", (0, 1))
        }
    check_records(records, steps, 4)
    for step in range(steps):
        sums = [[m["grad_sumsq"] for m in rank[step]["modules"]] for rank in records]
        assert sums[0] == sums[2] and sums[1] == sums[3], "replicas hold the same shard"
        assert sums[0] != sums[1]
    check_against_one_process(records, registrations, steps)
    print(f"HSDP, 4 ranks: {took:.1f} s")


def test_multirank_rank_argument_keeps_one_rank_reporting_alone(gradflow_server, tmp_path):
    """rank=1: rank 1 alone reports, as a single view of the job (no world_size in
    its registration, no v1.4 field in its records); for a sharded model it declines."""
    run_id = new_run_id("mr-alone")
    output, ranks, _ = torchrun(
        2,
        tmp_path,
        *("--wrap", "ddp", "--steps", "3", "--report-rank", "1"),
        server=gradflow_server.url,
        run_id=run_id,
    )
    assert "rank 0: watching run None (NoopWatcher)" in output
    assert f"rank 1: watching run {run_id} (Watcher)" in output
    run = gradflow_server.run(run_id)
    assert "world_size" not in run and "rank" not in run
    assert run["config"]["reporting_rank"] == 1 and run["config"]["world_size"] == 2
    assert all("layout" not in p for p in run["params"])
    assert run["step_count"] == 3
    assert "rank 0: sharded model with rank=: NoopWatcher []" in output
    assert "rank 1: sharded model with rank=: NoopWatcher [" in output
    assert "leave rank= out so that every rank reports its shard" in output


# -- against the real server: the run it combines from the ranks, and its verdicts --

MODULES = ("embed", "block.up", "block.ln", "block.down", "norm", "head", "out_norm")
GROUPS = ("embed", "block", "norm", "head", "out_norm")


def served(
    server: ServerProcess, nproc: int, tmp_path: Path, stem: str, *args: str, fails: bool = False
) -> Tuple[str, str]:
    """Runs the worker on `nproc` ranks reporting to `server` under a new run id;
    returns the run id and the job's output."""
    run_id = new_run_id(stem)
    output, ranks, took = torchrun(
        nproc, tmp_path, *args, server=server.url, run_id=run_id, fails=fails
    )
    assert all(r["run_id"] == run_id for r in ranks), ranks
    print(f"{stem}, {nproc} ranks: {took:.1f} s")
    return run_id, output


def points(server: ServerProcess, run_id: str, metric: str, subject: str = "", rank=None):
    """A series as {step: value}."""
    return {step: value for step, value in server.series(run_id, metric, subject, rank)}


def check_server_against_one_process(
    server: ServerProcess, run_id: str, steps: int, world_size: int, sharded: bool
) -> float:
    """The run as the server combined its ranks: every module's gradient norm at every
    step equal to the single process's (rtol 1e-5) and the loss the ranks' mean of
    it; each rank's own series there, its copy equal to the combined value
    (replicated) or the ranks' adding up to it (sharded). Returns the largest
    relative difference from the single process seen."""
    expected = reference(steps)
    run = server.run(run_id)
    assert run["world_size"] == world_size
    assert (run["step_count"], run["last_step"]) == (steps, steps - 1), run
    worst = 0.0
    for module in MODULES:
        combined = points(server, run_id, "grad_norm", module)
        assert sorted(combined) == list(range(steps)), (module, combined)
        own = [points(server, run_id, "grad_norm", module, rank) for rank in range(world_size)]
        for step in range(steps):
            want = expected[step]["modules"][module]
            assert combined[step] == pytest.approx(want, rel=1e-5), (step, module)
            worst = max(worst, abs(combined[step] - want) / want)
            values = [rank[step] for rank in own]
            if sharded:
                total = math.sqrt(sum(v * v for v in values))
            else:
                assert len(set(values)) == 1, f"{module} at step {step}: copies {values}"
                total = values[0]
            assert total == pytest.approx(combined[step], rel=1e-6), (step, module, values)
    loss = points(server, run_id, "loss")
    assert [loss[s] for s in range(steps)] == pytest.approx([e["loss"] for e in expected], rel=1e-5)
    for rank in range(world_size):
        times = points(server, run_id, "step_time", rank=rank)
        assert sorted(times) == list(range(steps)), (rank, times)
        assert all(0 < t < 30 for t in times.values()), (rank, times)
    return worst


def check_healthy(server: ServerProcess, run_id: str, output: str) -> None:
    """No warning or critical alert; every rank registered and delivered everything."""
    alerts = server.alerts(run_id)
    assert [a for a in alerts if a["severity"] != "info"] == [], [
        (a["kind"], a["subject"], a["title"]) for a in alerts
    ]
    assert "different registration" not in output and "NOT delivered" not in output, output


def test_multirank_ddp_on_the_server_matches_one_process(gradflow_server, tmp_path):
    """DDP on 2 ranks, 12 steps (past the straggler detector's 10): the server's
    combined norms are the single process's, each rank's copy is there, and the healthy
    run raises nothing."""
    steps = 12
    run_id, output = served(
        gradflow_server, 2, tmp_path, "mr-ddp-live", "--wrap", "ddp", "--steps", str(steps)
    )
    worst = check_server_against_one_process(gradflow_server, run_id, steps, 2, sharded=False)
    check_healthy(gradflow_server, run_id, output)
    print(f"largest relative difference from one process: {worst:.1e}")


@pytest.mark.parametrize("nproc", [2, 4])
def test_multirank_fsdp2_on_the_server_matches_one_process(gradflow_server, tmp_path, nproc):
    """FSDP2 on 2 and 4 ranks (on 4, rank 3's shard of out_norm is empty): the server
    adds the ranks' shards up to the single process's norms; nothing is raised."""
    steps = 12
    run_id, output = served(
        gradflow_server, nproc, tmp_path, "mr-fsdp-live", "--wrap", "fsdp", "--steps", str(steps)
    )
    worst = check_server_against_one_process(gradflow_server, run_id, steps, nproc, sharded=True)
    check_healthy(gradflow_server, run_id, output)
    print(f"largest relative difference from one process: {worst:.1e}")


def test_multirank_a_nan_on_one_rank_names_that_rank(gradflow_server, tmp_path):
    """Rank 1's head gradient gets a NaN after the all-reduce at step 3: the server
    names rank 1, at step 3, and not rank 0 (to which the NaN spreads a step later)."""
    nan_step = 3
    run_id, _ = served(
        gradflow_server,
        2,
        tmp_path,
        "mr-nan-live",
        *("--wrap", "ddp", "--steps", "5", "--nan", f"{nan_step}:1"),
    )
    alert = gradflow_server.wait_for_alert(run_id, "rank_nonfinite", "rank 1")
    assert alert["first_step"] == nan_step, alert
    assert alert["evidence"]["rank"] == 1 and "head" in alert["evidence"]["subjects"], alert
    others = [a for a in gradflow_server.alerts(run_id) if a["kind"] == "rank_nonfinite"]
    assert [a["subject"] for a in others] == ["rank 1"], others
    own = [points(gradflow_server, run_id, "grad_norm", "head", rank) for rank in (0, 1)]
    assert isinstance(own[0][nan_step], float) and math.isfinite(own[0][nan_step]), own
    assert not isinstance(own[1][nan_step], float) or not math.isfinite(own[1][nan_step]), own


def test_multirank_a_killed_rank_goes_missing(tmp_path):
    """Rank 1's process dies a second after its backward pass of step 5, while rank 0
    waits in step 6's all-reduce (torchrun then stops rank 0): rank 0's record of
    step 5 reaches the server, which completes the step without rank 1 once its rank
    timeout (2 s here) has passed: rank_missing."""
    exit_step = 5
    server = ServerProcess(tmp_path / "gradflow.db", None, "--rank-timeout-secs", "2").start()
    try:
        run_id, output = served(
            server,
            2,
            tmp_path,
            "mr-killed",
            *("--wrap", "ddp", "--steps", "8", "--exit", f"{exit_step}:1"),
            fails=True,
        )
        assert f"rank 1: dying at step {exit_step}" in output
        alert = server.wait_for_alert(run_id, "rank_missing", "rank 1", timeout=20)
        first = points(server, run_id, "loss", rank=0)
        second = points(server, run_id, "loss", rank=1)
        assert exit_step in first, f"rank 0's step {exit_step} did not reach the server"
        assert max(second) < exit_step, second
        # The steps rank 1 never delivered are combined from rank 0's alone.
        assert alert["first_step"] == max(second) + 1, (alert, sorted(second))
        assert alert["evidence"]["last_step"] == max(second), alert
        assert server.run(run_id)["last_step"] == max(first), server.run(run_id)
        kinds = {(a["kind"], a["subject"]) for a in server.alerts(run_id)}
        assert ("rank_missing", "rank 0") not in kinds, kinds
    finally:
        server.stop()


def test_multirank_a_slow_rank_is_the_straggler(gradflow_server, tmp_path):
    """Rank 1 sleeps 0.1 s before every forward. Both ranks' wall-clock steps take as
    long (rank 0 waits at the all-reduce), but each rank's step_time is its own work:
    rank 1 is the straggler, rank 0 is not."""
    sleep = 0.1
    run_id, _ = served(
        gradflow_server,
        2,
        tmp_path,
        "mr-straggler",
        *("--wrap", "ddp", "--steps", "14", "--sleep", f"1:{sleep}"),
    )
    alert = gradflow_server.wait_for_alert(run_id, "rank_straggler", "rank 1")
    assert alert["evidence"]["rank"] == 1 and alert["evidence"]["ratio"] >= 1.5, alert
    kinds = {(a["kind"], a["subject"]) for a in gradflow_server.alerts(run_id)}
    assert ("rank_straggler", "rank 0") not in kinds, kinds
    fast = points(gradflow_server, run_id, "step_time", rank=0)
    slow = points(gradflow_server, run_id, "step_time", rank=1)
    # The first step is timed from the first forward, after rank 1's first sleep.
    assert all(slow[s] >= sleep for s in slow if s >= 1), slow
    assert sorted(fast.values())[len(fast) // 2] < sleep / 2, fast


def test_multirank_a_desynchronised_replica_diverges(gradflow_server, tmp_path):
    """From step 2 rank 1 scales its head gradient after the all-reduce: its replica
    of the head no longer matches rank 0's, on every step: replica_divergence."""
    desync_step = 2
    run_id, _ = served(
        gradflow_server,
        2,
        tmp_path,
        "mr-desync",
        *("--wrap", "ddp", "--steps", "6", "--desync", f"{desync_step}:1"),
    )
    alert = gradflow_server.wait_for_alert(run_id, "replica_divergence", "run")
    assert alert["first_step"] == desync_step, alert
    head = [
        s
        for s in alert["evidence"]["subjects"]
        if (s["subject"], s["series"]) == ("head", "grad_norm")
    ]
    assert head and (head[0]["min_rank"], head[0]["max_rank"]) == (0, 1), alert["evidence"]


def test_multirank_a_shard_reported_as_the_whole_is_caught(gradflow_server, tmp_path):
    """A hand-written client (not gradflow) under FSDP2 registers full shapes and no
    layout and posts each rank's local-shard norms: every group is flagged at step 0."""
    run_id, _ = served(
        gradflow_server,
        2,
        tmp_path,
        "mr-naive",
        *("--wrap", "fsdp", "--steps", "3", "--reporter", "naive"),
    )
    for group in GROUPS:
        alert = gradflow_server.wait_for_alert(run_id, "shard_reported_as_global", group)
        assert alert["first_step"] == 0, alert
    alert = gradflow_server.wait_for_alert(run_id, "shard_reported_as_global", "head")
    (head,) = [m for m in alert["evidence"]["modules"] if m["module"] == "head"]
    # 5×10 weight and 5 biases, split 3 rows and 2: 33 and 22 elements of 55.
    assert (head["registered_numel"], head["largest_rank_numel"]) == (55, 33), head
    assert head["sum_of_rank_numel"] == 55 and head["ranks"] == 2, head


def test_multirank_a_real_registration_conflict_is_said_on_every_rank(gradflow_server, tmp_path):
    """Every rank registers (the server compares bodies without rank and host), so a
    run registered before with a different body is a conflict each rank says; their
    steps are still sent to it."""
    run_id = new_run_id("mr-conflict")
    params = [{"name": n, "shape": list(p.shape)} for n, p in Tiny().named_parameters()]
    body = {"name": "another job", "world_size": 2, "params": params}
    request = urllib.request.Request(
        f"{gradflow_server.url}/api/v1/runs/{run_id}",
        data=json.dumps(body).encode(),
        method="PUT",
        headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(request, timeout=10).read()
    output, _, _ = torchrun(
        2, tmp_path, "--wrap", "ddp", "--steps", "3", server=gradflow_server.url, run_id=run_id
    )
    assert output.count("already exists with a different registration") == 2, output
    assert gradflow_server.run(run_id)["step_count"] == 3


@pytest.mark.parametrize(("nproc", "wrap"), [(2, "ddp"), (4, "ddp"), (2, "fsdp")])
def test_multirank_a_rank_that_stops_reporting_is_missing_when_the_job_ends(
    gradflow_server, tmp_path, nproc, wrap
):
    """Rank 1 trains on but stops calling gf.step after step 20; every rank closes at
    the end. The server's rank timeout is its default 60 s, yet rank 1's close (its
    finish names its rank, v1.5) completes the steps waiting for it at once:
    rank_missing on rank 1 from step 21, before the test has waited 60 s."""
    steps, stop_step = 26, 20
    run_id, output = served(
        gradflow_server,
        nproc,
        tmp_path,
        f"mr-stops-{wrap}",
        *("--wrap", wrap, "--steps", str(steps), "--stop-reporting", f"{stop_step}:1"),
    )
    ended = time.monotonic()
    alert = gradflow_server.wait_for_alert(run_id, "rank_missing", "rank 1", timeout=15)
    assert time.monotonic() - ended < 30, "completed by the close, not by the rank timeout"
    assert alert["first_step"] == stop_step + 1, alert
    evidence = alert["evidence"]
    assert evidence["last_step"] == stop_step and evidence["closed"] is True, alert
    assert evidence["ranks_reported"] == nproc - 1, alert
    run = gradflow_server.run(run_id)
    assert (run["last_step"], run["step_count"]) == (steps - 1, steps), run
    assert run["status"] == "finished", run
    kinds = {(a["kind"], a["subject"]) for a in gradflow_server.alerts(run_id)}
    missing = {subject for kind, subject in kinds if kind == "rank_missing"}
    assert missing == {"rank 1"}, kinds
    assert max(points(gradflow_server, run_id, "loss", rank=1)) == stop_step
    assert max(points(gradflow_server, run_id, "loss", rank=0)) == steps - 1
    ranks = gradflow_server.get(f"/api/v1/runs/{run_id}/ranks")["ranks"]
    assert "rank_missing" in ranks[1]["open_alerts"], ranks
    assert "NOT delivered" not in output, output


@pytest.mark.parametrize(("nproc", "wrap"), [(2, "ddp"), (4, "ddp"), (2, "fsdp")])
def test_multirank_a_nan_in_one_rank_s_batch_is_traced_to_its_loss(
    gradflow_server, tmp_path, nproc, wrap
):
    """A NaN enters rank 1's batch at step 10 under DDP (or FSDP2). Its gradients are
    NaN, and the all-reduce (reduce-scatter) spreads them to rank 0 before either rank's
    record is read, so both
    records' gradients are non-finite; only rank 1's own loss is. rank_nonfinite names
    rank 1 at step 10 from the losses, and rank 0 not at all."""
    nan_step, steps = 10, 12
    run_id, _ = served(
        gradflow_server,
        nproc,
        tmp_path,
        f"mr-nan-batch-{nproc}-{wrap}",
        *("--wrap", wrap, "--steps", str(steps), "--nan-input", f"{nan_step}:1"),
    )
    alert = gradflow_server.wait_for_alert(run_id, "rank_nonfinite", "rank 1")
    assert alert["first_step"] == nan_step, alert
    evidence = alert["evidence"]
    assert evidence["rank"] == 1 and evidence["origin"] == "loss", alert
    assert evidence["spread_to"] == [r for r in range(nproc) if r != 1], alert
    others = [a for a in gradflow_server.alerts(run_id) if a["kind"] == "rank_nonfinite"]
    assert [a["subject"] for a in others] == ["rank 1"], others

    def finite(value: Any) -> bool:
        return isinstance(value, float) and math.isfinite(value)

    loss = [points(gradflow_server, run_id, "loss", rank=rank) for rank in (0, 1)]
    assert finite(loss[0][nan_step]) and not finite(loss[1][nan_step]), loss
    head = [points(gradflow_server, run_id, "grad_norm", "head", rank) for rank in (0, 1)]
    assert not finite(head[0][nan_step]) and not finite(head[1][nan_step]), head
    assert all(finite(loss[r][s]) for r in (0, 1) for s in range(nan_step)), loss


@pytest.mark.parametrize("nproc", [2, 4])
def test_multirank_a_nan_born_in_one_rank_s_backward_is_traced_to_its_local_gradients(
    gradflow_server, tmp_path, nproc
):
    """Rank 1's batch at step 10 holds a duplicated sample, and the loss a square-root
    distance between samples (pytorch/pytorch#6394, lilanxiao/Rotated_IoU#20): exactly
    zero, so every rank's loss stays finite, while its gradient is NaN on rank 1 alone.
    DDP's all-reduce spreads it to every rank's gradients within the step. The ranks'
    own gradients, read before the all-reduce, name rank 1 (origin `local_grads`), and
    no other rank."""
    nan_step, steps = 10, 12
    run_id, _ = served(
        gradflow_server,
        nproc,
        tmp_path,
        f"mr-nan-backward-{nproc}",
        *("--wrap", "ddp", "--steps", str(steps), "--nan-backward", f"{nan_step}:1"),
    )
    alert = gradflow_server.wait_for_alert(run_id, "rank_nonfinite", "rank 1")
    assert alert["first_step"] == nan_step, alert
    evidence = alert["evidence"]
    assert evidence["origin"] == "local_grads", alert
    assert evidence["spread_to"] == [r for r in range(nproc) if r != 1], alert
    assert "backward" in alert["detail"] and "set_detect_anomaly" in alert["fix"], alert
    others = [a for a in gradflow_server.alerts(run_id) if a["kind"] == "rank_nonfinite"]
    assert [a["subject"] for a in others] == ["rank 1"], others

    def finite(value: Any) -> bool:
        return isinstance(value, float) and math.isfinite(value)

    # What the PyTorch side did: every loss finite, every rank's gradients NaN after
    # the all-reduce, and only rank 1's own gradients NaN before it.
    loss = [points(gradflow_server, run_id, "loss", rank=rank) for rank in range(nproc)]
    assert all(finite(loss[r][nan_step]) for r in range(nproc)), loss
    head = [points(gradflow_server, run_id, "grad_norm", "head", rank) for rank in (0, 1)]
    assert not finite(head[0][nan_step]) and not finite(head[1][nan_step]), head
    local = [
        points(gradflow_server, run_id, "local_grads_nonfinite", rank=rank) for rank in range(nproc)
    ]
    # Up to the step it was born on, rank 1 alone; after the optimizer stepped on the
    # NaN gradients, every rank's weights (so every rank's own gradients) are NaN.
    assert [sorted(s for s in flagged if s <= nan_step) for flagged in local] == [
        [nan_step] if r == 1 else [] for r in range(nproc)
    ], local
    assert all(nan_step + 1 in flagged for flagged in local), local


@pytest.mark.parametrize("nproc", [2, 4])
def test_multirank_replicas_whose_weights_drift_apart_diverge(gradflow_server, tmp_path, nproc):
    """From step 4 rank 1 nudges its head's weights after each optimizer step, outside
    the optimizer. The all-reduce still gives both ranks the same gradients, so the
    gradient norms agree; the weights' fingerprints (sent every 2 steps here) do not:
    replica_divergence on weights, naming the head and rank 1, and nothing on the
    gradients."""
    drift_step = 4
    run_id, _ = served(
        gradflow_server,
        nproc,
        tmp_path,
        f"mr-drift-{nproc}",
        *("--wrap", "ddp", "--steps", "10", "--updates-every", "2"),
        *("--drift", f"{drift_step}:1"),
    )
    alert = gradflow_server.wait_for_alert(run_id, "replica_divergence", "weights")
    assert alert["first_step"] == drift_step, alert
    evidence = alert["evidence"]
    assert evidence["series"] == "param_sum", alert
    assert [s["subject"] for s in evidence["subjects"]] == ["head"], alert
    kinds = {(a["kind"], a["subject"]) for a in gradflow_server.alerts(run_id)}
    assert ("replica_divergence", "run") not in kinds, kinds
    heads = [points(gradflow_server, run_id, "grad_norm", "head", rank) for rank in (0, 1)]
    assert heads[0] == heads[1], "the gradients stay all-reduced"
