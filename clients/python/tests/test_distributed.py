"""torch.distributed: one process group of one rank (gloo, CPU), the real wrappers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import PromptAgent, free_port, new_run_id, train
from torch.nn.parallel import DistributedDataParallel

import gradflow


@pytest.fixture
def process_group():
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_ddp_rank_zero_reports_under_the_model_s_own_names(gradflow_server, process_group):
    model = DistributedDataParallel(PromptAgent())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id())
    train(model, optimizer, gf, 3)
    gf.close()
    run = gradflow_server.run(gf.run_id)
    assert (run["rank"], run["world_size"]) == (0, 1)
    assert {p["group"] for p in run["params"]} == {"qwen", "agent"}
    assert run["step_count"] == 3


def test_only_the_reporting_rank_reports(process_group):
    model = PromptAgent()
    gf = gradflow.watch(model, torch.optim.AdamW(model.parameters()), rank=1)
    assert isinstance(gf, gradflow.NoopWatcher)


def test_an_fsdp2_model_on_one_rank_reports_as_the_plain_model(gradflow_server, process_group):
    """A DTensor's local shard is the whole tensor on a mesh of one rank: the run is
    watched, as a single process (no v1.4 fields), with the plain model's numbers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    runs = {}
    for kind in ("plain", "fsdp2"):
        model = PromptAgent(seed=4)
        if kind == "fsdp2":
            fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id())
        assert isinstance(gf, gradflow.Watcher)
        train(model, optimizer, gf, 3)
        gf.close()
        runs[kind] = gf.run_id
    run = gradflow_server.run(runs["fsdp2"])
    assert run["step_count"] == 3 and (run["rank"], run["world_size"]) == (0, 1)
    assert all("layout" not in p for p in run["params"])
    for metric, subject in [
        ("loss", ""),
        ("grad_norm", "qwen.layers.0.self_attn.q_proj"),
        ("grad_norm", "agent.head"),
        ("drift", "agent.norm.weight"),
        ("param_mean", "qwen.norm.weight"),
        ("hook_hits", "agent.head"),
    ]:
        plain = gradflow_server.series(runs["plain"], metric, subject)
        sharded = gradflow_server.series(runs["fsdp2"], metric, subject)
        assert len(plain) == 3 and [s for s, _ in sharded] == [s for s, _ in plain]
        assert [v for _, v in sharded] == pytest.approx([v for _, v in plain], rel=1e-5), metric
