"""The training thread's share of watching, cut down without changing what the server
receives: hook hits counted by C-level hooks, the graph-cut tracer's hooks paused
once they have looked, small gradients reduced together on a CPU, the step's numbers
assembled on the reporter thread, the optimizer state and the registration's
signature read once a step."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import PromptAgent, batches, new_run_id
from torch import nn

import gradflow
from gradflow._torch_compat import ParkedForwardHooks, PausableForwardPreHooks
from gradflow.capture.cuts import FULL_EVERY
from gradflow.capture.instrument import NORM_WEIGHTS_EVERY, NORM_WEIGHTS_FIRST
from gradflow.measurement import intended, measure, vector
from gradflow.measurement.measure import count_hits
from gradflow.measurement.registration import SIGNATURE_EVERY


def accumulate(model, optimizer, gf, steps, micro, before_last_backward=None):
    """Each optimizer step over `micro` backward passes."""
    data = batches(steps * micro)
    for _step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for k in range(micro):
            tokens, target = next(data)
            loss = nn.functional.cross_entropy(model(tokens), target) / micro
            if k == micro - 1 and before_last_backward is not None:
                before_last_backward()
            loss.backward()
        optimizer.step()
        gf.step(loss=loss)


@pytest.mark.parametrize("hooks", ["c", "python"])
def test_hook_hits_count_every_backward_and_stay_zero_on_a_cut_module(gradflow_server, hooks):
    """Three micro-batches a step: every trained module is reached three times, the
    prompt encoder (cut by no_grad) never. The same counts whether the hooks are the
    list's C-level append or Python functions (a callback at the end of backward)."""
    model = PromptAgent(detach_prompt=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(
        model, optimizer, server=gradflow_server.url, run_id=new_run_id("hits"), on_alert=None
    )
    later = gf.read_grads_at_backward_end if hooks == "python" else None
    accumulate(model, optimizer, gf, 4, 3, before_last_backward=later)
    gf.close()
    assert gf.instruments.hooks._python_hooks is (hooks == "python")
    for module in ("agent.head", "agent.hidden"):
        hits = gradflow_server.series(gf.run_id, "hook_hits", module)
        assert [value for _, value in hits] == [3, 3, 3, 3], (module, hits)
    cut = gradflow_server.series(gf.run_id, "hook_hits", "qwen.layers.0.self_attn.q_proj")
    assert [value for _, value in cut] == [0, 0, 0, 0], cut
    norms = gradflow_server.series(gf.run_id, "grad_norm", "agent.head")
    assert len(norms) == 4 and all(value > 0 for _, value in norms), norms


def test_hits_are_counted_by_parameter_from_the_appended_list():
    a, b = torch.zeros(1), torch.zeros(1)
    assert count_hits([a, b, a, a]) == {id(a): 3, id(b): 1}
    assert count_hits([]) == {}


def hooked_modules(model: nn.Module) -> int:
    return sum(1 for m in model.modules() if m._forward_pre_hooks)


def test_the_cut_tracer_pauses_its_hooks_after_looking_and_puts_them_back(gradflow_server):
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bare = hooked_modules(model)
    # The instability signals' hooks come and go with their sampled steps: off here,
    # so that the count is the cut tracer's alone.
    gf = gradflow.watch(
        model,
        optimizer,
        server=gradflow_server.url,
        run_id=new_run_id("cut"),
        on_alert=None,
        signals=False,
    )
    armed = hooked_modules(model)
    assert armed > bare + 10  # the roots and every module that owns parameters
    after = []
    for tokens, target in batches(2 * FULL_EVERY):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(tokens), target)
        # Each group looked at its first module: the rest of its modules run bare.
        assert hooked_modules(model) < armed // 2
        loss.backward()
        optimizer.step()
        gf.step(loss=loss)
        after.append(hooked_modules(model))
    gf.close()
    assert hooked_modules(model) == bare
    # Put back after a step: the hooks that looked (each group's first modules), and
    # every hook on every FULL_EVERY-th step.
    looked = after[0]
    assert bare < looked < armed // 2, (bare, looked, armed)
    assert after == ([looked] * (FULL_EVERY - 1) + [armed]) * 2, after


class Block(nn.Module):
    """Two layers whose order a flag swaps: the block starts at `a`, or at `b`."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.swap = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.a(self.b(h)) if self.swap else self.b(self.a(h))


class DetachedBlock(nn.Module):
    """An embedding whose output is detached before a block: the block is cut off."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 8)
        self.block = Block()
        self.head = nn.Linear(8, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(tokens).mean(1).detach()))


def test_a_cut_where_a_group_now_starts_is_seen_within_the_full_put_back(gradflow_server):
    """The tracer's hooks that did not look are put back every FULL_EVERY-th step: a
    block whose modules swap order after the first step has its cut, now at the
    other module, reported by then, and each cut once."""
    model = DetachedBlock()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    gf = gradflow.watch(
        model,
        optimizer,
        server=gradflow_server.url,
        run_id=new_run_id("cut-moves"),
        on_alert=None,
        signals=False,
    )
    tracer = gf.instruments.tracer
    taken = []
    take = tracer.take

    def noted():
        cuts = take()
        taken.append([(c["module"], c["kind"]) for c in cuts])
        return cuts

    tracer.take = noted
    steps = FULL_EVERY + 4
    for step in range(steps):
        model.block.swap = step > 0
        optimizer.zero_grad()
        tokens = torch.randint(0, 50, (4, 6))
        loss = model(tokens).pow(2).mean()
        loss.backward()
        optimizer.step()
        gf.step(loss=loss)
    gf.close()
    reported = {step: cuts for step, cuts in enumerate(taken[:steps]) if cuts}
    assert reported == {
        0: [("block.a", "detached_input")],
        FULL_EVERY: [("block.b", "detached_input")],
    }, taken


def test_a_group_that_starts_elsewhere_gets_every_hook_back_after_its_step():
    """A resume of some names leaves the others out until a resume of them all."""
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    calls = []
    hooks = PausableForwardPreHooks()
    hooks.add(first, lambda module, args, kwargs: calls.append("first"), "g", "first")
    hooks.add(second, lambda module, args, kwargs: calls.append("second"), "g", "second")
    x = torch.zeros(1, 2)
    hooks.pause("g")
    hooks.resume(only={"first"})
    first(x)
    second(x)
    assert calls == ["first"]
    hooks.resume(only={"first"})  # nothing paused since: nothing moves
    second(x)
    assert calls == ["first"]
    hooks.resume()
    second(x)
    assert calls == ["first", "second"]


def test_paused_hooks_are_put_back_once_and_never_after_removal():
    layer = nn.Linear(2, 2)
    calls = []
    hooks = PausableForwardPreHooks()
    hooks.add(layer, lambda module, args, kwargs: calls.append("a"), "g")
    x = torch.zeros(1, 2)
    layer(x)
    hooks.pause("g")
    hooks.pause("missing")  # a key without hooks: nothing to do
    layer(x)
    assert calls == ["a"]
    hooks.resume()
    hooks.resume()
    layer(x)
    assert calls == ["a", "a"]
    hooks.pause("g")
    hooks.remove()
    hooks.resume()
    layer(x)
    assert calls == ["a", "a"] and not layer._forward_pre_hooks


def test_parked_hooks_run_only_while_their_key_is_switched_on():
    layer = nn.Linear(2, 2)
    calls = []
    hooks = ParkedForwardHooks()
    hooks.add_pre(layer, lambda module, args: calls.append("pre"), "a")
    hooks.add(layer, lambda module, args, out: calls.append("post"), "a", always_call=True)
    hooks.add(layer, lambda module, args, out: calls.append("other"), "b")
    x = torch.zeros(1, 2)
    layer(x)
    assert calls == [] and not layer._forward_hooks and not layer._forward_pre_hooks
    hooks.switch_on("a")
    hooks.switch_on("missing")  # a key without hooks: nothing to do
    layer(x)
    assert calls == ["pre", "post"]
    hooks.switch_off()
    hooks.switch_off()
    layer(x)
    assert calls == ["pre", "post"] and not layer._forward_hooks
    hooks.switch_on("b")
    layer(x)
    assert calls == ["pre", "post", "other"]
    hooks.remove()
    layer(x)
    assert calls == ["pre", "post", "other"]
    assert not layer._forward_hooks and not layer._forward_hooks_always_called


def test_the_signals_hooks_are_on_for_their_sampled_steps_only(gradflow_server):
    """Registered once, switched on at the gf.step before a sampled step and off at
    its own: the modules of the other steps run without them, and the watch's end
    leaves none."""
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def forward_hooked() -> int:
        return sum(1 for m in model.modules() if m._forward_hooks)

    bare = forward_hooked()
    gf = gradflow.watch(
        model,
        optimizer,
        server=gradflow_server.url,
        run_id=new_run_id("parked"),
        on_alert=None,
        signals={"activations": 2, "tokens": 0, "attention": 0, "adam": 0, "moe": 0},
    )
    seen = []
    for tokens, target in batches(4):
        seen.append(forward_hooked() - bare)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(tokens), target)
        loss.backward()
        optimizer.step()
        gf.step(loss=loss)
    gf.close()
    assert seen[0] > 0 and seen[2] == seen[0] and seen[1] == seen[3] == 0, seen
    assert forward_hooked() == bare
    run = gradflow_server.run(gf.run_id)
    assert run["step_count"] == 4


def test_a_hook_may_pause_its_own_module_while_it_runs():
    layer = nn.Linear(2, 2)
    hooks = PausableForwardPreHooks()
    seen = []

    def look(module, args, kwargs):
        seen.append(1)
        hooks.pause("g")

    hooks.add(layer, look, "g")
    layer(torch.zeros(1, 2))
    layer(torch.zeros(1, 2))
    assert seen == [1]


class Mixed(nn.Module):
    """Gradients of every kind the CPU read groups differently: a sparse embedding,
    small 1-D biases and norm weights (reduced together), a 1-D parameter past the
    small size, and matrices."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16, sparse=True)
        self.norm = nn.LayerNorm(16)
        self.proj = nn.Linear(16, 16)
        self.wide = nn.Parameter(torch.randn(measure.SMALL_ON_CPU + 5) * 0.01)
        self.head = nn.Linear(16, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.norm(self.embed(tokens))).tanh()
        return self.head(h).mean(1) + self.wide.sum()


def test_grad_norms_of_every_kind_match_a_direct_computation(gradflow_server):
    torch.manual_seed(0)
    model = Mixed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    gf = gradflow.watch(
        model, optimizer, server=gradflow_server.url, run_id=new_run_id("kinds"), on_alert=None
    )
    tokens = torch.randint(0, 50, (4, 6))
    model(tokens).pow(2).sum().backward()

    def norm(*params: torch.Tensor) -> float:
        squares = [
            (p.grad.coalesce().values() if p.grad.is_sparse else p.grad).double().pow(2).sum()
            for p in params
        ]
        return float(torch.stack(squares).sum().sqrt())

    expected = {
        "embed": norm(model.embed.weight),
        "norm": norm(model.norm.weight, model.norm.bias),
        "proj": norm(model.proj.weight, model.proj.bias),
        "wide": norm(model.wide),
        "head": norm(model.head.weight, model.head.bias),
    }
    optimizer.step()
    gf.step(loss=torch.tensor(1.0))
    gf.close()
    for module, want in expected.items():
        ((step, got),) = gradflow_server.series(gf.run_id, "grad_norm", module)
        assert step == 0 and abs(got - want) <= 1e-5 * want, (module, got, want)


def test_the_step_vector_is_assembled_on_the_reporter_thread_on_a_cpu():
    pieces = [
        torch.tensor([1.5]),
        [torch.tensor(2.0), torch.tensor(3.0)],
        torch.tensor([[4.0, 5.0]], dtype=torch.float64),
    ]
    host = vector.HostPieces(pieces, torch.float64)
    assert host.tolist() == [1.5, 2.0, 3.0, 4.0, 5.0]


def test_flat_keeps_the_order_of_every_element():
    one_d = [torch.arange(3.0), torch.arange(3.0, 5.0)]
    assert intended.flat(one_d).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    mixed = [torch.arange(2.0), torch.arange(2.0, 6.0).reshape(2, 2), torch.tensor([6.0])]
    assert intended.flat(mixed).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    matrices = [torch.arange(4.0).reshape(2, 2).t(), torch.arange(4.0, 6.0).reshape(1, 2)]
    assert intended.flat(matrices).tolist() == [0.0, 2.0, 1.0, 3.0, 4.0, 5.0]
    copied = intended.flat(one_d)
    copied.zero_()
    assert one_d[0].tolist() == [0.0, 1.0, 2.0]


def test_the_optimizer_state_is_looked_up_again_when_it_is_replaced():
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    states = intended.States(optimizer, params)
    assert states.get() == [{}, {}]  # no step yet: stand-ins, not kept
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    first = states.get()
    assert first[0] is optimizer.state[params[0]] and "exp_avg" in first[0]
    assert states.get()[1] is first[1]
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    again = states.get()
    assert again[0] is optimizer.state[params[0]] and again[0] is not first[0]


def test_a_change_after_the_gradient_read_is_amended_on_the_step_it_first_trains(
    gradflow_server,
):
    """The signature is read at most once a step, when the gradients are, and on
    any step whose parameters holding a gradient changed: a module unfrozen between
    optimizer.step() and gf.step() is amended on the next step, the first whose
    gradients it has; one unfrozen before the forward, on that step."""
    model = PromptAgent()
    model.agent.head.requires_grad_(False)
    model.agent.hidden.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gf = gradflow.watch(
        model, optimizer, server=gradflow_server.url, run_id=new_run_id("sig"), on_alert=None
    )
    for step, (tokens, target) in enumerate(batches(6)):
        if step == 4:
            model.agent.hidden.requires_grad_(True)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(tokens), target)
        loss.backward()
        optimizer.step()
        if step == 1:
            model.agent.head.requires_grad_(True)
        gf.step(loss=loss)
    gf.close()
    run = gradflow_server.run(gf.run_id)
    amended = {
        a["step"]: sorted(p["name"] for p in a["amend"]["params"]) for a in run["amendments"]
    }
    assert amended == {
        2: ["agent.head.bias", "agent.head.weight"],
        4: ["agent.hidden.bias", "agent.hidden.weight"],
    }, run["amendments"]


@pytest.mark.parametrize("every", [1, 2])
def test_norm_weights_are_measured_on_the_first_reports_then_every_fourth_step(
    gradflow_server, every
):
    """The norm weights' update, drift and intended update come on the first
    NORM_WEIGHTS_FIRST reported steps, then on every step number that is a multiple of
    the reporting interval rounded up to NORM_WEIGHTS_EVERY; the gradient norms on
    every reported step. Where they come, the intended update is the applied one."""
    model = PromptAgent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gf = gradflow.watch(
        model,
        optimizer,
        server=gradflow_server.url,
        run_id=new_run_id(f"norm-cadence-{every}"),
        on_alert=None,
        signals=False,
        every=every,
    )
    steps = 18
    accumulate(model, optimizer, gf, steps, 1)
    gf.close()
    reported = list(range(0, steps, every))
    period = every * -(-NORM_WEIGHTS_EVERY // every)
    measured = reported[:NORM_WEIGHTS_FIRST] + [
        s for s in reported[NORM_WEIGHTS_FIRST:] if s % period == 0
    ]
    assert measured == ([0, 1, 2, 3, 4, 8, 12, 16] if every == 1 else [0, 2, 4, 6, 8, 12, 16])
    name = "agent.norm.weight"
    assert [s for s, _ in gradflow_server.series(gf.run_id, "grad_norm", "agent")] == reported
    for metric in ("update_norm", "drift", "intended_update_norm"):
        points = gradflow_server.series(gf.run_id, metric, name)
        assert [s for s, _ in points] == measured, (metric, points)
    intended = gradflow_server.series(gf.run_id, "intended_update_norm", name)
    applied = gradflow_server.series(gf.run_id, "update_norm", name)
    for (_, want), (_, got) in zip(intended, applied):
        assert got > 0 and abs(want - got) <= 1e-4 * got, (intended, applied)


def test_a_change_no_gradient_shows_is_amended_within_the_signature_bound(gradflow_server):
    """A layer frozen while its gradient stays (zeroed, not set to None) leaves every
    parameter's gradient where it was: the periodic read of the signature amends it
    by SIGNATURE_EVERY steps after the step it was made in. A layer cast to another
    dtype while it trains is amended on the step of the cast, whose gradients come in
    the new dtype, though no periodic read falls on it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    gf = gradflow.watch(
        model, optimizer, server=gradflow_server.url, run_id=new_run_id("bound"), on_alert=None
    )
    x = torch.randn(4, 8)
    frozen_at, cast_at = 5, 11
    for step in range(cast_at + SIGNATURE_EVERY + 3):
        if step == frozen_at:
            model[0].requires_grad_(False)
        if step == cast_at:
            model[2].to(torch.bfloat16)
        optimizer.zero_grad(set_to_none=False)
        hidden = model[1](model[0](x)).to(model[2].weight.dtype)
        loss = model[2](hidden).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        gf.step(loss=loss)
    gf.close()
    run = gradflow_server.run(gf.run_id)
    specs = [(a["step"], p) for a in run["amendments"] for p in a["amend"].get("params", [])]
    frozen = [s for s, p in specs if p["name"] == "0.weight" and p["requires_grad"] is False]
    cast = [s for s, p in specs if p["name"] == "2.weight" and p.get("dtype") == "bf16"]
    assert frozen and frozen_at <= frozen[0] <= frozen_at + SIGNATURE_EVERY, run["amendments"]
    assert cast_at % SIGNATURE_EVERY != 0
    assert cast and cast[0] == cast_at, run["amendments"]
