"""The alert points at the line: where the graph was cut, and from which step the
parameters changed dtype."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import pytest
import torch
from conftest import AgentHead, batches, new_run_id, qwen_config, train
from said import alerts_said
from test_failures import lora_model, trainable
from torch import nn
from transformers import Qwen2Model

import gradflow

HERE = Path(__file__)


def line_of(marker: str) -> int:
    """The line of this file that carries `# <marker>`."""
    for number, text in enumerate(HERE.read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"# {marker}"):
            return number
    raise AssertionError(f"no line marked {marker}")


def shown(path: Path) -> str:
    """A file as the client names it: relative to the working directory inside it."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative


class CutAgent(nn.Module):
    """A Qwen2 prompt encoder feeding an agent head, with the prompt cut from backward
    one of three ways (or not at all)."""

    def __init__(self, cut: Optional[str], freeze_qwen: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qwen = Qwen2Model(qwen_config())
        self.agent = AgentHead()
        self.cut = cut
        self.cache: Optional[torch.Tensor] = None
        if freeze_qwen:
            self.qwen.requires_grad_(False)

    def encode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.qwen(input_ids=tokens).last_hidden_state[:, -1]  # encode call

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.cut == "no_grad":
            with torch.no_grad():
                prompt = self.encode(tokens)  # no_grad call
        elif self.cut == "detach":
            prompt = self.encode(tokens).detach()
        elif self.cut == "rebuild":
            prompt = torch.tensor(self.encode(tokens).tolist())
        elif self.cut == "cache":
            # Prompt caching with a frozen encoder: computed once, without gradients.
            if self.cache is None:
                with torch.no_grad():
                    self.cache = self.encode(tokens)
            prompt = self.cache
        else:
            prompt = self.encode(tokens)
        return self.agent(prompt)  # agent call


def test_the_alert_in_the_training_process_names_the_line(gradflow_server):
    with alerts_said() as messages:
        run_cut(gradflow_server, "no_grad", on_alert="warn")
    cut = [m for m in messages if "grad_stuck_zero on qwen" in m]
    assert cut, messages
    where = f"  where: qwen (no_grad) at {shown(HERE)}:{line_of('encode call')} in encode"
    assert where in cut[0], cut[0]


def run_cut(server, cut: Optional[str], steps: int = 12, **options):
    model = CutAgent(cut, freeze_qwen=options.pop("freeze_qwen", False))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    options.setdefault("on_alert", None)
    gf = gradflow.watch(
        model,
        optimizer,
        server=server.url,
        run_id=new_run_id("cut"),
        detectors={"stuck_zero_steps": 10},
        **options,
    )
    train(model, optimizer, gf, steps)
    gf.close()
    return gf.run_id


def test_no_grad_around_the_prompt_encoder_names_the_call(gradflow_server):
    run_id = run_cut(gradflow_server, "no_grad")
    alert = gradflow_server.wait_for_alert(run_id, "grad_stuck_zero", subject="qwen")
    cut = alert["evidence"]["graph_cut"]
    assert cut["kind"] == "no_grad" and cut["module"] == "qwen", cut
    here = shown(HERE)
    assert cut["stack"][0] == {"file": here, "line": line_of("encode call"), "function": "encode"}
    assert cut["stack"][1] == {"file": here, "line": line_of("no_grad call"), "function": "forward"}
    site = f"{here}:{line_of('encode call')} in encode"
    assert "qwen's forward ran with gradients disabled" in alert["detail"]
    assert f"(qwen called from {site})" in alert["detail"], alert["detail"]
    assert f"{here}:{line_of('no_grad call')} in forward" in alert["detail"]


@pytest.mark.parametrize("cut", ["detach", "rebuild"])
def test_a_prompt_without_grad_history_names_the_consumer(gradflow_server, cut):
    run_id = run_cut(gradflow_server, cut)
    alert = gradflow_server.wait_for_alert(run_id, "grad_stuck_zero", subject="qwen")
    evidence = alert["evidence"]["graph_cut"]
    assert evidence["kind"] == "detached_input", evidence
    assert (evidence["module"], evidence["upstream"]) == ("agent.prompt_proj", "qwen")
    # The first frame of the user's code is the head's own forward; its caller is the
    # line that passed the prompt in.
    models = shown(HERE.parent / "tiny_models.py")
    assert evidence["stack"][0]["file"] == models
    assert evidence["stack"][0]["function"] == "forward"
    caller = {"file": shown(HERE), "line": line_of("agent call"), "function": "forward"}
    assert evidence["stack"][1] == caller
    assert "agent.prompt_proj received a tensor without grad history" in alert["detail"]
    assert f"{caller['file']}:{caller['line']} in forward" in alert["detail"]


@pytest.mark.parametrize(
    "cut, options",
    [(None, {}), ("cache", {"freeze_qwen": True}), (None, {"freeze_qwen": True})],
    ids=["healthy", "prompt-caching", "frozen-encoder"],
)
def test_healthy_runs_name_nothing(gradflow_server, cut, options):
    run_id = run_cut(gradflow_server, cut, **options)
    alerts = gradflow_server.alerts(run_id)
    assert [a for a in alerts if a["severity"] != "info"] == []
    assert not [a for a in alerts if "graph_cut" in a["evidence"]]


def test_an_evaluation_under_no_grad_is_not_named_for_a_later_cut(gradflow_server):
    """no_grad during evaluation is an episode of its own: when the graph is later cut
    by a .detach(), the alert names the .detach(), not the evaluation."""
    model = CutAgent(None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(
        model,
        optimizer,
        server=gradflow_server.url,
        run_id=new_run_id("cut"),
        on_alert=None,
        detectors={"stuck_zero_steps": 10},
    )

    def evaluate_then_cut(step):
        if step == 2:
            with torch.no_grad():
                model(next(batches(1, seed=9))[0])
        if step == 4:
            model.cut = "detach"

    train(model, optimizer, gf, 16, before_step=evaluate_then_cut)
    gf.close()
    alert = gradflow_server.wait_for_alert(gf.run_id, "grad_stuck_zero", subject="qwen")
    assert alert["first_step"] == 4
    assert alert["evidence"]["graph_cut"]["kind"] == "detached_input"


class InnerCut(nn.Module):
    """A tiny model whose forward runs its middle part under ``torch.no_grad()``: the
    embedding before the block and the block itself get no gradient, the head after
    it trains."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.encoder = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        with torch.no_grad():
            h = self.encoder(h)  # inner no_grad call
        return self.head(h)


def test_a_no_grad_block_inside_the_model_is_named_by_every_alert_it_causes(gradflow_server):
    """The embedding before the block is cut off by the block, not by the head that
    consumed the block's output: its alert, said first, names the block's line too."""
    model = InnerCut()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with alerts_said() as messages:
        gf = gradflow.watch(
            model,
            optimizer,
            server=gradflow_server.url,
            run_id=new_run_id("inner-cut"),
            on_alert="warn",
            detectors={"stuck_zero_steps": 10},
        )
        for step in range(14):
            optimizer.zero_grad()
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).pow(
                2
            ).mean().backward()
            optimizer.step()
            gf.step(loss=1.0)
        gf.close()
    site = f"{shown(HERE)}:{line_of('inner no_grad call')} in forward"
    for subject in ("embed", "encoder"):
        alert = gradflow_server.wait_for_alert(gf.run_id, "grad_stuck_zero", subject=subject)
        cut = alert["evidence"]["graph_cut"]
        assert (cut["kind"], cut["module"]) == ("no_grad", "encoder"), (subject, cut)
        assert f"(encoder called from {site})" in alert["detail"], alert["detail"]
    embed = gradflow_server.wait_for_alert(gf.run_id, "grad_stuck_zero", subject="embed")
    assert embed["evidence"]["graph_cut"]["upstream"] == "embed"
    assert "backward stops at the block, so none reaches embed" in embed["detail"]
    said = [m for m in messages if "grad_stuck_zero on " in m]
    assert len(said) == 2, messages
    for message in said:
        assert f"  where: encoder (no_grad) at {site}" in message, message


def cast_adapters_at_step_10(model):
    def cast(step):
        if step == 10:  # a trainer library casting the adapters behind the user's back
            for layer in model.qwen.layers:
                layer.self_attn.q_proj.lora_A.to(torch.bfloat16)
                layer.self_attn.q_proj.lora_B.to(torch.bfloat16)

    return cast


def test_adapters_cast_to_bf16_under_a_grad_scaler_are_flagged_on_that_step(gradflow_server):
    model = lora_model(torch.float32)
    # Plain SGD takes bf16 gradients for bf16 parameters: training goes on.
    optimizer = torch.optim.SGD(trainable(model), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    gf = gradflow.watch(
        model, optimizer, scaler=scaler, server=gradflow_server.url, run_id=new_run_id("cast")
    )
    assert gradflow_server.alerts(gf.run_id) == [], "f32 adapters under a scaler are fine"

    cast = cast_adapters_at_step_10(model)
    with alerts_said() as shown_alerts:
        train(model, optimizer, gf, 14, scaler=scaler, autocast=torch.float16, before_step=cast)
        gf.close()
    scaler_alert = gradflow_server.wait_for_alert(gf.run_id, "scaler_bf16_incompatible")
    assert scaler_alert["first_step"] == 10 and scaler_alert["opened_step"] == 10
    assert scaler_alert["detail"].startswith("From step 10,"), scaler_alert["detail"]
    mismatch = gradflow_server.wait_for_alert(gf.run_id, "dtype_mismatch", subject="qwen")
    assert mismatch["first_step"] == 10 and "From step 10," in mismatch["detail"]
    # The person training saw it as it happened.
    assert any("scaler_bf16_incompatible" in m for m in shown_alerts), shown_alerts


def test_a_step_that_crashes_on_the_cast_still_reports_it(gradflow_server):
    """AdamW's f32 moments meet the adapters' new bf16 gradients: the optimizer raises
    inside step 10, before gf.step. Closing the watcher sends what step 10 saw."""
    model = lora_model(torch.float32)
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-3)
    gf = gradflow.watch(
        model, optimizer, server=gradflow_server.url, run_id=new_run_id("crash"), on_alert=None
    )
    with pytest.raises(RuntimeError, match="BFloat16"):
        train(model, optimizer, gf, 14, before_step=cast_adapters_at_step_10(model))
    gf.close()
    run = gradflow_server.run(gf.run_id)
    assert run["last_step"] == 10 and [a["step"] for a in run["amendments"]] == [10]
    mismatch = gradflow_server.wait_for_alert(gf.run_id, "dtype_mismatch", subject="qwen")
    assert mismatch["first_step"] == 10
