"""Integrations with training frameworks: ``gradflow.integrations.transformers``
(the Hugging Face ``Trainer``) and ``gradflow.integrations.lightning`` (PyTorch
Lightning).

Each submodule imports its framework, so neither is imported here: naming one
(``gradflow.integrations.lightning.GradflowCallback``) loads it on first use, and
``import gradflow.integrations`` works where neither framework is installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, List

if TYPE_CHECKING:
    from . import lightning, transformers

__all__ = ["lightning", "transformers"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        # import_module also sets the attribute on this package.
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'gradflow.integrations' has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
