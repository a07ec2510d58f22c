"""Multi-rank runs, as torchrun starts them: real processes (CPU, gloo), every rank
reporting its own record under DistributedDataParallel and FSDP2 (``fully_shard``).

With no server reachable every rank spools, so the records are read from the
per-rank spool files: the client's real format, exactly what it would have sent.
Combined as the server combines ranks (a sharded module's sums of squares added
over the ranks, a replicated one's taken from any rank: the copies must agree), they
must equal the gradient norms of the same model trained in one process on the same
data. Select these tests with ``-k multirank``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from conftest import free_port, new_run_id
from multirank_worker import LR, Tiny, batch
from torch import nn

WORKER = Path(__file__).with_name("multirank_worker.py")
NORMS = ("block.ln.weight", "norm.weight", "out_norm.weight")


def torchrun(
    nproc: int, tmp_path: Path, *args: str, server: Optional[str] = None, run_id: str = ""
) -> Tuple[str, List[Dict[str, Any]], float]:
    """Runs the worker on `nproc` ranks; returns its output (printed, so that pytest
    shows it when the test fails), what each rank wrote, and the wall time."""
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
    assert done.returncode == 0, output
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
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
        assert "step_time" not in recs[0], "the first step has no previous one"
        times = [r["step_time"] for r in recs[1:]]
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


def test_multirank_every_rank_registers_and_delivers_to_a_server(gradflow_server, tmp_path):
    """Against a real server: each rank PUTs the registration with its own rank and
    host (the server's 409 on those until it compares ranks' bodies without them is
    expected and not reported) and posts its own records."""
    run_id = new_run_id("mr-live")
    steps = 5
    output, ranks, _ = torchrun(
        2,
        tmp_path,
        "--wrap",
        "ddp",
        "--steps",
        str(steps),
        server=gradflow_server.url,
        run_id=run_id,
    )
    assert all(r["run_id"] == run_id for r in ranks)
    run = gradflow_server.run(run_id)
    assert run["world_size"] == 2 and run["rank"] in (0, 1)
    assert {p["layout"] for p in run["params"]} == {"replicated"}
    assert run["step_count"] == steps and run["last_step"] == steps - 1
    assert "different registration" not in output and "NOT delivered" not in output, output
    assert not (tmp_path / "spool").exists() or not list((tmp_path / "spool").glob("*.ndjson"))


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
