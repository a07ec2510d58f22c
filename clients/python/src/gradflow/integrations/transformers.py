"""gradflow for the Hugging Face ``Trainer``: one callback.

    from gradflow.integrations.transformers import GradflowCallback
    trainer = Trainer(model, args, train_dataset=..., callbacks=[GradflowCallback()])

The callback watches the model and optimizer the Trainer built (the loss scaler too,
under ``fp16=True``) when training begins, and reports once per optimizer step:

- gradients as the last backward pass of the step left them, before the Trainer clips
  them to ``max_grad_norm`` (under ``fp16`` right after unscaling), so a spike shows
  its real size;
- the loss of the step: the model's ``loss`` output of every training micro-batch,
  combined as the Trainer combines them for backward (summed when the model normalised
  it by the step's token count, averaged otherwise), kept on the device;
- the step number as the Trainer counts it (``state.global_step``, from 1);
- with ``max_grad_norm`` above 0 (1.0 by default), the clip's bound as the step metric
  ``grad_clip_max_norm``: a norm above it reached the optimizer cut down to it.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from transformers import TrainerCallback

from .. import _log
from ..api import Watch
from ..watcher import watch
from ._clip import clip_metrics

_CONFIG_KEYS = (
    "learning_rate",
    "weight_decay",
    "max_grad_norm",
    "gradient_accumulation_steps",
    "per_device_train_batch_size",
    "lr_scheduler_type",
    "warmup_steps",
    "bf16",
    "fp16",
    "optim",
    "seed",
)


class GradflowCallback(TrainerCallback):
    """Reports a ``Trainer`` run to a gradflow server. ``watch_options`` are those of
    :func:`gradflow.watch` (``groups``, ``train``, ``every``, ``on_alert``,
    ``detectors``, ``token``…); ``name`` defaults to ``args.run_name``."""

    def __init__(
        self, run_id: Optional[str] = None, server: Optional[str] = None, **watch_options: Any
    ) -> None:
        self.run_id = run_id
        self.server = server
        self.options = watch_options
        self.gf: Optional[Watch] = None
        self._loss_hook: Any = None
        self._loss_sum: Optional[torch.Tensor] = None
        self._loss_count = 0
        self._loss_summed = False
        self._accumulation = 1
        self._micro = 0
        self._metrics: Optional[Dict[str, float]] = None

    # -- the Trainer's events ----------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if self.gf is not None or model is None:
            return  # train() again on the same callback: the run goes on
        options: Dict[str, Any] = dict(self.options)
        options.setdefault("name", getattr(args, "run_name", None))
        options.setdefault(
            "config", {"trainer": {k: _plain(getattr(args, k, None)) for k in _CONFIG_KEYS}}
        )
        # Under fp16 the Trainer's scaler lives on Accelerate's optimizer wrapper.
        scaler = getattr(optimizer, "scaler", None)
        self.gf = watch(model, optimizer, scaler, run_id=self.run_id, server=self.server, **options)
        if not self.gf.enabled:
            return
        self._accumulation = max(1, int(getattr(args, "gradient_accumulation_steps", 1) or 1))
        self._metrics = clip_metrics(getattr(args, "max_grad_norm", None))
        self._hook_loss(model)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._micro = 0
        if self._accumulation == 1:
            self._arm()

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # After each micro-batch but the last: the next backward is the step's last.
        self._micro += 1
        if self._micro == self._accumulation - 1:
            self._arm()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.gf is None:
            return
        self.gf.step(loss=self._take_loss(), step=int(state.global_step), metrics=self._metrics)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Delivers what is left and detaches; ``on_train_end`` calls it."""
        if self._loss_hook is not None:
            self._loss_hook.remove()
            self._loss_hook = None
        if self.gf is not None:
            self.gf.close()

    # -- the loss ----------------------------------------------------------------

    @_log.guarded("arming the gradient read")
    def _arm(self) -> None:
        if self.gf is not None:
            self.gf.read_grads_at_backward_end()

    @_log.guarded("installing the loss hook")
    def _hook_loss(self, model: torch.nn.Module) -> None:
        self._loss_hook = model.register_forward_hook(self._on_forward, with_kwargs=True)

    @_log.guarded("reading the loss")
    def _on_forward(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        if not module.training or not torch.is_grad_enabled():
            return  # evaluation, or a forward the Trainer does not backpropagate
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor) or loss.numel() == 0:
            return
        loss = loss.detach().float().mean()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._loss_count += 1
        # The Trainer passes num_items_in_batch to a model that takes loss kwargs; the
        # model then divides by the whole step's token count, and the micro-batch losses
        # add up to the step's loss (otherwise each is a mean and the Trainer averages).
        if kwargs.get("num_items_in_batch") is not None:
            self._loss_summed = True

    def _take_loss(self) -> Optional[torch.Tensor]:
        total, count, summed = self._loss_sum, self._loss_count, self._loss_summed
        self._loss_sum, self._loss_count, self._loss_summed = None, 0, False
        if total is None:
            return None
        return total if summed else total / count


def _plain(value: Any) -> Any:
    """A value the registration's JSON can hold (enums as their value)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(getattr(value, "value", value))
