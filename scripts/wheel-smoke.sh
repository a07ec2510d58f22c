#!/usr/bin/env bash
# The Python package as a PyTorch user gets it: builds the gradflow wheel (the client
# and the gradflow-server binary in one platform wheel), installs it into a fresh
# virtual environment with nothing else, and, with no cargo on the PATH:
#   - `import gradflow` and the CLI work without torch;
#   - `gradflow-server` and `gradflow server` are the installed server;
#   - the README's quickstart loop (real torch, a `torch.no_grad()` that cuts the graph)
#     reports to `gradflow server` and gets its alert back, in the training process and
#     from the server;
#   - `gradflow check` starts the wheel's server by itself and fails the script;
#   - `gradflow report` diagnoses a run no server saw, from its spool, on that server.
#
#   GRADFLOW_VENV           the test environment with torch (default ~/.cache/gradflow/venv);
#                           the fresh environment borrows its torch through a .pth file
#   GRADFLOW_BUILD_PROFILE  the cargo profile of the wheel's server (default here: dev,
#                           which reuses the workspace's target/debug build; a release
#                           wheel builds with release)
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${GRADFLOW_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/gradflow/venv}"
cached_py="$venv/bin/python"
if ! "$cached_py" -c "import torch, hatchling" 2>/dev/null; then
    echo "error: $venv needs torch and hatchling: run scripts/python-tests.sh first" >&2
    exit 1
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/gradflow-wheel-smoke.XXXXXX")
server_pid=""
cleanup() {
    if [ -n "$server_pid" ]; then
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

# 1. The wheel, built as `pip install ./clients/python` builds it (cargo compiles the
#    server into it).
start=$(date +%s)
GRADFLOW_BUILD_PROFILE="${GRADFLOW_BUILD_PROFILE:-dev}" \
    "$cached_py" -m pip wheel --quiet --disable-pip-version-check --no-deps \
    --no-build-isolation -w "$work/dist" ./clients/python
wheel=$(ls "$work"/dist/gradflow-*.whl)
echo "=== built $(basename "$wheel") in $(($(date +%s) - start)) s ==="
case "$(basename "$wheel")" in
*-py3-none-any.whl)
    echo "error: the wheel is pure Python: it does not carry gradflow-server" >&2
    exit 1
    ;;
esac

# 2. A fresh environment with the wheel and nothing else.
"$cached_py" -m venv "$work/venv"
fresh="$work/venv/bin"
"$fresh/python" -m pip install --quiet --disable-pip-version-check --no-index "$wheel"

# From here on: the fresh environment's commands, and a PATH without cargo or rustc.
path="$fresh"
IFS=: read -r -a dirs <<<"$PATH"
for dir in "${dirs[@]}"; do
    if [ -n "$dir" ] && [ ! -e "$dir/cargo" ] && [ ! -e "$dir/rustc" ]; then
        path="$path:$dir"
    fi
done
in_fresh() {
    env -u GRADFLOW_SERVER_BIN -u GRADFLOW_SERVER -u GRADFLOW_RUN_ID -u GRADFLOW_DISABLED \
        -u VIRTUAL_ENV -u PYTHONPATH -u CARGO PATH="$path" "$@"
}
in_fresh sh -c '! command -v cargo && ! command -v rustc' >/dev/null ||
    { echo "error: cargo is still on the PATH" >&2; exit 1; }
[ "$(in_fresh sh -c 'command -v gradflow-server')" = "$fresh/gradflow-server" ]

# 3. Without torch: the import, the CLI, the server.
in_fresh python -c '
import sys
import gradflow
assert "torch" not in sys.modules, "import gradflow imported torch"
try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("torch should not be importable yet")
print("import gradflow without torch: ok")
'
in_fresh gradflow --help >/dev/null
in_fresh gradflow check --help >/dev/null
in_fresh gradflow report --help >/dev/null
server_version=$(in_fresh gradflow-server --version)
[ "$(in_fresh gradflow server --version)" = "$server_version" ]
echo "gradflow server --version: $server_version"

# 4. Torch, from the test environment (several GB: borrowed, not installed again).
site=$("$fresh/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
"$cached_py" -c 'import sysconfig; print(sysconfig.get_path("purelib"))' >"$site/borrowed-torch.pth"
in_fresh python -c '
import sys
import gradflow, torch
assert gradflow.__file__.startswith(sys.prefix), gradflow.__file__
print("torch", torch.__version__, "from the test environment; gradflow from the wheel")
'

# 5. The README's quickstart, against `gradflow server`: a model whose encoder runs
#    under torch.no_grad(), the bug gradflow is for.
cat >"$work/train.py" <<'EOF'
import torch
from torch import nn

import gradflow

torch.manual_seed(0)
model = nn.ModuleDict({
    "encoder": nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32)),
    "agent": nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)),
})
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

gf = gradflow.watch(model, optimizer)
for step in range(60):
    optimizer.zero_grad(set_to_none=True)
    x = torch.randn(8, 16)
    with torch.no_grad():  # the bug: the encoder never gets a gradient
        prompt = model["encoder"](x)
    loss = model["agent"](prompt).pow(2).mean()
    loss.backward()
    optimizer.step()
    gf.step(loss=loss)
gf.close()
EOF
port=$("$fresh/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url="http://127.0.0.1:$port"
: >"$work/server.log"
in_fresh gradflow server --listen "127.0.0.1:$port" --db "$work/gradflow.db" >"$work/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 1 150); do
    if grep -q "gradflow-server listening" "$work/server.log"; then break; fi
    if ! kill -0 "$server_pid" 2>/dev/null; then cat "$work/server.log" >&2; exit 1; fi
    sleep 0.2
done
grep -q "gradflow-server listening" "$work/server.log" || { cat "$work/server.log" >&2; exit 1; }

(cd "$work" && in_fresh env GRADFLOW_SERVER="$url" GRADFLOW_RUN_ID=quickstart python train.py) \
    >"$work/train.log" 2>&1 || { cat "$work/train.log" >&2; exit 1; }
grep -q "grad_stuck_zero on encoder" "$work/train.log" ||
    { echo "error: the training process got no alert:" >&2; cat "$work/train.log" >&2; exit 1; }
in_fresh python - "$url" <<'EOF'
import json, sys, urllib.request
url = sys.argv[1]
with urllib.request.urlopen(f"{url}/api/v1/runs/quickstart/alerts?status=open") as response:
    alerts = json.load(response)["alerts"]
found = [(a["kind"], a["subject"], a["evidence"].get("cause")) for a in alerts]
assert ("grad_stuck_zero", "encoder", "backward_not_reached") in found, found
print(f"the quickstart loop against gradflow server: {found}")
EOF
kill "$server_pid"
wait "$server_pid" || true
server_pid=""

# 6. `gradflow check` starts the wheel's own server, found beside it even with the
#    environment not activated (its bin/ off the PATH).
bare_path="${path#"$fresh:"}"
in_fresh env PATH="$bare_path" sh -c '! command -v gradflow-server' >/dev/null ||
    { echo "error: another gradflow-server is on the PATH" >&2; exit 1; }
status=0
(cd "$work" && in_fresh env PATH="$bare_path" "$fresh/gradflow" check -- "$fresh/python" train.py) \
    >"$work/check.log" 2>&1 || status=$?
if [ "$status" != 1 ] || ! grep -q "\[critical\] grad_stuck_zero on encoder" "$work/check.log"; then
    echo "error: gradflow check exited $status:" >&2
    cat "$work/check.log" >&2
    exit 1
fi
echo "gradflow check with the wheel's server: exit 1, grad_stuck_zero on encoder"

# 7. A run no server saw: `gradflow report` diagnoses its spool on the wheel's server.
dead=$("$fresh/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
(cd "$work" && in_fresh env GRADFLOW_SERVER="http://127.0.0.1:$dead" GRADFLOW_RUN_ID=offline \
    GRADFLOW_SPOOL_DIR="$work/spool" GRADFLOW_CLOSE_TIMEOUT=1 python train.py) \
    >"$work/offline.log" 2>&1 || { cat "$work/offline.log" >&2; exit 1; }
spool=$(ls "$work"/spool/offline.*.ndjson)
in_fresh env PATH="$bare_path" "$fresh/gradflow" report "$spool" --out "$work/report.html" \
    >"$work/report.log" 2>&1 || { cat "$work/report.log" >&2; exit 1; }
grep -q "run offline, 60 steps" "$work/report.log" && grep -q "grad_stuck_zero" "$work/report.html" ||
    { echo "error: the offline report misses the alert:" >&2; cat "$work/report.log" >&2; exit 1; }
echo "gradflow report with the wheel's server: $(head -1 "$work/report.log")"
echo "=== wheel smoke test passed ==="
