"""What the first pass over a model's parameters after backward costs the training
thread, and how much of it the optimizer would pay anyway.

    python clients/python/bench/cold_pass.py [--preset qwen2.5-0.5b-narrow] [--steps 200]

gradflow's optimizer pre-step hook reads every parameter's ``requires_grad``,
``dtype`` and ``.grad`` (C-level maps): the first code to touch the 290 tensors of
Qwen2.5-0.5B after backward has pushed them out of the caches. Without gradflow the
optimizer's own loop is that first pass. One bare model (no gradflow) trains here,
its steps alternating between ``optimizer.step()`` alone and the same three reads
right before it; each step's training-thread CPU (``time.thread_time``) of the reads
and of ``optimizer.step()`` is recorded, and the medians say what the reads cost and
what the optimizer saves after them: their net cost is the reads less that saving.
"""

from __future__ import annotations

import argparse
import operator
import statistics
import time
from typing import Dict, List

import torch
from overhead import PRESETS, Mode

_READS = (
    operator.attrgetter("requires_grad"),
    operator.attrgetter("dtype"),
    operator.attrgetter("grad"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-0.5b-narrow")
    parser.add_argument("--steps", type=int, default=200, help="measured steps of each kind")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=8)
    args = parser.parse_args()
    preset = dict(PRESETS[args.preset], batch=args.batch, seq=args.seq)
    mode = Mode("bare", preset, "cpu", torch.float32)
    params = list(mode.model.parameters())
    g = torch.Generator().manual_seed(1)
    vocab = preset["config"]["vocab_size"]
    figures: Dict[str, List[float]] = {"reads": [], "step after reads": [], "step alone": []}
    for i in range(2 * (args.warmup + args.steps)):
        tokens = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
        mode.optimizer.zero_grad(set_to_none=True)
        mode.loss(tokens).backward()
        with_reads = i % 2 == 0
        start = time.thread_time()
        if with_reads:
            for read in _READS:
                tuple(map(read, params))
        read_end = time.thread_time()
        mode.optimizer.step()
        end = time.thread_time()
        if i < 2 * args.warmup:
            continue
        if with_reads:
            figures["reads"].append(read_end - start)
            figures["step after reads"].append(end - read_end)
        else:
            figures["step alone"].append(end - read_end)
    med = {name: statistics.median(values) * 1e6 for name, values in figures.items()}
    saved = med["step alone"] - med["step after reads"]
    print(
        f"preset {args.preset}, {len(params)} parameter tensors, batch {args.batch}x{args.seq}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); medians of "
        f"{args.steps} steps of each kind, alternating"
    )
    for name, us in med.items():
        print(f"  {us:9.1f} us  {name}")
    print(f"  {saved:9.1f} us  optimizer.step() saved by the reads")
    print(f"  {med['reads'] - saved:9.1f} us  the reads' net cost")


if __name__ == "__main__":
    main()
