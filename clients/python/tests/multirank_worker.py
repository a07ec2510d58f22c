"""One rank of a multi-rank training job, for tests/test_multirank.py: started by
``torchrun`` (CPU, gloo), it trains a tiny model under DistributedDataParallel or
FSDP2 (``fully_shard``, also as HSDP) with ``gradflow.watch`` on every rank, then writes what it
was (rank, run id, spool) to ``--out``. The test trains the same model in one
process on the same data (``Tiny``, ``batch``) and compares.

Each step's global batch is the same 8 rows whatever the world size; rank r trains on
its contiguous share of them, so the averaged gradients are the single process's.

Faults on demand, one rank's own (``STEP:RANK``): a NaN in its gradient after the
all-reduce (``--nan``), its process killed after its backward pass (``--exit``), its
gradient scaled after the all-reduce from that step on, a desynchronised replica
(``--desync``); a NaN in its batch (its embedded input) at that step, which the
all-reduce spreads to every rank's gradients (``--nan-input``); a NaN born in its
backward pass alone, under a finite loss (``--nan-backward``: two identical samples
in its batch and a square-root distance between them, exactly zero, whose gradient
is not finite); its loop no longer
calling ``gf.step`` after that step while it goes on training and closes with the
others (``--stop-reporting``); its head's weights nudged after every optimizer step
from that step on, outside the optimizer, while the gradients stay all-reduced
(``--drift``); ``--sleep RANK:SECONDS`` makes a rank sleep before
every forward (a straggler). ``--reporter naive`` reports without gradflow, as a hand-written client
that reads each rank's local shard as the whole tensor would (:class:`NaiveReporter`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

VOCAB = 13
HIDDEN = 10
WIDE = 12
CLASSES = 5  # over 4 ranks, FSDP2 shards 5 rows as 2, 2, 1 and 0: an empty shard
ROWS = 8
LR = 1e-2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, WIDE)
        self.ln = nn.LayerNorm(WIDE)
        self.down = nn.Linear(WIDE, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.ln(self.up(x))))


class Tiny(nn.Module):
    """Embedding, a residual block with a LayerNorm, an RMSNorm, a head and a norm
    over the logits (5 elements: a shard of it is empty on one rank of four)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.block = Block()
        self.norm = nn.RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.out_norm = nn.LayerNorm(CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).mean(1)
        x = x + self.block(x)
        return self.out_norm(self.head(self.norm(x)))


def batch(step: int, rank: int = 0, world_size: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s share of step `step`'s global batch (all of it for one process)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (ROWS, 6), generator=g)
    target = torch.randint(0, CLASSES, (ROWS,), generator=g)
    share = ROWS // world_size
    rows = slice(rank * share, (rank + 1) * share)
    return tokens[rows], target[rows]


def _at(spec: Optional[str]) -> Tuple[int, int]:
    """``STEP:RANK`` as (step, rank); (-1, -1) when not given."""
    if not spec:
        return -1, -1
    step, rank = spec.split(":")
    return int(step), int(rank)


class NaiveReporter:
    """What a hand-written client would send from each rank under FSDP2: every
    parameter registered with its full shape (``p.shape``) and no layout, each rank's
    gradient norms taken of its local shard (``to_local()``) with their element
    counts, as if each shard were the whole tensor. A few lines of urllib, no
    gradflow."""

    def __init__(self, model: nn.Module, rank: int, world_size: int) -> None:
        self.url = f"{os.environ['GRADFLOW_SERVER']}/api/v1/runs/{os.environ['GRADFLOW_RUN_ID']}"
        self.run_id = os.environ["GRADFLOW_RUN_ID"]
        self.rank = rank
        self.params = list(model.named_parameters())
        body = {
            "name": "hand-written",
            "world_size": world_size,
            "rank": rank,
            "params": [{"name": n, "shape": list(p.shape)} for n, p in self.params],
        }
        self._send("PUT", "", body)

    def step(self, step: int, loss: float) -> None:
        modules: Dict[str, List[float]] = {}
        for name, p in self.params:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            entry = modules.setdefault(name.rpartition(".")[0], [0.0, 0])
            entry[0] += float(grad.double().square().sum())
            entry[1] += grad.numel()
        record = {
            "step": step,
            "rank": self.rank,
            "loss": loss,
            "modules": [
                {"module": m, "grad_norm": sq**0.5, "numel": n} for m, (sq, n) in modules.items()
            ],
        }
        self._send("POST", "/steps", [record])

    def _send(self, method: str, path: str, body: Any) -> None:
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            method=method,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()


def _nan_in_first_row(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    """A forward hook: the embedded batch with a NaN in its first sample, as a corrupt
    sample would bring."""
    output = output.clone()
    output[0, 0, 0] = float("nan")
    return output


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrap", choices=["ddp", "fsdp", "hsdp"], required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--name", default="multirank")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--nan", default=None, help="STEP:RANK: a NaN in that rank's head.weight gradient"
    )
    parser.add_argument(
        "--exit", default=None, help="STEP:RANK: that rank's process dies after its backward"
    )
    parser.add_argument(
        "--desync",
        default=None,
        help="STEP:RANK: from that step on, that rank scales its head.weight gradient by 1.1",
    )
    parser.add_argument(
        "--nan-input", default=None, help="STEP:RANK: a NaN in that rank's batch (embedded)"
    )
    parser.add_argument(
        "--nan-backward",
        default=None,
        help="STEP:RANK: a finite loss whose gradient is NaN on that rank (sqrt at zero)",
    )
    parser.add_argument(
        "--stop-reporting",
        default=None,
        help="STEP:RANK: after that step, that rank trains on without calling gf.step",
    )
    parser.add_argument(
        "--drift",
        default=None,
        help="STEP:RANK: from that step on, that rank adds 1e-3 to head.weight after each step",
    )
    parser.add_argument("--updates-every", type=int, default=10, help="updates_every= for watch")
    parser.add_argument(
        "--sleep", default=None, help="RANK:SECONDS: that rank sleeps before every forward"
    )
    parser.add_argument("--reporter", choices=["gradflow", "naive"], default="gradflow")
    parser.add_argument(
        "--report-rank", type=int, default=None, help="rank= for gradflow.watch: that rank alone"
    )
    parser.add_argument(
        "--no-elastic-id",
        action="store_true",
        help="hide torchrun's run id, so that the ranks agree on one by broadcast",
    )
    args = parser.parse_args()

    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = Tiny()
    if args.wrap == "ddp":
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if args.wrap == "hsdp":  # two replicas, each sharded over half the ranks
            shape = (2, world_size // 2)
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world_size,))
        fully_shard(model.block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    if args.no_elastic_id:
        os.environ["TORCHELASTIC_RUN_ID"] = "none"  # what torchrun sets for a static rendezvous
    nan_step, nan_rank = _at(args.nan)
    exit_step, exit_rank = _at(args.exit)
    desync_step, desync_rank = _at(args.desync)
    nan_input_step, nan_input_rank = _at(args.nan_input)
    nan_backward_step, nan_backward_rank = _at(args.nan_backward)
    stop_step, stop_rank = _at(args.stop_reporting)
    drift_step, drift_rank = _at(args.drift)
    sleep_rank, sleep = (
        (int(args.sleep.split(":")[0]), float(args.sleep.split(":")[1]))
        if args.sleep
        else (-1, 0.0)
    )

    import gradflow

    if args.reporter == "naive":
        naive: Optional[NaiveReporter] = NaiveReporter(model, rank, world_size)
        gf: Any = gradflow.NoopWatcher()
        gf.run_id = naive.run_id
    else:
        naive = None
        gf = gradflow.watch(
            wrapped,
            optimizer,
            name=args.name,
            on_alert=None,
            rank=args.report_rank,
            updates_every=args.updates_every,
        )
    print(f"rank {rank}: watching run {gf.run_id} ({type(gf).__name__})", flush=True)
    for step in range(args.steps):
        if rank == sleep_rank:
            time.sleep(sleep)
        tokens, target = batch(step, rank, world_size)
        optimizer.zero_grad(set_to_none=True)
        corrupt = None
        if step == nan_input_step and rank == nan_input_rank:
            corrupt = model.embed.register_forward_hook(_nan_in_first_row)
        distance_at_zero = step == nan_backward_step and rank == nan_backward_rank
        if distance_at_zero:
            tokens = tokens.clone()
            tokens[1] = tokens[0]  # a duplicated sample
        out = wrapped(tokens)
        loss = nn.functional.cross_entropy(out, target)
        if distance_at_zero:
            # A distance term between samples (pytorch/pytorch#6394): sqrt of exactly
            # zero adds 0 to the loss and an infinite slope, which the chain rule
            # turns into NaN gradients on this rank only, before the all-reduce.
            rows = out.reshape(out.shape[0], -1)
            loss = loss + 1e-3 * torch.sqrt(((rows[0] - rows[1]) ** 2).sum())
        if corrupt is not None:
            corrupt.remove()
        loss.backward()
        head = model.head.weight.grad
        head = getattr(head, "_local_tensor", head)
        if step == nan_step and rank == nan_rank:
            head.view(-1)[0] = float("nan")
        if step >= desync_step >= 0 and rank == desync_rank:
            head.mul_(1.1)
        if step == exit_step and rank == exit_rank:
            print(f"rank {rank}: dying at step {step}", flush=True)
            # The other ranks finish this step and wait in the next one's all-reduce
            # before this process goes: torchrun stops them with SIGTERM at once when
            # it does, and a process stopped outright loses its last gathered
            # records (up to 0.2 s), which is the client's documented bound, not what
            # the server's rank timeout is tested on here.
            time.sleep(1.0)
            os._exit(1)
        optimizer.step()
        if step >= drift_step >= 0 and rank == drift_rank:
            with torch.no_grad():
                model.head.weight.add_(1e-3)
        if step > stop_step >= 0 and rank == stop_rank:
            continue  # trains on, reporting nothing
        gf.step(loss=loss)
        if naive is not None:
            naive.step(step, loss.item())
    gf.close()
    if args.report_rank is not None:
        # One rank alone cannot stand for a sharded model: watch says so and declines.
        import warnings

        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        sharded = Tiny()
        fully_shard(sharded, mesh=init_device_mesh("cpu", (world_size,)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            other = gradflow.watch(sharded, rank=args.report_rank)
        said = [str(w.message) for w in caught if w.category is gradflow.GradflowWarning]
        print(f"rank {rank}: sharded model with rank=: {type(other).__name__} {said}", flush=True)
    spool = getattr(getattr(gf, "reporter", None), "spool", None)
    Path(args.out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "world_size": world_size,
                "run_id": gf.run_id,
                "elastic_id": elastic,
                "spool": getattr(spool, "path", None),
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
