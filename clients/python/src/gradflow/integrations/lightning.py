"""gradflow for PyTorch Lightning: one callback.

    from gradflow.integrations.lightning import GradflowCallback
    trainer = lightning.Trainer(..., callbacks=[GradflowCallback()])

The callback watches the ``LightningModule``, the Trainer's first optimizer and its
precision plugin's loss scaler (``precision="16-mixed"``) when training starts, and
reports once per optimizer step:

- gradients as the step's last backward pass left them, before Lightning clips them
  (``gradient_clip_val``); under a loss scaler right after Lightning unscales them, so
  a spike shows its real size;
- with ``accumulate_grad_batches=k``, the gradients accumulated over the k
  micro-batches, and the mean of their losses (the loss ``training_step`` returned,
  before Lightning divides it by k for backward), kept on the device;
- the step number as Lightning counts optimizer steps (``trainer.global_step`` before
  the step, from 0, as ``self.log`` records it);
- with ``gradient_clip_val`` and the ``norm`` algorithm, the clip's ``max_norm`` as the
  step metric ``grad_clip_max_norm``: the gradients were read before that clip, and a
  norm above it reached the optimizer cut down to it.

Lightning runs ``training_step`` and backward inside ``optimizer.step(closure)`` (unless
a loss scaler is on), after the optimizer's step pre-hooks; the callback adds a pre-hook
of its own, ahead of gradflow's, that runs the closure first, so gradients are read
after backward and not the step before's. An ``LBFGS`` optimizer, which evaluates the
closure several times, is left alone: its gradients are read when it steps.

``lightning`` (``lightning.pytorch``) or the older ``pytorch_lightning`` package.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from .. import _log
from ..watcher import watch
from ._clip import clip_metrics

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package
    from pytorch_lightning import Callback

_CONFIG_KEYS = (
    "max_epochs",
    "max_steps",
    "accumulate_grad_batches",
    "gradient_clip_val",
    "gradient_clip_algorithm",
    "precision",
)


class GradflowCallback(Callback):  # type: ignore[misc]
    """Reports a Lightning ``Trainer`` run to a gradflow server. ``watch_options`` are
    those of :func:`gradflow.watch` (``groups``, ``train``, ``every``, ``on_alert``,
    ``detectors``, ``token``, ``name``…)."""

    def __init__(
        self, run_id: Optional[str] = None, server: Optional[str] = None, **watch_options: Any
    ) -> None:
        self.run_id = run_id
        self.server = server
        self.options = watch_options
        self.gf: Any = None
        self._closure_hook: Any = None
        self._loss_sum: Optional[torch.Tensor] = None
        self._loss_count = 0
        self._steps_done = 0
        self._metrics: Optional[Dict[str, float]] = None

    # -- Lightning's events ------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.gf is not None:
            return  # fit() again with the same callback: the run goes on
        optimizers = list(getattr(trainer, "optimizers", None) or [])
        optimizer = optimizers[0] if optimizers else None
        options: Dict[str, Any] = dict(self.options)
        options.setdefault("config", {"lightning": _config(trainer)})
        plugin = getattr(trainer, "precision_plugin", None)
        scaler = getattr(plugin, "scaler", None)
        if optimizer is not None and not isinstance(optimizer, torch.optim.LBFGS):
            self._run_closure_first(optimizer)
        self.gf = watch(
            pl_module, optimizer, scaler, run_id=self.run_id, server=self.server, **options
        )
        self._steps_done = int(trainer.global_step)
        self._metrics = clip_metrics(_norm_clip(trainer))
        if not getattr(self.gf, "enabled", False):
            self._remove_closure_hook()

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.gf is not None and _last_micro_batch(trainer, batch_idx):
            self._arm()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.gf is None:
            return
        self._add_loss(outputs)
        done = int(trainer.global_step)
        if done > self._steps_done:  # the optimizer stepped on this batch
            self.gf.step(loss=self._take_loss(), step=done - 1, metrics=self._metrics)
            self._steps_done = done

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.close()

    def close(self) -> None:
        """Delivers what is left and detaches; ``on_train_end`` calls it."""
        self._remove_closure_hook()
        if self.gf is not None:
            self.gf.close()

    # -- gradients ---------------------------------------------------------------

    @_log.guarded("arming the gradient read")
    def _arm(self) -> None:
        arm = getattr(self.gf, "read_grads_at_backward_end", None)
        if arm is not None:
            arm()

    @_log.guarded("installing the optimizer hook")
    def _run_closure_first(self, optimizer: torch.optim.Optimizer) -> None:
        def run_closure(_optimizer: Any, args: Any, kwargs: Any) -> Any:
            closure = kwargs.get("closure")
            if closure is None and args and callable(args[0]):
                closure, args = args[0], args[1:]
            if closure is None:
                return None
            with torch.enable_grad():
                result = closure()
            return tuple(args), {**kwargs, "closure": lambda: result}

        self._closure_hook = optimizer.register_step_pre_hook(run_closure)

    def _remove_closure_hook(self) -> None:
        if self._closure_hook is not None:
            self._closure_hook.remove()
            self._closure_hook = None

    # -- the loss ----------------------------------------------------------------

    @_log.guarded("reading the loss")
    def _add_loss(self, outputs: Any) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor) or loss.numel() == 0:
            return
        loss = loss.detach().float().mean()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._loss_count += 1

    def _take_loss(self) -> Optional[torch.Tensor]:
        total, count = self._loss_sum, self._loss_count
        self._loss_sum, self._loss_count = None, 0
        return None if total is None else total / count


def _last_micro_batch(trainer: Any, batch_idx: int) -> bool:
    """Whether this batch's backward is the last before an optimizer step (Lightning
    steps after every ``accumulate_grad_batches`` batches and after an epoch's last)."""
    every = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
    if (batch_idx + 1) % every == 0:
        return True
    batches = getattr(trainer, "num_training_batches", None)
    return isinstance(batches, int) and batch_idx + 1 >= batches


def _norm_clip(trainer: Any) -> Any:
    """The ``max_norm`` of the clip Lightning runs on every optimizer step, after the
    callback has read the gradients: ``gradient_clip_val`` under the ``norm`` algorithm
    (its default), None without one or under ``value``."""
    config = _config(trainer)
    algorithm = str(config.get("gradient_clip_algorithm") or "norm").lower()
    return config.get("gradient_clip_val") if algorithm.endswith("norm") else None


def _config(trainer: Any) -> Dict[str, Any]:
    out = {}
    for key in _CONFIG_KEYS:
        value = getattr(trainer, key, None)
        if value is None and key in ("gradient_clip_val", "gradient_clip_algorithm"):
            value = getattr(getattr(trainer, "_accelerator_connector", None), key, None)
        if key == "precision":
            value = getattr(getattr(trainer, "precision_plugin", None), "precision", None)
        out[key] = value if value is None or isinstance(value, (bool, int, float)) else str(value)
    return out
