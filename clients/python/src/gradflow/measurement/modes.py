"""Whether the model's training flag changes what it computes, as far as PyTorch's
own modules show: the registration's ``mode_dependent_modules`` (protocol v1.9), and
whether the model computes in training mode at a step (the ``model_training`` metric:
its flag, and since v1.10 its mode-dependent modules too).

A model left in eval mode trains differently only through modules that read the
flag. PyTorch's own are known: dropout with ``p > 0``, batch and instance norm that
keep running statistics (without them they normalise by the batch in both modes),
and the recurrent layers and attention whose ``dropout`` is above 0. A user's module
may read ``self.training`` too, which no walk of the model can see: the count says
what is known, and the server words its verdict that way.
"""

from __future__ import annotations

from typing import List, Optional

from torch import nn

# Batch and instance norm (SyncBatchNorm and the lazy ones included).
_NORMS = nn.modules.batchnorm._NormBase
_WITH_DROPOUT_RATE = (nn.RNNBase, nn.MultiheadAttention)


def mode_dependent_modules(model: nn.Module) -> Optional[int]:
    """How many of `model`'s modules are PyTorch's own whose behaviour depends on
    the training flag; None when the model cannot be walked (nothing is said)."""
    try:
        return sum(1 for module in model.modules() if _depends_on_mode(module))
    except Exception:  # an odd module never stops the registration
        return None


def mode_dependent(model: nn.Module) -> List[nn.Module]:
    """`model`'s modules that are PyTorch's own and read the training flag (empty
    when the model cannot be walked)."""
    try:
        return [module for module in model.modules() if _depends_on_mode(module)]
    except Exception:
        return []


def computes_in_training_mode(model: nn.Module, dependent: List[nn.Module]) -> bool:
    """Whether `model` computes as in training mode: its flag is on and, when it holds
    modules that read the flag (`dependent`), at least one of them is in training
    mode. An evaluation helper that switched every encoder to eval (`enc.eval()`)
    while the wrapper's flag stayed on leaves the model computing in eval mode
    (fartashf/vsepp#4's `val_start`)."""
    if not model.training:
        return False
    return not dependent or any(module.training for module in dependent)


def _depends_on_mode(module: nn.Module) -> bool:
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    if isinstance(module, _NORMS):
        # Without running statistics they normalise by the batch in both modes.
        return getattr(module, "running_mean", None) is not None
    if isinstance(module, _WITH_DROPOUT_RATE):
        return float(getattr(module, "dropout", 0.0)) > 0
    return False
