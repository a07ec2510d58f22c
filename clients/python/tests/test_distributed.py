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


def test_dtensor_parameters_are_not_reported_as_whole_tensors(process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = PromptAgent()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    with pytest.warns(gradflow.GradflowWarning, match="DTensor"):
        gf = gradflow.watch(model, torch.optim.AdamW(model.parameters()), run_id=new_run_id())
    assert isinstance(gf, gradflow.NoopWatcher)
