"""What watching costs a training step: bare, with ``gradflow.watch``, and with
``wandb.watch(model, log="all", log_freq=1)`` in offline mode, side by side.

    python clients/python/bench/overhead.py [--device cpu|cuda]
        [--preset tiny|tiny-50ms|cpu|qwen2.5-0.5b-narrow|qwen2.5-0.5b] [--profile FILE]

Each mode trains its own copy of the same model (same seed, same batches). The modes
take turns in rounds of ``--block`` steps, so a machine that slows down mid-run slows
every mode alike; after ``--warmup`` steps per mode, each step's wall time is recorded
(on CUDA, the benchmark synchronises at the end of each step to time it; the clients do
not). The report gives each mode's median step time and its overhead over bare, as
ratios of medians, and gradflow's fixed cost per step (its median less bare's). gradflow
reports to a real ``gradflow-server`` on a temporary database (``--server-bin``, default
target/release then target/debug).

The ``tiny`` presets are the client tests' model (``tests/tiny_models.py``: a 2-layer
Qwen2 of hidden 48 feeding an agent head, 33 parameter tensors), at batches meant for
a bare step of about 10 ms and about 50 ms on two CPU cores: at that size the
difference is gradflow's fixed work per step. ``--profile FILE`` also writes a cProfile of the
gradflow mode's steps (the training thread only) and prints gradflow's share of it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

REPO = Path(__file__).resolve().parents[3]

TESTS = REPO / "clients" / "python" / "tests"

PRESETS: Dict[str, Dict[str, Any]] = {
    # The client tests' tiny Qwen2 + agent model: a bare step of about 10 ms, and a
    # larger batch of the same model meant for about 50 ms (not calibrated on idle
    # cores), on two CPU cores.
    "tiny": dict(model="prompt-agent", batch=8, seq=12),
    "tiny-50ms": dict(model="prompt-agent", batch=64, seq=48),
    # About 60-90 ms a step on two CPU cores: the client's CPU target is for a step of
    # at least 50 ms.
    "cpu": dict(
        config=dict(
            vocab_size=2048,
            hidden_size=256,
            intermediate_size=704,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
        ),
        batch=4,
        seq=128,
    ),
    # Qwen2.5-0.5B's shape, random weights.
    "qwen2.5-0.5b": dict(
        config=dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
        batch=8,
        seq=512,
    ),
}

# Qwen2.5-0.5B's module structure (24 layers: 290 parameter tensors, 219 modules) at a
# narrow width: the client's per-module and per-parameter host work at that count, on
# a CPU.
PRESETS["qwen2.5-0.5b-narrow"] = dict(
    config=dict(
        PRESETS["qwen2.5-0.5b"]["config"],
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=256,
        num_attention_heads=4,
    ),
    batch=4,
    seq=32,
)


def server_binary(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    for profile in ("release", "debug"):
        path = REPO / "target" / profile / "gradflow-server"
        if path.exists():
            return path
    sys.exit("gradflow-server not built: cargo build --release -p gradflow-server")


def start_server(binary: Path, workdir: Path) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [str(binary), "--listen", f"127.0.0.1:{port}", "--db", str(workdir / "bench.db")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    for line in process.stdout:
        if "gradflow-server listening" in line:
            break
    else:
        sys.exit("gradflow-server did not start")
    return process, f"http://127.0.0.1:{port}"


class Mode:
    """One copy of the model, its optimizer, and what watches it."""

    def __init__(
        self,
        name: str,
        preset: Dict[str, Any],
        device: str,
        dtype: torch.dtype,
        param_dtype: torch.dtype = torch.float32,
    ):
        torch.manual_seed(0)
        self.name = name
        self.agent = preset.get("model") == "prompt-agent"
        if self.agent:
            sys.path.insert(0, str(TESTS))
            from tiny_models import PromptAgent

            self.model: torch.nn.Module = PromptAgent(seed=0).to(device)
        else:
            config = Qwen2Config(max_position_embeddings=preset["seq"], **preset["config"])
            self.model = Qwen2ForCausalLM(config).to(device, param_dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.device = device
        self.dtype = dtype
        self.after_step: Callable[[torch.Tensor], None] = lambda loss: None
        self.close: Callable[[], None] = lambda: None
        self.times: List[float] = []
        # The training thread's own CPU time per step: unlike wall time, not
        # stretched when other processes share the cores.
        self.cpu: List[float] = []
        self.background: Callable[[], Optional[float]] = lambda: None
        self.profile: Any = None

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.agent:
            logits = self.model(tokens)
            return torch.nn.functional.cross_entropy(logits.float(), tokens[:, 0] % ACTIONS)
        return self.model(input_ids=tokens, labels=tokens).loss

    def step(self, tokens: torch.Tensor) -> None:
        if self.profile is not None:
            self.profile.enable()
        start = time.perf_counter()
        cpu = time.thread_time()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device, dtype=self.dtype, enabled=self.dtype != torch.float32):
            loss = self.loss(tokens)
        loss.backward()
        self.optimizer.step()
        self.after_step(loss)
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - start)
        self.cpu.append(time.thread_time() - cpu)
        if self.profile is not None:
            self.profile.disable()


# The agent's action count (tests/tiny_models.py).
ACTIONS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    parser.add_argument("--steps", type=int, default=120, help="measured steps per mode")
    parser.add_argument("--warmup", type=int, default=10, help="unmeasured steps per mode")
    parser.add_argument("--block", type=int, default=10, help="steps per mode per round")
    parser.add_argument("--modes", default="bare,gradflow,wandb")
    parser.add_argument("--batch", type=int, help="the preset's batch size, overridden")
    parser.add_argument("--seq", type=int, help="the preset's sequence length, overridden")
    parser.add_argument("--profile", help="write a cProfile of the gradflow mode's steps here")
    parser.add_argument("--autocast", choices=["none", "bf16"], default=None)
    parser.add_argument(
        "--param-dtype",
        choices=["f32", "bf16"],
        default="f32",
        help="the Qwen2 presets' parameters (bf16: pure bf16 training, no autocast needed)",
    )
    parser.add_argument("--server-bin")
    parser.add_argument(
        "--switch-interval",
        type=float,
        help="sys.setswitchinterval for the whole process (default: Python's 5 ms): how "
        "long the training thread can wait for the GIL while the reporter thread holds it",
    )
    parser.add_argument(
        "--every",
        type=int,
        default=1,
        help="gradflow.watch(every=K): measure and report every K-th step; the hooks still "
        "run on every step, so the median of the steps between separates their cost from "
        "the per-step measuring and reporting",
    )
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    preset_name = args.preset or ("qwen2.5-0.5b" if args.device == "cuda" else "cpu")
    preset = dict(PRESETS[preset_name])
    if args.batch:
        preset["batch"] = args.batch
    if args.seq:
        preset["seq"] = args.seq
    autocast = args.autocast or ("bf16" if args.device == "cuda" else "none")
    dtype = torch.bfloat16 if autocast == "bf16" else torch.float32
    names = [m for m in args.modes.split(",") if m]
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)

    workdir = Path(tempfile.mkdtemp(prefix="gradflow-bench-"))
    server = None
    modes: List[Mode] = []
    for name in names:
        param_dtype = torch.bfloat16 if args.param_dtype == "bf16" else torch.float32
        mode = Mode(name, preset, args.device, dtype, param_dtype)
        if name == "gradflow":
            import gradflow

            if server is None:
                server, url = start_server(server_binary(args.server_bin), workdir)
            gf = gradflow.watch(
                mode.model,
                mode.optimizer,
                server=url,
                run_id="bench-overhead",
                on_alert=None,
                every=args.every,
            )
            mode.after_step = lambda loss, gf=gf: gf.step(loss=loss)
            mode.close = gf.close
            mode.background = thread_cpu(getattr(gf, "reporter", None))
            if args.profile:
                import cProfile

                mode.profile = cProfile.Profile()
        elif name == "wandb":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            run = wandb.init(project="gradflow-bench", mode="offline", dir=str(workdir))
            wandb.watch(mode.model, log="all", log_freq=1)
            mode.after_step = lambda loss, run=run: run.log({"loss": loss.item()})
            mode.close = run.finish
        elif name != "bare":
            sys.exit(f"unknown mode {name!r}")
        modes.append(mode)

    g = torch.Generator().manual_seed(1)
    vocab = 64 if preset.get("model") == "prompt-agent" else preset["config"]["vocab_size"]
    total = args.warmup + args.steps
    done = 0
    while done < total:
        block = min(args.block, total - done)
        batches = [
            torch.randint(0, vocab, (preset["batch"], preset["seq"]), generator=g).to(args.device)
            for _ in range(block)
        ]
        for mode in modes:
            for tokens in batches:
                mode.step(tokens)
        done += block
    background = {m.name: m.background() for m in modes}
    for mode in modes:
        mode.close()
    if server is not None:
        server.terminate()
        server.wait()

    medians = {m.name: statistics.median(m.times[args.warmup :]) for m in modes}
    # The mean also carries the work done only every few steps (the low-precision
    # update check runs every `updates_every`-th step), which the median skips.
    means = {m.name: statistics.fmean(m.times[args.warmup :]) for m in modes}
    cpu = {m.name: statistics.median(m.cpu[args.warmup :]) for m in modes}
    bare = medians.get("bare")
    device_name = (
        torch.cuda.get_device_name() if args.device == "cuda" else f"cpu x{torch.get_num_threads()}"
    )
    print(
        f"preset {preset_name}, {args.device} ({device_name}), autocast {autocast}, "
        f"parameters {args.param_dtype}, GIL switch interval {sys.getswitchinterval() * 1e3:g} ms, "
        f"batch {preset['batch']}x{preset['seq']}, torch {torch.__version__}; "
        f"median of {args.steps} steps after {args.warmup} warm-up, rounds of {args.block}"
    )
    result: Dict[str, Any] = {
        "preset": preset_name,
        "device": device_name,
        "batch": preset["batch"],
        "seq": preset["seq"],
        "param_dtype": args.param_dtype,
        "autocast": autocast,
        "modes": {},
    }
    for mode in modes:
        median = medians[mode.name]
        line = f"  {mode.name:9s} {median * 1e3:9.2f} ms/step"
        line += f" (thread CPU {cpu[mode.name] * 1e3:.2f} ms)"
        entry: Dict[str, Any] = {
            "median_ms": median * 1e3,
            "mean_ms": means[mode.name] * 1e3,
            "thread_cpu_ms": cpu[mode.name] * 1e3,
        }
        if bare and mode.name != "bare":
            overhead = median / bare - 1
            entry["overhead"] = overhead
            entry["ratio"] = median / bare
            entry["fixed_ms"] = (median - bare) * 1e3
            line += (
                f"   {median / bare:.3f}x bare ({overhead * 100:+6.2f} %),"
                f" {(median - bare) * 1e3:+.2f} ms/step"
            )
            entry["mean_overhead"] = means[mode.name] / means["bare"] - 1
            line += f"; mean {entry['mean_overhead'] * 100:+.2f} %"
            entry["thread_cpu_fixed_ms"] = (cpu[mode.name] - cpu["bare"]) * 1e3
            line += f"; thread CPU {(cpu[mode.name] - cpu['bare']) * 1e3:+.2f} ms/step"
        seconds = background.get(mode.name)
        if seconds is not None:
            per_step = seconds / len(mode.times) * 1e3
            entry["background_cpu_ms"] = per_step
            line += f"; its reporter thread {per_step:.3f} ms CPU/step"
        result["modes"][mode.name] = entry
        print(line)
    gf_over = result["modes"].get("gradflow", {}).get("overhead")
    wb_over = result["modes"].get("wandb", {}).get("overhead")
    if gf_over is not None and wb_over is not None and gf_over > 0:
        print(f"  wandb.watch's overhead is {wb_over / gf_over:.1f}x gradflow's")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    for mode in modes:
        if mode.profile is not None:
            report_profile(mode.profile, args.profile, len(mode.times))


def thread_cpu(reporter: Any) -> Callable[[], Optional[float]]:
    """The CPU seconds the reporter thread has used so far (Linux), read later."""
    thread = getattr(reporter, "_thread", None)
    native = getattr(thread, "native_id", None)

    def read() -> Optional[float]:
        try:
            fields = Path(f"/proc/self/task/{native}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    return read


def report_profile(profile: Any, path: str, steps: int) -> None:
    """Writes the profile and prints gradflow's own functions by time per step."""
    import pstats

    profile.dump_stats(path)
    stats = pstats.Stats(profile)
    raw: Dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    import gradflow

    package = str(Path(gradflow.__file__).parent)
    rows = []
    for (file, line, func), (_cc, calls, tottime, cumtime, _callers) in raw.items():
        if file.startswith(package):
            rows.append((cumtime, tottime, calls, f"{Path(file).name}:{line}({func})"))
    rows.sort(reverse=True)
    print(f"profile of {steps} gradflow steps in {path}; gradflow's functions, per step:")
    print(f"  {'cumulative':>10s} {'own':>8s} {'calls':>7s}")
    for cum, own, calls, name in rows[:30]:
        per_step = f"{cum / steps * 1e3:8.3f}ms {own / steps * 1e3:6.3f}ms {calls / steps:7.1f}"
        print(f"  {per_step} {name}")


if __name__ == "__main__":
    main()
