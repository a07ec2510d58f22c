"""Every code block of README.md and clients/python/README.md runs as written.

The fenced ``python`` and ``sh`` blocks are read from the READMEs themselves, so a
README that drifts from the code fails here. A Python block runs in a fresh
interpreter against a real server, after a prelude this test supplies for the names
the block leaves to the reader (``model``, ``optimizer``, ``loader``, ``args``,
``train_dataset``: tiny random models and data), never an edit of the block. The
run it reports is read back from the server: stored, and clean. A shell block runs
in ``bash`` with a prelude too: ``curl`` reaches this test's server where the block
says ``http://127.0.0.1:7070``, and every ``# → {...}`` answer the block promises
is compared with what came back. Blocks that need a release build, the network,
PostgreSQL, Docker or a placeholder's real value are listed below, each with why.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional

import pytest
from conftest import REPO, ServerProcess, new_run_id, server_binary
from test_healthy_end import assert_clean_end

READMES = ("README.md", "clients/python/README.md")

# Blocks not run here, by their first line, and why.
NOT_RUN = {
    # README.md
    "cargo build --release && ./target/release/gradflow-server demo": (
        "a release build, and the demo runs until Ctrl-C (tests/tests/e2e/demo.rs checks its runs)"
    ),
    "scripts/test.sh": "the whole test suite, this test included",
    "pip install ./clients/python     # the gradflow client, and gradflow-server beside it": (
        "a release build of the server into the wheel (scripts/wheel-smoke.sh installs it "
        "in CI), then a server that runs until Ctrl-C"
    ),
    "cargo run --release -p gradflow-server": "a release build; serves until Ctrl-C",
    "cargo run --release -p gradflow-trainer -- --scenario detached-prompt --run-id cut": (
        "a release build of the trainer (tests/tests/e2e runs every scenario)"
    ),
    'dir=$(mktemp -d) && url=$(scripts/test-postgres.sh start "$dir")   '
    "# prints postgres://gradflow@127.0.0.1:PORT": "a PostgreSQL cluster",
    "docker build -f server/Dockerfile -t gradflow-server .": "Docker and the network",
    "cargo build --release --workspace --bins && ./target/release/gradflow-load": (
        "a release build and a minute of load"
    ),
    "cargo build --release --workspace --bins && ./target/release/gradflow-bench "
    "--out docs/benchmarks": "a release build and 8–15 minutes of benchmarks",
    # clients/python/README.md
    "pip install ./clients/python   # from a checkout: cargo compiles the server into "
    "the wheel": "a release build of the server into the wheel (scripts/wheel-smoke.sh)",
    "gradflow report /tmp/gradflow-spool/RUN.1234.ndjson --out run.html": (
        "RUN.1234 stands for a real spool's name (test_cli_servers.py runs gradflow report)"
    ),
    "engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, "
    "config=cfg)": "DeepSpeed ranks under a launcher (test_deepspeed.py)",
}


class Block(NamedTuple):
    readme: str
    line: int  # of the opening fence
    language: str
    code: str

    @property
    def first(self) -> str:
        return self.code.splitlines()[0] if self.code.strip() else ""

    def __str__(self) -> str:
        return f"{self.readme}:{self.line}"


def blocks() -> List[Block]:
    found = []
    for readme in READMES:
        lines = (REPO / readme).read_text().splitlines()
        at = 0
        while at < len(lines):
            fence = re.match(r"^```(\w*)\s*$", lines[at])
            if fence is None:
                at += 1
                continue
            end = next(i for i in range(at + 1, len(lines)) if lines[i].startswith("```"))
            found.append(Block(readme, at + 1, fence.group(1), "\n".join(lines[at + 1 : end])))
            at = end + 1
    return [b for b in found if b.language in ("python", "sh")]


ALL = blocks()


def test_every_block_is_run_or_says_why_not():
    firsts = {b.first for b in ALL}
    assert [b for b in ALL if b.first not in NOT_RUN and not runs_as(b)] == []
    # A block taken out of a README leaves no stale entry behind.
    assert sorted(set(NOT_RUN) - firsts) == []


def run_in(
    folder: Path, command: List[str], server: Optional[ServerProcess], **extra: str
) -> subprocess.CompletedProcess:
    """`command` in `folder`, reporting to `server` (none: GRADFLOW_SERVER unset), with
    no other GRADFLOW_* setting of this process's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADFLOW_")}
    env["GRADFLOW_SPOOL_DIR"] = str(folder / "spool")
    if server is not None:
        env["GRADFLOW_SERVER"] = server.url
    env.update(extra)
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=folder, env=env)


# -- Python blocks -------------------------------------------------------------------

# The names a README's training block leaves to the reader, by what the block runs.
LOOP = """
import torch
from torch import nn

class Regression(nn.Module):
    # A model that returns its loss, as the README's loop has it.
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, batch):
        x, y = batch
        return (self.body(x) - y).pow(2).mean()

torch.manual_seed(0)
model = Regression()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = [(torch.randn(4, 8), torch.randn(4, 1))] * STEPS  # one batch: the loss only falls
"""

HF = """
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, TrainingArguments

torch.manual_seed(0)
model = Qwen2ForCausalLM(Qwen2Config(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
tokens = torch.randint(0, 64, (4 * STEPS, 12))
train_dataset = [{"input_ids": t, "labels": t} for t in tokens]
args = TrainingArguments(
    output_dir="out", max_steps=STEPS, per_device_train_batch_size=4, report_to=[],
    save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
"""

LIGHTNING = """
import lightning
import torch
from torch import nn

class Regression(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.body(x) - y).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

torch.manual_seed(0)
model = Regression()
x, y = torch.randn(4, 8), torch.randn(4, 1)  # one batch, ten times: the loss only falls
data = torch.utils.data.TensorDataset(x.repeat(10, 1), y.repeat(10, 1))
loader = torch.utils.data.DataLoader(data, batch_size=4)
"""

STEPS = 6


def runs_as(block: Block) -> str:
    """The prelude a block runs after ('' for a shell block, which has its own)."""
    if block.language == "sh":
        return "sh" if block.first not in NOT_RUN else ""
    if block.first in NOT_RUN:
        return ""
    if "lightning" in block.code:
        return "lightning"
    if "transformers" in block.code:
        return "hf"
    if "gradflow.watch(model, optimizer)" in block.code:
        return "loop"
    return ""


PRELUDES = {"loop": LOOP, "hf": HF, "lightning": LIGHTNING}

PYTHON = [b for b in ALL if b.language == "python" and runs_as(b)]


@pytest.mark.parametrize("block", PYTHON, ids=str)
def test_python_block(block: Block, tmp_path, gradflow_server):
    run_id = new_run_id("readme")
    script = tmp_path / "block.py"
    # The prelude runs first, and the block exactly as the README has it.
    script.write_text(PRELUDES[runs_as(block)].replace("STEPS", str(STEPS)) + "\n" + block.code)
    done = run_in(tmp_path, [sys.executable, str(script)], gradflow_server, GRADFLOW_RUN_ID=run_id)
    assert done.returncode == 0, f"{block} failed:\n{done.stderr[-4000:]}"
    assert "internal error" not in done.stderr, done.stderr[-4000:]
    assert f"gradflow: run {run_id}: {gradflow_server.url}/runs/{run_id}" in done.stderr
    steps = gradflow_server.run(run_id)["step_count"]
    # The prelude's loader and TrainingArguments hold STEPS steps; a Lightning block
    # says its own max_steps.
    assert steps == STEPS if runs_as(block) != "lightning" else steps > 0, steps
    assert_clean_end(gradflow_server, run_id, steps)


# -- shell blocks --------------------------------------------------------------------

# `curl` as the README calls it, reaching this test's server where the block names the
# default address; a live stream (`-N`) is read for a second. Each call's answer ends
# with a newline, so that every answer is one line to compare.
SHELL = r"""
set -euo pipefail
curl() {
    local args=() live=0
    for arg in "$@"; do
        [ "$arg" = "-N" ] && live=1
        args+=("${arg//http:\/\/127.0.0.1:7070/$GRADFLOW_SERVER}")
    done
    if [ "$live" = 1 ]; then
        command curl --max-time 1 "${args[@]}" || [ $? = 28 ]
    else
        command curl --fail-with-body "${args[@]}"
    fi
    echo
}
"""

# A training script for the README's `gradflow check ... -- python train.py --config
# tiny.yaml`: healthy, and as long as the check lets it run.
TRAIN = textwrap.dedent(
    """
    import torch
    from torch import nn
    import gradflow

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(model, optimizer)
    x, y = torch.randn(16, 8), torch.randn(16, 1)  # one batch: the loss only falls
    while True:
        optimizer.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        optimizer.step()
        gf.step(loss=loss)
    """
)

SH = [b for b in ALL if b.language == "sh" and runs_as(b)]


def promised(code: str) -> List[Dict[str, Any]]:
    """The complete JSON answers the block's `# →` comments promise."""
    out = []
    for answer in re.findall(r"#\s*→\s*(.+)$", code, re.M):
        try:
            out.append(json.loads(answer))
        except ValueError:
            continue  # an elided answer ("...") or words
    return out


@pytest.fixture(scope="module")
def own_server(tmp_path_factory):
    """A server of the shell blocks' own: their run ids (demo-1, demo-2) are fixed."""
    server = ServerProcess(tmp_path_factory.mktemp("readme") / "gradflow.db").start()
    yield server
    server.stop()


@pytest.mark.parametrize("block", SH, ids=str)
def test_shell_block(block: Block, tmp_path, own_server):
    (tmp_path / "train.py").write_text(TRAIN)
    # `gradflow check` starts a server of its own, as it does for a new user.
    checks = block.first.startswith("gradflow check")
    done = run_in(
        tmp_path,
        ["bash", "-c", SHELL + "\n" + block.code],
        None if checks else own_server,
        GRADFLOW_SERVER_BIN=str(server_binary()),
        # `gradflow` and `python` are this environment's.
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
    )
    assert done.returncode == 0, f"{block} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    answers = []
    for line in done.stdout.splitlines():
        try:
            answers.append(json.loads(line))
        except ValueError:
            continue
    for answer in promised(block.code):
        assert answer in answers, f"{block} promises {answer}; the server said {answers}"
    if block.first.startswith("gradflow check"):
        assert "gradflow check: OK (1 run(s)" in done.stdout, done.stdout
