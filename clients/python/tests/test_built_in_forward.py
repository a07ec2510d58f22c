"""Layers built inside a watched module's forward: the ones registered nowhere are
the wiring finding `params_created_in_forward` (an amendment during the first
steps); one built once and registered (`self.proj = nn.Linear(...)` at the first
call) is a module added to the model, never this; the global hook goes away."""

from __future__ import annotations

from typing import Optional

import torch
from conftest import new_run_id
from torch import nn
from torch.nn.modules import module as nn_module

import gradflow


class BuildsInForward(nn.Module):
    def __init__(self, register: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register = register
        self.embed = nn.Linear(16, 32)
        self.proj: Optional[nn.Linear] = None
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        if self.register:
            if self.proj is None:  # built once, lazily, and held by the model
                self.proj = nn.Linear(32, 32)
            h = self.proj(h)
        else:
            h = nn.Linear(32, 32)(h)  # a new random layer at every call
        return self.head(h)


def run(server, model: nn.Module, steps: int = 6) -> str:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(model, optimizer, server=server.url, run_id=new_run_id(), on_alert=None)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        x = torch.randn(8, 16, generator=g)
        loss = nn.functional.cross_entropy(model(x), torch.randint(0, 4, (8,), generator=g))
        loss.backward()
        optimizer.step()
        gf.step(loss=loss)
    gf.close()
    return gf.run_id


def registration_hooks() -> int:
    return len(nn_module._global_parameter_registration_hooks)


def test_a_layer_built_at_every_call_is_named_once_with_its_module(gradflow_server):
    hooks = registration_hooks()
    run_id = run(gradflow_server, BuildsInForward(register=False))
    assert registration_hooks() == hooks  # removed by the first finding or close
    found = [a for a in gradflow_server.alerts(run_id) if a["kind"] == "params_created_in_forward"]
    assert len(found) == 1, found
    alert = found[0]
    assert alert["subject"] == "run" and alert["severity"] == "critical", alert
    assert alert["evidence"]["attribute"] == "Linear" and alert["evidence"]["params"] == 2
    (amendment,) = gradflow_server.run(run_id)["amendments"]
    assert amendment["step"] == 0 and amendment["amend"]["wiring"][0]["module"] == ""


def test_a_layer_built_once_and_registered_is_an_added_module_not_this(gradflow_server):
    model = BuildsInForward(register=True)
    run_id = run(gradflow_server, model)
    assert model.proj is not None
    kinds = {a["kind"] for a in gradflow_server.alerts(run_id)}
    assert "params_created_in_forward" not in kinds, kinds
    # The optimizer was built before the layer existed: that is what is said.
    alert = gradflow_server.wait_for_alert(run_id, "param_not_in_optimizer", subject="proj")
    assert alert["evidence"]["params"] == ["proj.bias", "proj.weight"] or sorted(
        alert["evidence"]["params"]
    ) == ["proj.bias", "proj.weight"], alert


def test_the_hook_leaves_after_the_first_steps(gradflow_server):
    hooks = registration_hooks()
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id())
    # This check's hook, and the registry's (it tells when to look for replaced
    # parameters), which stays while the watch lasts.
    assert registration_hooks() == hooks + 2
    for _ in range(16):  # at least one look a step
        optimizer.zero_grad()
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
        gf.step()
    assert registration_hooks() == hooks + 1  # a training loop that builds nothing
    gf.close()
    assert registration_hooks() == hooks  # and none is left behind
