"""DeepSpeed ZeRO stages 1, 2 and 3, as torchrun starts them: two real processes (CPU
ranks, gloo, DeepSpeed's CPU accelerator) training under ``deepspeed.initialize``
with ``gradflow.watch(engine)`` on every rank, against the real server.

Each rank reports its partition of the averaged gradients (read through DeepSpeed,
see :mod:`gradflow.capture.zero`); the server adds the partitions up, so the combined module
norms must equal the same model trained in one process on the same data. A healthy
run raises nothing; in one job per stage, a module run under ``torch.no_grad()``
inside forward is ``grad_stuck_zero`` and a NaN in one rank's batch is traced to that
rank's loss. Select
these tests with ``-k deepspeed``; they are skipped only when DeepSpeed cannot be
imported.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import urllib.error
from pathlib import Path
from typing import Any, Dict, List

import pytest
from conftest import ServerProcess, new_run_id
from test_multirank import MODULES, check_healthy, points, reference

WORKER = Path(__file__).with_name("deepspeed_worker.py")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed (scripts/python-tests.sh installs it)",
)


def zero_run(
    server: ServerProcess, tmp_path: Path, stage: int, stem: str, *args: str
) -> tuple[str, str, List[Dict[str, Any]]]:
    """Runs the worker on 2 ranks under ZeRO `stage`, reporting to `server`; returns the
    run id, the job's output and what each rank wrote."""
    run_id = new_run_id(stem)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADFLOW_")}
    env.update(
        GRADFLOW_SERVER=server.url,
        GRADFLOW_RUN_ID=run_id,
        GRADFLOW_SPOOL_DIR=str(tmp_path / "spool"),
        GRADFLOW_CLOSE_TIMEOUT="15",
        OMP_NUM_THREADS="1",
        # DeepSpeed's CPU accelerator builds its shared-memory op with ninja, found
        # beside this interpreter.
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2", str(WORKER), "--out", str(out), "--stage", str(stage)]
    command += list(args)
    started = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    output = f"$ {' '.join(command)}\n{done.stdout}{done.stderr}"
    print(output)
    print(f"{stem}: {time.monotonic() - started:.1f} s")
    assert done.returncode == 0, output
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    watched = "--watch" not in args or "bare" not in args
    assert all((r["run_id"] == run_id) == watched == r["enabled"] for r in ranks), ranks
    return run_id, output, ranks


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_matches_one_process_and_stays_silent(gradflow_server, tmp_path, stage):
    """ZeRO stage 1, 2 or 3 on 2 ranks, 12 steps: every module's combined gradient norm
    is the norm of DeepSpeed's own full gradient (``safe_get_full_grad``, read by the
    worker) at every step, and at the first step the single process's too (later
    steps drift apart by DeepSpeed's own arithmetic on flat buffers); the ranks'
    partitions add up to it, and the healthy run raises nothing."""
    steps = 12
    run_id, output, ranks = zero_run(gradflow_server, tmp_path, stage, f"zero{stage}")
    full = ranks[0]["full_norms"]
    assert full == ranks[1]["full_norms"]
    expected = reference(1)
    run = gradflow_server.run(run_id)
    assert run["world_size"] == 2 and run["step_count"] == steps, run
    for module in MODULES:
        combined = points(gradflow_server, run_id, "grad_norm", module)
        assert sorted(combined) == list(range(steps)), (module, combined)
        for step in range(steps):
            assert combined[step] == pytest.approx(full[step][module], rel=1e-5), (step, module)
        assert combined[0] == pytest.approx(expected[0]["modules"][module], rel=1e-5), module
        own = [points(gradflow_server, run_id, "grad_norm", module, rank) for rank in (0, 1)]
        for step in range(steps):
            total = math.sqrt(sum((o.get(step) or 0.0) ** 2 for o in own))
            assert total == pytest.approx(combined[step], rel=1e-5), (step, module, own)
    loss = points(gradflow_server, run_id, "loss")
    assert loss[0] == pytest.approx(expected[0]["loss"], rel=1e-5)
    check_healthy(gradflow_server, run_id, output)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_a_cut_graph_and_a_nan_in_one_rank_s_batch(gradflow_server, tmp_path, stage):
    """Two faults in one job (the engine given as its module and ZeRO optimizer here).
    The block runs under ``torch.no_grad()`` inside forward: DeepSpeed reduces zeros
    for its parameters, and after 10 steps (``stuck_zero_steps``) the server says
    grad_stuck_zero on the block, backward not reaching it, the cut named, and on
    nothing else. Then a NaN enters rank 1's batch at step 10: the reduction spreads
    it to both ranks' gradient partitions, and rank_nonfinite names rank 1 from its
    loss, not rank 0."""
    nan_step = 10
    run_id, _, _ = zero_run(
        gradflow_server,
        tmp_path,
        stage,
        f"zero{stage}-faults",
        *("--cut", "--stuck-steps", "10", "--watch", "module"),
        *("--steps", "12", "--nan-input", f"{nan_step}:1"),
    )
    alert = gradflow_server.wait_for_alert(run_id, "grad_stuck_zero", "block")
    assert alert["evidence"]["cause"] == "backward_not_reached", alert
    assert alert["first_step"] < nan_step, alert
    cut = alert["evidence"]["graph_cut"]
    assert cut["kind"] == "no_grad" and cut["module"] == "block", cut
    alert = gradflow_server.wait_for_alert(run_id, "rank_nonfinite", "rank 1")
    assert alert["first_step"] == nan_step, alert
    assert alert["evidence"]["rank"] == 1 and alert["evidence"]["origin"] == "loss", alert
    alerts = gradflow_server.alerts(run_id)
    stuck = [a["subject"] for a in alerts if a["kind"] == "grad_stuck_zero"]
    assert stuck == ["block"], stuck
    ranks = [a["subject"] for a in alerts if a["kind"] == "rank_nonfinite"]
    assert ranks == ["rank 1"], ranks


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_model_without_its_engine_is_not_watched(gradflow_server, tmp_path, stage):
    """The engine's model given alone (no engine, no ZeRO optimizer): its parameters'
    ``.grad`` is None at every step under ZeRO, which would read as gradients stuck at
    zero. ``watch`` says how to watch it instead, on every rank, and does not watch."""
    run_id, output, _ = zero_run(
        gradflow_server, tmp_path, stage, f"zero{stage}-bare", "--watch", "bare", "--steps", "3"
    )
    said = "gradient is held by DeepSpeed's optimizer: pass the engine"
    assert output.count(said) == 2, output
    with pytest.raises(urllib.error.HTTPError) as missing:
        gradflow_server.run(run_id)
    missing.value.close()
    assert missing.value.code == 404
