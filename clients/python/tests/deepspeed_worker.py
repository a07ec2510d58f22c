"""One rank of a DeepSpeed ZeRO job, for tests/test_deepspeed.py: started by
``torchrun`` (CPU ranks, gloo, DeepSpeed's CPU accelerator), it trains
:class:`multirank_worker.Tiny` under ``deepspeed.initialize`` with ZeRO stage
``--stage`` and ``gradflow.watch(engine)`` on every rank, then writes what it was
(rank, run id) to ``--out``. Each step's global batch is the same 8 rows as in
tests/test_multirank.py; rank r trains on its share of them.

Faults on demand: ``--cut``: the block runs under ``torch.no_grad()`` inside the
model's forward (the graph is cut there: its parameters get no gradient);
``--nan-input STEP:RANK``: a NaN in that rank's batch (its embedded input) at that
step, which the reduction spreads to every rank's gradients.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

import deepspeed
import torch
from deepspeed.utils import safe_get_full_grad
from multirank_worker import LR, Tiny, _at, batch
from torch import nn

import gradflow

NAN = float("nan")


class Cut(Tiny):
    """Tiny with its block under ``torch.no_grad()``."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).mean(1)
        with torch.no_grad():
            cut = self.block(x)
        x = x + cut
        return self.out_norm(self.head(self.norm(x)))


def full_norms(model: nn.Module) -> Dict[str, float]:
    """Each module's gradient norm from DeepSpeed's full gradients
    (``safe_get_full_grad``: a collective per parameter, which the test may afford)."""
    sumsq: Dict[str, float] = defaultdict(float)
    for name, p in model.named_parameters():
        grad = safe_get_full_grad(p)
        sumsq[name.rpartition(".")[0]] += float(grad.double().square().sum())
    return {m: math.sqrt(s) for m, s in sumsq.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--name", default="zero")
    parser.add_argument("--out", required=True)
    parser.add_argument("--cut", action="store_true")
    parser.add_argument("--stuck-steps", type=int, default=0, help="stuck_zero_steps, if given")
    parser.add_argument("--nan-input", default="")
    parser.add_argument("--no-full-norms", action="store_true", help="for timing the loop")
    parser.add_argument("--watch", choices=["engine", "module", "bare"], default="engine")
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model: nn.Module = Cut() if args.cut else Tiny()
    config = {
        "train_micro_batch_size_per_gpu": 8 // world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    detectors = {"stuck_zero_steps": args.stuck_steps} if args.stuck_steps else None
    if args.watch == "engine":
        gf = gradflow.watch(engine, name=args.name, detectors=detectors)
    elif args.watch == "module":
        gf = gradflow.watch(engine.module, engine.optimizer, name=args.name, detectors=detectors)
    else:  # the engine's model alone: its gradients cannot be read
        gf = gradflow.watch(engine.module, name=args.name)
    nan_step, nan_rank = _at(args.nan_input)
    full: List[Dict[str, float]] = []
    started = time.perf_counter()
    for step in range(args.steps):
        tokens, target = batch(step, rank, world)
        poison = None
        if step == nan_step and rank == nan_rank:
            poison = engine.module.embed.register_forward_hook(lambda _m, _i, out: out * NAN)
        loss = nn.functional.cross_entropy(engine(tokens), target)
        if poison is not None:
            poison.remove()
        engine.backward(loss)
        if not args.no_full_norms:
            full.append(full_norms(engine.module))
        engine.step()
        gf.step(loss=loss)
    loop_s = time.perf_counter() - started
    run_id = gf.run_id
    gf.close()
    Path(args.out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "run_id": run_id,
                "enabled": gf.enabled,
                "full_norms": full,
                "loop_s": loop_s,
            }
        )
    )
    # Left to interpreter exit, the process group's threads can be torn down while
    # still joinable ("terminate called without an active exception", SIGABRT).
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
