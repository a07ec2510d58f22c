"""What watching costs a training step: bare, with ``gradflow.watch``, and with
``wandb.watch(model, log="all", log_freq=1)`` in offline mode, side by side.

    python clients/python/bench/overhead.py [--device cpu|cuda]
        [--preset tiny|tiny-50ms|tiny-moe|cpu|qwen2.5-0.5b-narrow|qwen2.5-0.5b]
        [--profile FILE]

Each mode trains its own copy of the same model (same seed, same batches). The modes
take turns in rounds of ``--block`` steps, so a machine that slows down mid-run slows
every mode alike; after ``--warmup`` steps per mode, each step's wall time is recorded
(on CUDA, the benchmark synchronises at the end of each step to time it; the clients do
not). The report gives each mode's median step time and its overhead over bare, as
ratios of medians, and gradflow's fixed cost per step (its median less bare's). gradflow
reports to a real ``gradflow-server`` on a temporary database (``--server-bin``, default
target/release then target/debug).

Next to the wall time, each mode's training thread's own CPU time per step
(``time.thread_time()``, read before the benchmark waits for the device: the host's
work, which does not depend on the GPU and is not stretched when other processes share
the cores), split into the step's phases (forward and backward, where the model's hooks
run; ``optimizer.step()``, where the gradients and norm weights are read; ``gf.step``),
and the reporter thread's CPU per step (Linux, from ``/proc``).

The ``tiny`` presets are the client tests' model (``tests/tiny_models.py``: a 2-layer
Qwen2 of hidden 48 feeding an agent head, 33 parameter tensors), at batches meant for
a bare step of about 10 ms and about 50 ms on two CPU cores: at that size the
difference is gradflow's fixed work per step; ``qwen2.5-0.5b-narrow`` has Qwen2.5-0.5B's
290 parameter tensors at a narrow width, the per-tensor host work of the real model on
a CPU. ``--profile FILE`` also writes a cProfile of the gradflow mode's steps (the
training thread only) and prints gradflow's share of it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

REPO = Path(__file__).resolve().parents[3]

TESTS = REPO / "clients" / "python" / "tests"

PRESETS: Dict[str, Dict[str, Any]] = {
    # The client tests' tiny Qwen2 + agent model: a bare step of about 10 ms, and a
    # larger batch of the same model meant for about 50 ms (not calibrated on idle
    # cores), on two CPU cores.
    "tiny": dict(model="prompt-agent", batch=8, seq=12),
    "tiny-50ms": dict(model="prompt-agent", batch=64, seq=48),
    # A 2-layer Qwen2-MoE causal LM (8 experts, top-2, a shared expert): every family
    # of the instability signals has its modules here (eager attention, blocks, the
    # output head, the routers, the input embedding).
    "tiny-moe": dict(
        model="qwen2-moe",
        config=dict(
            vocab_size=256,
            hidden_size=48,
            intermediate_size=96,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_implementation="eager",
        ),
        batch=4,
        seq=16,
    ),
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
        elif preset.get("model") == "qwen2-moe":
            moe = Qwen2MoeConfig(max_position_embeddings=preset["seq"], **preset["config"])
            self.model = Qwen2MoeForCausalLM(moe).to(device, param_dtype)
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
        # The same split by phase: forward and backward, optimizer.step(), after it.
        self.phases: List[List[float]] = [[], [], []]
        self.background: Callable[[], Optional[float]] = lambda: None
        self.profile: Any = None
        self.parts: Optional[Breakdown] = None
        # Steps before this many are warm-up: not counted by the breakdown.
        self.warmup = 0
        self.counting = False

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.agent:
            logits = self.model(tokens)
            return torch.nn.functional.cross_entropy(logits.float(), tokens[:, 0] % ACTIONS)
        return self.model(input_ids=tokens, labels=tokens).loss

    def step(self, tokens: torch.Tensor) -> None:
        self.counting = len(self.times) >= self.warmup
        PassHooks.stepping = self
        if self.profile is not None:
            self.profile.enable()
        start = time.perf_counter()
        cpu = time.thread_time()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device, dtype=self.dtype, enabled=self.dtype != torch.float32):
            loss = self.loss(tokens)
        loss.backward()
        backward = time.thread_time()
        self.optimizer.step()
        stepped = time.thread_time()
        self.after_step(loss)
        # The host's own work on the step, read before the benchmark waits for the
        # device: a synchronisation spins on the CPU, which is no work of the step's.
        end = time.thread_time()
        self.cpu.append(end - cpu)
        for phase, seconds in zip(self.phases, (backward - cpu, stepped - backward, end - stepped)):
            phase.append(seconds)
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - start)
        if self.profile is not None:
            self.profile.disable()


# The agent's action count (tests/tiny_models.py).
ACTIONS = 8
# The phases of a step whose training-thread CPU is given apart.
PHASES = ("forward+backward", "optimizer.step", "after the step")


def mode_signals(name: str) -> Any:
    """The instability signals of a gradflow mode: ``gradflow`` the client's defaults,
    ``gradflow:none`` none, ``gradflow:FAMILY`` that family alone on every step,
    ``gradflow:all`` every family on every step."""
    from gradflow.measurement.signals import FAMILIES as families

    _, _, which = name.partition(":")
    if not which:
        return None
    if which == "none":
        return False
    if which == "all":
        return {f: 1 for f in families}
    if which not in families:
        sys.exit(f"unknown signal family {which!r} in mode {name!r}")
    return {f: 1 if f == which else 0 for f in families}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    parser.add_argument("--steps", type=int, default=120, help="measured steps per mode")
    parser.add_argument("--warmup", type=int, default=10, help="unmeasured steps per mode")
    parser.add_argument("--block", type=int, default=10, help="steps per mode per round")
    parser.add_argument(
        "--modes",
        default="bare,gradflow,wandb",
        help="comma-separated: bare, gradflow, gradflow:none|all|FAMILY, wandb, and bare:NAME "
        "(another unwatched copy: its difference from bare is the method's own resolution)",
    )
    parser.add_argument("--batch", type=int, help="the preset's batch size, overridden")
    parser.add_argument("--seq", type=int, help="the preset's sequence length, overridden")
    parser.add_argument("--profile", help="write a cProfile of the gradflow mode's steps here")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time gradflow's own entry points on the training thread (its optimizer "
        "hooks, gf.step, and the parts they call), in training-thread CPU per step",
    )
    parser.add_argument(
        "--breakdown-fine",
        action="store_true",
        help="--breakdown with the parts inside the parts timed too (each timing costs "
        "about 1 us of its own: not for the totals)",
    )
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
    parser.add_argument(
        "--pin",
        action="store_true",
        help="Linux: the training thread on the first CPU alone, every other thread of this "
        "process and the server's on the others (re-applied each round, as threads come and "
        "go): the training thread's CPU time then holds its own work, not the time it loses "
        "to other threads sharing its core and caches",
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
        if name == "gradflow" or name.startswith("gradflow:"):
            import gradflow

            if server is None:
                server, url = start_server(server_binary(args.server_bin), workdir)
                # The run whose stored steps are checked at the end: the first watched.
                checked_run = f"bench-overhead-{len(modes)}"
            if args.breakdown or args.breakdown_fine:
                PassHooks.install()
            gf = gradflow.watch(
                mode.model,
                mode.optimizer,
                server=url,
                run_id=f"bench-overhead-{len(modes)}",
                on_alert=None,
                every=args.every,
                signals=mode_signals(name),
            )
            mode.after_step = lambda loss, gf=gf: gf.step(loss=loss)
            mode.close = gf.close
            mode.background = thread_cpu(getattr(gf, "reporter", None))
            if args.breakdown or args.breakdown_fine:
                mode.parts = Breakdown(gf, mode, fine=args.breakdown_fine)
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
        elif name != "bare" and not name.startswith("bare:"):
            sys.exit(f"unknown mode {name!r}")
        mode.warmup = args.warmup
        modes.append(mode)

    g = torch.Generator().manual_seed(1)
    vocab = 64 if preset.get("model") == "prompt-agent" else preset["config"]["vocab_size"]
    total = args.warmup + args.steps
    done = 0
    # The CPUs the process may use, read before any thread is pinned.
    allowed = sorted(os.sched_getaffinity(0)) if args.pin else []
    while done < total:
        if args.pin:
            pin_threads(allowed, server)
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
    stored = None
    if server is not None:
        probe = "agent.head" if preset.get("model") == "prompt-agent" else "model.norm"
        stored = stored_steps(url, checked_run, probe)
        server.terminate()
        server.wait()

    medians = {m.name: statistics.median(m.times[args.warmup :]) for m in modes}
    # The mean also carries the work done only every few steps (the low-precision
    # update check runs every `updates_every`-th step), which the median skips.
    means = {m.name: statistics.fmean(m.times[args.warmup :]) for m in modes}
    cpu = {m.name: statistics.median(m.cpu[args.warmup :]) for m in modes}
    cpu_means = {m.name: statistics.fmean(m.cpu[args.warmup :]) for m in modes}
    bare = medians.get("bare")
    by_name = {m.name: m for m in modes}
    device_name = (
        torch.cuda.get_device_name() if args.device == "cuda" else f"cpu x{torch.get_num_threads()}"
    )
    print(
        f"preset {preset_name}, {args.device} ({device_name}), autocast {autocast}, "
        f"parameters {args.param_dtype}, GIL switch interval {sys.getswitchinterval() * 1e3:g} ms, "
        f"batch {preset['batch']}x{preset['seq']}, torch {torch.__version__}; "
        + (f"training thread alone on CPU {allowed[0]}; " if len(allowed) > 1 else "")
        + f"median of {args.steps} steps after {args.warmup} warm-up, rounds of {args.block}"
    )
    result: Dict[str, Any] = {
        "preset": preset_name,
        "device": device_name,
        "batch": preset["batch"],
        "seq": preset["seq"],
        "param_dtype": args.param_dtype,
        "autocast": autocast,
        "modes": {},
        "pinned": len(allowed) > 1,
    }
    for mode in modes:
        median = medians[mode.name]
        line = f"  {mode.name:9s} {median * 1e3:9.2f} ms/step"
        line += f" (thread CPU {cpu[mode.name] * 1e3:.2f} ms)"
        entry: Dict[str, Any] = {
            "median_ms": median * 1e3,
            "mean_ms": means[mode.name] * 1e3,
            "thread_cpu_ms": cpu[mode.name] * 1e3,
            "thread_cpu_mean_ms": cpu_means[mode.name] * 1e3,
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
            entry["thread_cpu_fixed_mean_ms"] = (cpu_means[mode.name] - cpu_means["bare"]) * 1e3
            phases = [
                (
                    statistics.median(mine[args.warmup :])
                    - statistics.median(bare_phase[args.warmup :])
                )
                * 1e3
                for mine, bare_phase in zip(mode.phases, by_name["bare"].phases)
            ]
            entry["thread_cpu_fixed_by_phase_ms"] = dict(zip(PHASES, phases))
            line += (
                f"; training thread CPU {entry['thread_cpu_fixed_ms']:+.2f} ms/step"
                f" (mean {entry['thread_cpu_fixed_mean_ms']:+.2f};"
                + ",".join(f" {name} {ms:+.2f}" for name, ms in zip(PHASES, phases))
                + ")"
            )
        seconds = background.get(mode.name)
        if seconds is not None:
            per_step = seconds / len(mode.times) * 1e3
            entry["background_cpu_ms"] = per_step
            line += f"; its reporter thread {per_step:.3f} ms CPU/step"
        result["modes"][mode.name] = entry
        print(line)
    if stored is not None:
        # What reached the server: a measuring path that failed would still be timed.
        result["stored"] = stored
        print(
            f"  the server stored {stored['steps']} of gradflow's {total} steps, "
            f"{stored['module_grad_norms']} of them with a gradient norm for {probe}"
        )
    gf_over = result["modes"].get("gradflow", {}).get("overhead")
    wb_over = result["modes"].get("wandb", {}).get("overhead")
    if gf_over is not None and wb_over is not None and gf_over > 0:
        print(f"  wandb.watch's overhead is {wb_over / gf_over:.1f}x gradflow's")
    for mode in modes:
        if mode.profile is not None:
            report_profile(mode.profile, args.profile, len(mode.times))
        if mode.parts is not None:
            result["breakdown_us"] = mode.parts.report(args.steps)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def stored_steps(url: str, run_id: str, module: str) -> Optional[Dict[str, int]]:
    """How many steps of the run the server stored, and in how many of them `module`
    has a finite gradient norm (None when the server cannot say)."""
    import math
    import urllib.request

    def get(path: str) -> Any:
        with urllib.request.urlopen(url + path, timeout=10) as response:
            return json.loads(response.read())

    try:
        run = get(f"/api/v1/runs/{run_id}")
        points = get(f"/api/v1/runs/{run_id}/series?metric=grad_norm&subject={module}")["points"]
    except Exception:
        return None
    finite = [v for _, v in points if isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
    return {"steps": int(run["step_count"]), "module_grad_norms": len(finite)}


def pin_threads(cpus: List[int], server: Optional[subprocess.Popen[str]]) -> None:
    """Puts this thread on the first of `cpus` alone and every other thread of this
    process and of the server on the rest (Linux). Threads started later inherit their
    creator's CPUs, so this is called again at every round."""
    if len(cpus) < 2:
        return
    mine, rest = {cpus[0]}, set(cpus[1:])
    me = threading.get_native_id()
    pids = [os.getpid()] + ([server.pid] if server is not None else [])
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            tid = int(task.name)
            with contextlib.suppress(OSError):  # the thread ended meanwhile
                os.sched_setaffinity(tid, mine if tid == me else rest)


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


def thread_timed(fn: Callable[..., Any], record: Callable[[float], None]) -> Callable[..., Any]:
    """`fn`, with the training-thread CPU seconds of each call handed to `record`."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            record(time.thread_time() - start)

    return timed


class PassHooks:
    """Times the hooks gradflow registers on the model and its tensors, which run inside
    the forward and backward passes: each hook whose function is gradflow's is wrapped
    when it is registered (and re-registered: some are put back every step), and its
    training-thread CPU goes to the breakdown of the mode being stepped. The attention
    capture's own work on the calls it intercepts is timed the same way; the calls it
    passes through are counted, each at the mode's dispatch cost measured on a small op
    (an estimate). Each timing costs ~0.7 us of its own, part of it counted: the calls
    a step are given beside the times."""

    stepping: Optional[Mode] = None
    installed = False

    @classmethod
    def install(cls) -> None:
        if cls.installed:
            return
        cls.installed = True
        module_hooks = (
            ("register_forward_pre_hook", "forward hooks"),
            ("register_forward_hook", "forward hooks"),
            ("register_full_backward_pre_hook", "backward hooks"),
            ("register_full_backward_hook", "backward hooks"),
        )
        for name, label in module_hooks:
            cls._wrap_registration(torch.nn.Module, name, label)
        for name in ("register_hook", "register_post_accumulate_grad_hook"):
            cls._wrap_registration(torch.Tensor, name, "backward hooks")
        from gradflow.capture.attention_stats import AttentionCapture

        for name in ("_softmax", "_sdpa"):
            setattr(
                AttentionCapture,
                name,
                cls._timed(getattr(AttentionCapture, name), "attention capture"),
            )
        passing = AttentionCapture.__torch_function__
        dispatch = cls._dispatch_cost(AttentionCapture)

        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            cls._add("attention capture, calls passed through (estimated)", dispatch)
            return passing(self, *args, **kwargs)

        AttentionCapture.__torch_function__ = counted  # type: ignore[method-assign]

    @staticmethod
    def _dispatch_cost(capture: Any) -> float:
        """What the attention capture's mode adds to a torch call it passes through,
        in training-thread CPU seconds: a small op timed inside the mode and outside,
        the median of five tries."""
        x = torch.zeros(8)

        def run(calls: int = 4000) -> float:
            start = time.thread_time()
            for _ in range(calls):
                torch.add(x, 1.0)
            return (time.thread_time() - start) / calls

        tries = []
        for _ in range(5):
            outside = run()
            with capture(lambda compute, device: None):
                inside = run()
            tries.append(inside - outside)
        return max(0.0, statistics.median(tries))

    @classmethod
    def _wrap_registration(cls, owner: Any, name: str, label: str) -> None:
        register = getattr(owner, name)

        def registering(self: Any, hook: Any, *args: Any, **kwargs: Any) -> Any:
            if str(getattr(hook, "__module__", "")).startswith("gradflow"):
                hook = cls._timed(hook, label)
            return register(self, hook, *args, **kwargs)

        setattr(owner, name, registering)

    @classmethod
    def _timed(cls, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        return thread_timed(fn, lambda spent: cls._add(label, spent))

    @classmethod
    def _add(cls, label: str, seconds: float) -> None:
        mode = cls.stepping
        if mode is not None and mode.parts is not None and mode.counting:
            mode.parts.add("inside forward and backward: " + label, seconds)


class Breakdown:
    """gradflow's own work on the training thread, by entry point: the optimizer's
    step hooks it registered and ``gf.step``, each timed whole (``time.thread_time``),
    the parts of them named in PARTS, and the hooks that run inside the forward and
    backward passes (:class:`PassHooks`). Counted after the warm-up steps only."""

    PARTS = (
        ("registry", "amendment", "registration check"),
        ("measurer", "measure_grads", "gradient read"),
        ("measurer", "snapshot_norms", "norm weights before the step"),
        ("measurer", "settle_grads", "gradient norms, taken alongside the step"),
        ("measurer", "after_step", "norm weights after the step"),
        ("updates", "before_step", "low-precision check, before"),
        ("updates", "after_step", "low-precision check, after"),
        ("hooks", "arm_carry_probe", "carry-over probe"),
        ("tracer", "take", "graph-cut tracer, step end"),
        ("measurer", "collect", "the step's record and vector"),
    )
    # Finer parts, with --breakdown=fine: each wrapped call costs ~1 µs of its own.
    FINE = (
        ("registry", "replaced", "  replaced parameters"),
        ("registry", "_live_signature", "  registration signature"),
        ("measurer", "_flat_norms", "  norm weights' flat copy"),
        ("measurer", "_intended_plans", "  intended update's inputs"),
        ("signals", "after_optimizer_step", "  signals after the step"),
        ("signals", "take", "  signals taken"),
        ("signals", "arm", "  signals armed"),
        ("registry", "lrs", "  learning rates"),
        ("hooks", "take_reached", "  hook hits taken"),
        ("hooks", "reset", "  hooks reset"),
        ("measurer", "reset", "  measurer reset"),
        ("", "_observe_shape", "  loop shape"),
        ("", "end_step", "  the step's end (instruments)"),
        ("@delivery", "submit", "  record handed to the reporter"),
        ("@_alerts", "deliver", "  alerts delivered"),
    )

    def __init__(self, gf: Any, mode: Mode, fine: bool = False) -> None:
        self.mode = mode
        self.seconds: Dict[str, float] = {}
        # Calls a step of the hooks timed inside the passes (PassHooks).
        self.calls: Dict[str, int] = {}
        instruments = gf.instruments
        optimizer = mode.optimizer
        for hooks, label in (
            (optimizer._optimizer_step_pre_hooks, "optimizer pre-step hook"),
            (optimizer._optimizer_step_post_hooks, "optimizer post-step hook"),
        ):
            for key, hook in list(hooks.items()):
                hooks[key] = self._timed(hook, label)
        for owner, name, label in self.PARTS + (self.FINE if fine else ()):
            # "": the instruments themselves; "@name": the watcher's own `name`.
            if owner.startswith("@"):
                target = getattr(gf, owner[1:], None)
            else:
                target = getattr(instruments, owner, None) if owner else instruments
            if target is not None and hasattr(target, name):
                setattr(target, name, self._timed(getattr(target, name), "  " + label))
        mode.after_step = self._timed(mode.after_step, "gf.step")

    def _timed(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        seconds, mode = self.seconds, self.mode

        def record(spent: float) -> None:
            if mode.counting:
                seconds[label] = seconds.get(label, 0.0) + spent

        return thread_timed(fn, record)

    def add(self, label: str, seconds: float) -> None:
        self.seconds[label] = self.seconds.get(label, 0.0) + seconds
        self.calls[label] = self.calls.get(label, 0) + 1

    def report(self, steps: int) -> Dict[str, float]:
        per_step = {label: s / steps * 1e6 for label, s in self.seconds.items()}
        print("gradflow's training-thread CPU by entry point, us a step (parts indented):")
        for label, us in per_step.items():
            calls = self.calls.get(label)
            print(f"  {us:9.1f}  {label}" + (f" ({calls / steps:.1f} calls)" if calls else ""))
        # Parts are indented under their entry point: only the entry points add up.
        total = sum(us for label, us in per_step.items() if not label.startswith(" "))
        print(f"  {total:9.1f}  in all (the entry points and the hooks inside the passes)")
        per_step["total"] = total
        return per_step


if __name__ == "__main__":
    main()
