"""The registration gradflow builds from live objects, as the server stores it."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import PromptAgent, new_run_id, qwen_config
from torch import nn
from transformers import Qwen2ForCausalLM

import gradflow


def registered(server, model, optimizer=None, **options):
    gf = gradflow.watch(
        model, optimizer, server=server.url, run_id=new_run_id(), on_alert=None, **options
    )
    gf.close()
    return server.run(gf.run_id)


def test_every_parameter_is_registered_with_role_group_and_optimizer_group(gradflow_server):
    model = PromptAgent()
    optimizer = torch.optim.AdamW(
        [
            {"params": model.qwen.parameters(), "lr": 1e-4},
            {"params": model.agent.parameters(), "weight_decay": 0.0},
        ],
        lr=1e-3,
        betas=(0.9, 0.95),
    )
    run = registered(gradflow_server, model, optimizer, name="registration test")
    params = {p["name"]: p for p in run["params"]}
    assert set(params) == {name for name, _ in model.named_parameters()}
    assert params["qwen.embed_tokens.weight"]["role"] == "embedding"
    assert params["qwen.layers.1.post_attention_layernorm.weight"] == {
        "name": "qwen.layers.1.post_attention_layernorm.weight",
        "module": "qwen.layers.1.post_attention_layernorm",
        "group": "qwen",
        "role": "norm",
        "dtype": "f32",
        "shape": [48],
        "requires_grad": True,
        "in_optimizer": True,
        "param_group": "0",
    }
    assert params["agent.norm.weight"]["role"] == "norm"  # torch.nn.RMSNorm
    assert params["agent.head.bias"]["role"] == "bias"
    assert params["agent.head.weight"]["role"] == "linear"
    assert params["agent.head.weight"]["param_group"] == "1"
    assert {p["group"] for p in run["params"]} == {"qwen", "agent"}
    assert run["optimizer"]["name"] == "adamw"
    assert run["optimizer"]["param_groups"] == [
        {"name": "0", "lr": 1e-4, "weight_decay": 0.01, "betas": [0.9, 0.95], "eps": 1e-8},
        {"name": "1", "lr": 1e-3, "weight_decay": 0.0, "betas": [0.9, 0.95], "eps": 1e-8},
    ]
    assert run["precision"] == {"param_dtype": "f32", "loss_scaler": "none"}
    assert run["name"] == "registration test"


def test_a_causal_lm_wrapper_is_grouped_one_level_deeper(gradflow_server):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen_config())
    run = registered(gradflow_server, model, torch.optim.AdamW(model.parameters()))
    groups = {p["name"]: p["group"] for p in run["params"]}
    assert groups["model.layers.0.mlp.up_proj.weight"] == "model.layers"
    assert groups["model.embed_tokens.weight"] == "model.embed_tokens"
    assert groups["model.norm.weight"] == "model.norm"
    assert groups["lm_head.weight"] == "lm_head"


def test_groups_can_be_named_by_the_user(gradflow_server):
    model = PromptAgent()
    run = registered(
        gradflow_server,
        model,
        torch.optim.AdamW(model.parameters()),
        groups={"encoder": model.qwen, "policy": ["agent.head", "agent.hidden"]},
    )
    groups = {p["name"]: p["group"] for p in run["params"]}
    assert groups["qwen.layers.0.self_attn.q_proj.weight"] == "encoder"
    assert groups["agent.head.weight"] == "policy"
    assert groups["agent.norm.weight"] == "agent"  # not named: the default
    by_callable = registered(
        gradflow_server,
        model,
        torch.optim.AdamW(model.parameters()),
        groups=lambda name: "backbone" if name.startswith("qwen.") else None,
    )
    assert {p["group"] for p in by_callable["params"]} == {"backbone", "agent"}


def test_scaler_kind_and_frozen_parameters(gradflow_server):
    model = PromptAgent()
    model.qwen.requires_grad_(False)
    optimizer = torch.optim.SGD(model.agent.parameters(), lr=0.1, momentum=0.9)
    run = registered(gradflow_server, model, optimizer, scaler=torch.amp.GradScaler("cpu"))
    assert run["precision"]["loss_scaler"] == "dynamic"
    spec = {p["name"]: p for p in run["params"]}["qwen.norm.weight"]
    assert spec["requires_grad"] is False and spec["in_optimizer"] is False
    assert "param_group" not in spec
    assert run["optimizer"]["name"] == "sgd" and run["optimizer"]["momentum"] == 0.9
    assert gradflow_server.serious(run["run_id"]) == []  # frozen on purpose is no fault
    disabled = registered(
        gradflow_server, model, optimizer, scaler=torch.amp.GradScaler("cpu", enabled=False)
    )
    assert disabled["precision"]["loss_scaler"] == "none"


def test_a_zero_partitioned_model_without_its_engine_is_refused_with_a_clear_warning():
    """A model whose parameters DeepSpeed ZeRO partitions, given without the engine:
    its gradients are held by DeepSpeed's optimizer, so the warning says to pass the
    engine (tests/test_deepspeed.py watches one)."""
    model = PromptAgent()
    model.agent.head.weight.ds_id = 7  # how DeepSpeed ZeRO marks a partitioned parameter
    with pytest.warns(
        gradflow.GradflowWarning, match=r"pass the engine .*gradflow\.watch\(engine\)"
    ):
        gf = gradflow.watch(model, torch.optim.AdamW(model.parameters()), run_id=new_run_id())
    assert isinstance(gf, gradflow.NoopWatcher)


def test_a_bad_argument_does_not_stop_training():
    model = nn.Linear(2, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gf = gradflow.watch(model, run_id="not a valid id")
    assert isinstance(gf, gradflow.NoopWatcher)
    assert any("run id" in str(w.message) for w in caught)


def test_the_registration_counts_the_modules_whose_behaviour_depends_on_the_mode(
    gradflow_server,
):
    """Dropout with p > 0, batch norm keeping running statistics and a recurrent layer
    with dropout read the training flag; dropout at 0 and norms without running
    statistics (they normalise by the batch in both modes) do not."""
    steady = nn.Sequential(
        nn.Linear(8, 8), nn.Dropout(0.0), nn.BatchNorm1d(8, track_running_stats=False)
    )
    assert registered(gradflow_server, steady)["mode_dependent_modules"] == 0
    moody = nn.ModuleDict(
        {
            "drop": nn.Dropout(0.1),
            "norm": nn.BatchNorm1d(8),
            "rnn": nn.LSTM(8, 8, num_layers=2, dropout=0.2),
            "instance": nn.InstanceNorm1d(8),
            "head": nn.Linear(8, 1),
        }
    )
    assert registered(gradflow_server, moody)["mode_dependent_modules"] == 3
