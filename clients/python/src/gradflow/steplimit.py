"""``gradflow check --steps N``, inside the script it runs.

``gradflow check`` sets ``GRADFLOW_MAX_STEPS``; :func:`gradflow.watch` then puts a
:class:`StepLimit` on the watcher it returns, which closes the watcher after the N-th
``gf.step`` and ends the script with status 0. ``gf.step`` itself knows nothing of
it: it only calls the watcher's step listeners.
"""

from __future__ import annotations

import os
from typing import Optional

from ._log import say
from .api import Watch

MAX_STEPS_ENV = "GRADFLOW_MAX_STEPS"


class StepLimit:
    """Ends the script after `steps` calls of ``gf.step``."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.taken = 0

    @classmethod
    def from_env(cls) -> Optional[StepLimit]:
        """The limit ``gradflow check`` set; None when unset or not a positive integer."""
        try:
            steps = int(os.environ.get(MAX_STEPS_ENV, ""))
        except ValueError:
            return None
        return cls(steps) if steps > 0 else None

    def __call__(self, watcher: Watch) -> None:
        self.taken += 1
        if self.taken >= self.steps:
            watcher.close()
            say(f"stopping the script after {self.taken} steps ({MAX_STEPS_ENV})")
            raise SystemExit(0)
