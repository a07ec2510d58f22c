"""Parameters replaced while the run is watched: a module swapped for a new one, a
matrix resized into a new tensor. The client notices the names resolving to other
tensors, measures the new ones and amends the registration, so that a replacement
the optimizer never saw is `param_not_in_optimizer` on the step it happened."""

from __future__ import annotations

import torch
from conftest import PromptAgent, new_run_id, train
from torch import nn

import gradflow
from gradflow.measurement.registration import Registry


def trained(server, steps, change_at, change):
    """A PromptAgent trained `steps` steps under AdamW over all its parameters, with
    `change(model, optimizer)` made before step `change_at`; the run as the server has
    it, and its id."""
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(model, optimizer, server=server.url, run_id=new_run_id(), on_alert=None)

    def before_step(step):
        if step == change_at:
            change(model, optimizer)

    train(model, optimizer, gf, steps, before_step=before_step)
    gf.close()
    return server.run(gf.run_id), gf.run_id


def _swap_head(model: PromptAgent) -> nn.Linear:
    old = model.agent.head
    new = nn.Linear(old.in_features, old.out_features)
    with torch.no_grad():
        new.weight.copy_(old.weight)
        new.bias.copy_(old.bias)
    model.agent.head = new
    return new


def test_a_head_swapped_mid_run_is_measured_amended_and_flagged(gradflow_server):
    # The optimizer still holds the old head.
    run, run_id = trained(gradflow_server, 12, 6, lambda model, _: _swap_head(model))
    (amendment,) = run["amendments"]
    assert amendment["step"] == 6
    specs = {p["name"]: p for p in amendment["amend"]["params"]}
    assert set(specs) == {"agent.head.weight", "agent.head.bias"}
    assert specs["agent.head.weight"]["requires_grad"] is True
    assert specs["agent.head.weight"]["in_optimizer"] is False
    alert = gradflow_server.wait_for_alert(run_id, "param_not_in_optimizer", subject="agent")
    assert alert["opened_step"] == 6, alert
    # The new head is the one measured: backward reaches it after the swap.
    hits = dict(gradflow_server.series(run_id, "hook_hits", "agent.head"))
    assert all(hits[step] >= 1 for step in range(7, 12)), hits
    norms = dict(gradflow_server.series(run_id, "grad_norm", "agent.head"))
    assert all(norms[step] > 0 for step in range(6, 12)), norms


def test_a_replacement_added_to_the_optimizer_is_amended_and_silent(gradflow_server):
    def swap_and_add(model, optimizer):
        new = _swap_head(model)
        optimizer.add_param_group({"params": new.parameters()})  # done right

    run, run_id = trained(gradflow_server, 10, 4, swap_and_add)
    assert [a["step"] for a in run["amendments"]] == [4]
    spec = {p["name"]: p for p in run["params"]}["agent.head.weight"]
    assert spec["in_optimizer"] is True and spec["param_group"] == "1"
    assert not gradflow_server.serious(run_id)


def test_a_module_removed_is_sent_frozen_and_outside_the_optimizer(gradflow_server):
    def remove(model, _):
        model.agent.hidden = nn.Identity()  # its parameters leave the model

    run, run_id = trained(gradflow_server, 6, 3, remove)
    (amendment,) = run["amendments"]
    assert amendment["step"] == 3
    gone = {p["name"]: p for p in amendment["amend"]["params"]}
    assert set(gone) == {"agent.hidden.weight", "agent.hidden.bias"}
    assert gone["agent.hidden.weight"]["requires_grad"] is False
    assert gone["agent.hidden.weight"]["in_optimizer"] is False
    assert not gradflow_server.serious(run_id)


def test_an_unchanged_model_is_never_amended(gradflow_server):
    def in_place(model, _):
        with torch.no_grad():  # values change, the tensors stay the same
            model.agent.head.weight.mul_(0.5)

    run, _ = trained(gradflow_server, 6, 2, in_place)
    assert run["amendments"] == []


def test_the_identity_check_notices_parameters_and_modules_only():
    model = PromptAgent()
    registry = Registry(model, None, None, None)
    assert not registry.replaced()
    model.agent.head.weight.data = torch.zeros_like(model.agent.head.weight)
    assert not registry.replaced()  # `.data` keeps the tensor
    model.agent.head.weight = nn.Parameter(torch.zeros(4, 48))
    assert registry.replaced()
    registry.amendment()
    assert not registry.replaced()
    model.agent.extra = nn.Linear(2, 2)  # a new module is a change too
    assert registry.replaced()


def test_a_change_no_registration_hook_sees_is_still_found_within_a_few_checks():
    from gradflow.measurement.registration import WALK_EVERY

    model = PromptAgent()
    registry = Registry(model, None, None, None)
    assert not registry.replaced()
    # A write straight into the parameter dict runs no registration hook.
    model.agent.head._parameters["weight"] = nn.Parameter(torch.zeros(4, 48))
    found = [registry.replaced() for _ in range(WALK_EVERY)]
    assert any(found), "the periodic walk finds it"
    registry.remove()
    # Without the hooks every check walks the model.
    model.agent.head._parameters["bias"] = nn.Parameter(torch.zeros(4))
    assert registry.replaced()


def test_modules_built_outside_the_model_do_not_make_it_walk():
    model = PromptAgent()
    registry = Registry(model, None, None, None)
    assert not registry.replaced()
    # What a Hugging Face forward does every step: `self.layers[:n]` is a new
    # ModuleList holding the model's layers.
    nn.ModuleList(list(model.children()))
    assert not registry._registered
    model.agent.extra = nn.Linear(2, 2)
    assert registry._registered and registry.replaced()
    registry.remove()
