"""What the client's per-parameter gradient norms cost on a GPU, against the memory
floor: one read of every gradient.

    python clients/python/bench/norms.py [--preset qwen2.5-0.5b] [--json FILE]

Builds the preset's model (random weights) on CUDA, runs one backward pass so every
parameter has a gradient, then times with CUDA events, interleaved and each the median
of ``--repeats``:

- ``client``: the client's own norm read (``gradflow.measurement.measure._norms``: one
  multi-tensor ``_foreach_norm`` over the gradients and a ``stack``), as
  ``measure_grads`` runs it at each optimizer step;
- ``floor``: one ``vector_norm`` over a single contiguous buffer holding as many
  elements of the same dtype: the time it takes to read those bytes once.

Both with f32 parameters (autocast training: f32 gradients) and with bf16 parameters.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import PRESETS  # noqa: E402

from gradflow.measurement.measure import _norms  # noqa: E402


def timed(fn: Callable[[], Any], repeats: int) -> List[float]:
    """Milliseconds of each call, by CUDA events around it."""
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def measure(preset: Dict[str, Any], dtype: torch.dtype, repeats: int) -> Dict[str, Any]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(max_position_embeddings=preset["seq"], **preset["config"])
    model = Qwen2ForCausalLM(config).to("cuda", dtype)
    tokens = torch.randint(0, config.vocab_size, (2, 128), device="cuda")
    model(tokens, labels=tokens).loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    elements = sum(g.numel() for g in grads)
    flat = torch.randn(elements, device="cuda", dtype=grads[0].dtype)
    variants = {
        "client": lambda: _norms(grads),
        "floor": lambda: torch.linalg.vector_norm(flat),
    }
    for fn in variants.values():  # warm-up: kernels loaded, allocator settled
        timed(fn, 5)
    samples: Dict[str, List[float]] = {name: [] for name in variants}
    for _ in range(repeats // 10):
        for name, fn in variants.items():
            samples[name].extend(timed(fn, 10))
    medians = {name: statistics.median(xs) for name, xs in samples.items()}
    nbytes = elements * grads[0].element_size()
    result = {
        "param_dtype": str(dtype).removeprefix("torch."),
        "tensors": len(grads),
        "elements": elements,
        "gradient_bytes": nbytes,
        "client_ms": medians["client"],
        "floor_ms": medians["floor"],
        "client_over_floor": medians["client"] / medians["floor"],
        "client_gb_per_s": nbytes / medians["client"] / 1e6,
        "floor_gb_per_s": nbytes / medians["floor"] / 1e6,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-0.5b")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("norms.py measures a GPU: no CUDA device is visible")
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        results.append(measure(PRESETS[args.preset], dtype, args.repeats))
        torch.cuda.empty_cache()  # the first model's memory, back before the second
    print(f"{args.preset} on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for r in results:
        print(
            f"  {r['param_dtype']:8s} {r['tensors']} gradients, {r['gradient_bytes'] / 1e9:.2f} GB:"
            f" client {r['client_ms']:.3f} ms ({r['client_gb_per_s']:.0f} GB/s),"
            f" one read {r['floor_ms']:.3f} ms ({r['floor_gb_per_s']:.0f} GB/s),"
            f" {r['client_over_floor']:.2f}x the floor"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
