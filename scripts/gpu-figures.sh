#!/usr/bin/env bash
# The figures only a GPU gives (BENCHMARKS.md, "On a GPU"), in one run:
#
#   1. the Python client over a bare loop, Qwen2.5-0.5B shape, 8×512 tokens, bf16
#      autocast over f32 parameters and pure bf16 parameters (and 8×2048), side by
#      side in one process;
#   2. the client's per-parameter gradient norms against one read of the gradients;
#   3. the Rust trainer's instrumentation on CUDA, instrumented and uninstrumented
#      trainers stepped alternately in one process, reporting to a real server and not,
#      and the attention statistics' own cost (a third trainer without them);
#   4. the trainer's failure scenarios on CUDA, each verdict as the server gives it;
#   5. the GPU's NVML readings as the server stored them, from a real CUDA run;
#   6. the Python client's instability signals, each family alone on every step, at
#      Qwen2.5-0.5B's shape and on a small Qwen2-MoE (the routers' family);
#   0. the fused gradient-sums kernel against the per-tensor sums
#      (`gradflow-trainer --check-grad-sums`).
#
#   scripts/gpu-figures.sh OUT_DIR
#
# PARTS picks some of the parts (default: "0 1 2 3 4 5 6"), CLIENT_CASES the client's
# cases ("TOKENS PARAM_DTYPE GIL_SWITCH_INTERVAL [EVERY]", comma-separated; EVERY is
# gradflow.watch's every=, default 1), CLIENT_FLAGS more flags of overhead.py for
# those cases (e.g. --breakdown), GRAD_SUMS the trainer's --grad-sums choices
# measured beside its default (space-separated, default "per-tensor stacked fused"),
# TRAINER_REPORT whether the trainer's overhead is measured reporting "on", "off" or
# both (default "on off").
# GRADFLOW_CLIENT_DIR is the Python client measured (default: clients/python; a copy
# of another commit's, to measure it). GRADFLOW_SERVER_BIN and GRADFLOW_TRAINER_BIN
# name the binaries (default:
# target/release/; the trainer built by `scripts/cuda-toolchain.sh build`). The
# trainer finds CUDA's libraries in PyTorch's `nvidia/cu13` wheels when
# LD_LIBRARY_PATH does not already hold them.
set -uo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?usage: $0 OUT_DIR}
mkdir -p "$out"
server_bin=${GRADFLOW_SERVER_BIN:-$repo/target/release/gradflow-server}
trainer_bin=${GRADFLOW_TRAINER_BIN:-$repo/target/release/gradflow-trainer}
python=${PYTHON:-python3}
client=${GRADFLOW_CLIENT_DIR:-$repo/clients/python}
export PYTHONPATH=$client/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
"$python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' | tee -a "$out/gpu.txt"

cu13=$("$python" -c 'import nvidia, pathlib; print(pathlib.Path(list(nvidia.__path__)[0]) / "cu13" / "lib")' 2>/dev/null)
[ -d "$cu13" ] && export LD_LIBRARY_PATH=$cu13${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

parts=${PARTS:-0 1 2 3 4 5 6}
part() { [[ " $parts " == *" $1 "* ]]; }

if part 0; then
    echo "== 0. the fused gradient-sums kernel against the per-tensor sums"
    "$trainer_bin" --device cuda --check-grad-sums 2>&1 | tee "$out/fused-check.txt"
fi

part 1 && echo "== 1. the Python client, qwen2.5-0.5b, bf16 autocast"
# The last case: Python's GIL handed over every 0.5 ms instead of 5 ms, to see how
# much of the overhead is the training thread waiting for the reporter thread.
IFS=, read -ra cases <<<"${CLIENT_CASES:-512 f32 0.005,512 bf16 0.005,2048 f32 0.005,512 f32 0.0005}"
part 1 && for case in "${cases[@]}"; do
    read -r seq params switch every <<<"$case"
    every=${every:-1}
    steps=$([ "$seq" = 512 ] && echo 100 || echo 40)
    "$python" "$client/bench/overhead.py" --device cuda --preset qwen2.5-0.5b \
        --seq "$seq" --param-dtype "$params" --modes bare,gradflow --steps "$steps" \
        --warmup 10 --block 10 --switch-interval "$switch" --every "$every" \
        --server-bin "$server_bin" ${CLIENT_FLAGS:-} \
        --json "$out/client-8x$seq-$params-$switch-every$every.json"
done

if part 2; then
    echo "== 2. per-parameter gradient norms against one read of the gradients"
    "$python" "$client/bench/norms.py" --json "$out/norms.json"
fi

if part 6; then
    echo "== 6. the instability signals' families, each alone on every step"
    "$python" "$client/bench/overhead.py" --device cuda --preset qwen2.5-0.5b --seq 512 \
        --modes bare,gradflow:none,gradflow,gradflow:attention,gradflow:activations,gradflow:adam,gradflow:output_logits,gradflow:tokens,gradflow:all \
        --steps 40 --warmup 5 --block 5 --server-bin "$server_bin" --json "$out/families-qwen.json"
    "$python" "$client/bench/overhead.py" --device cuda --preset tiny-moe \
        --modes bare,gradflow:none,gradflow,gradflow:moe,gradflow:output_logits,gradflow:all \
        --steps 60 --warmup 10 --server-bin "$server_bin" --json "$out/families-moe.json"
fi

part 3 && echo "== 3. the Rust trainer on CUDA, qwen2.5-0.5b, bf16, in one process"
work=$(mktemp -d)
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$server_bin" --listen "127.0.0.1:$port" --db "$work/gpu.db" >"$work/server.log" 2>&1 &
server=$!
for _ in $(seq 50); do grep -q "listening" "$work/server.log" && break; sleep 0.2; done
url=http://127.0.0.1:$port
part 3 && for report in ${TRAINER_REPORT:-on off}; do
    flags=(--device cuda --preset qwen2.5-0.5b --param-dtype bf16 --compute-dtype bf16
           --steps 40 --measure-overhead --quiet --server "$url" --run-id "overhead-report-$report")
    [ "$report" = off ] && flags+=(--no-report)
    "$trainer_bin" "${flags[@]}" >"$out/trainer-report-$report.json"
    cat "$out/trainer-report-$report.json"
done
# The attention layers' statistics (largest logit, smallest head entropy) apart: a
# third trainer, instrumented without them, stepped in turn with the other two.
part 3 && "$trainer_bin" --device cuda --preset qwen2.5-0.5b --param-dtype bf16 --compute-dtype bf16 \
    --steps 40 --measure-overhead --attention-cost --quiet --no-report \
    >"$out/trainer-attention.json" && echo "attention cost: $(cat "$out/trainer-attention.json")"
# The ways of summing the gradients' squares, without reporting, side by side.
part 3 && for sums in ${GRAD_SUMS:-per-tensor stacked fused}; do
    "$trainer_bin" --device cuda --preset qwen2.5-0.5b --param-dtype bf16 --compute-dtype bf16 \
        --steps 40 --measure-overhead --quiet --no-report --grad-sums "$sums" \
        >"$out/trainer-sums-$sums.json"
    echo "--grad-sums $sums: $(cat "$out/trainer-sums-$sums.json")"
done
# Where the instrumented step's time goes (the device synchronised between phases).
part 3 && for sums in ${GRAD_SUMS:-per-tensor stacked fused}; do
    "$trainer_bin" --device cuda --preset qwen2.5-0.5b --param-dtype bf16 --compute-dtype bf16 \
        --steps 20 --measure-overhead --phases --no-report --quiet --grad-sums "$sums" \
        >"$out/trainer-phases-$sums.json"
    "$python" - "$out/trainer-phases-$sums.json" "$sums" <<'EOF'
import json, sys
figures = json.load(open(sys.argv[1]))
for trainer in ("instrumented", "uninstrumented"):
    phases = ", ".join(f"{p['phase']} {p['median_ms']:.2f}" for p in figures[f"phases_{trainer}"])
    print(f"--grad-sums {sys.argv[2]}, {trainer} (ms): {phases}")
EOF
done

part 4 && echo "== 4. the trainer's scenarios on CUDA (tiny), the server's verdicts"
part 4 && for scenario in healthy detached-prompt bf16-frozen-norms nan-gradient fp16-overflow; do
    "$trainer_bin" --device cuda --scenario "$scenario" --steps 60 --quiet \
        --server "$url" --run-id "cuda-$scenario" 2>&1 | tail -1
    "$python" - "$url" "$scenario" <<'EOF'
import json, sys, urllib.request
url, scenario = sys.argv[1:]
with urllib.request.urlopen(f"{url}/api/v1/runs/cuda-{scenario}/alerts") as answer:
    alerts = json.load(answer)["alerts"]
verdicts = sorted({(a["kind"], a["subject"], a["evidence"].get("cause")) for a in alerts})
print(f"{scenario}: {verdicts or 'no alert'}")
EOF
done | tee "$out/scenarios.txt"

part 5 && echo "== 5. NVML readings as the server stored them (qwen2.5-0.5b, bf16, 60 steps)"
part 5 && "$trainer_bin" --device cuda --preset qwen2.5-0.5b --param-dtype bf16 --compute-dtype bf16 \
    --steps 60 --quiet --server "$url" --run-id cuda-nvml 2>&1 | tail -1
part 5 && "$python" - "$url" "$out/nvml.json" <<'EOF'
import json, statistics, sys, urllib.request
url, path = sys.argv[1:]
stored = {}
for metric in ("gpu_memory_used_bytes", "gpu_memory_total_bytes", "gpu_utilization_pct",
               "gpu_power_w", "gpu_temperature_c"):
    with urllib.request.urlopen(f"{url}/api/v1/runs/cuda-nvml/series?metric={metric}") as answer:
        points = json.load(answer)["points"]
    values = [v for _, v in points if isinstance(v, (int, float))]
    stored[metric] = points
    if values:
        print(f"{metric}: {len(values)} steps stored, min {min(values):.4g}, "
              f"median {statistics.median(values):.4g}, max {max(values):.4g}")
    else:
        print(f"{metric}: nothing stored")
json.dump(stored, open(path, "w"), indent=1)
EOF
kill "$server"
