"""Whether the loop calls ``gf.step`` where the quickstart says: once per optimizer
step, after it. Two misuses shift every record without any error:

- ``gf.step`` before the iteration's backward or optimizer step: each record holds
  the previous iteration's gradients, one step late. Seen as a forward pass with
  gradients between the last optimizer step and ``gf.step``, every step.
- ``gf.step`` more than once per optimizer step (after every micro-batch): step
  numbers, and every threshold counted in steps, grow by that factor. Seen as calls
  with no optimizer step since the previous one.

Each is said once, after it has held for a few steps. Host-side counters only.
"""

from __future__ import annotations

from typing import Callable, Set

# Steps a shape must hold before it is said.
PERSIST = 3


class LoopShape:
    def __init__(self, notify: Callable[[str], None]) -> None:
        self.notify = notify
        self.calls = 0
        self.without_step = 0
        self.with_step = 0
        self.early = 0
        self._told: Set[str] = set()

    def observe(self, optimizer_steps: int, forward_after_step: bool) -> None:
        """One ``gf.step``: the optimizer steps (taken or skipped by a loss scaler)
        since the previous call, and whether a forward pass with gradients ran after
        the last of them."""
        self.calls += 1
        if optimizer_steps == 0:
            self.without_step += 1
        else:
            self.with_step += 1
            if forward_after_step:
                self.early += 1
        if (
            "often" not in self._told
            and self.without_step >= PERSIST
            and 2 * self.without_step >= self.calls
        ):
            self._told.add("often")
            self.notify(
                f"gf.step was called {self.calls} times for {self.with_step} optimizer steps: "
                "call it once per optimizer step, after optimizer.step() (and "
                "scaler.update()); under gradient accumulation after the step that ends the "
                "accumulation, not after every micro-batch. Until then the step numbers, "
                "and every verdict counted in steps, are off by that factor."
            )
        if (
            "early" not in self._told
            and self.early >= PERSIST
            and self.early == self.with_step
            and self.without_step <= 1  # the first call only: not the shape above
        ):
            self._told.add("early")
            self.notify(
                "gf.step runs before the optimizer step of its iteration (a forward pass "
                f"came after the last optimizer step on each of the last {self.early} calls): "
                "every record holds the previous iteration's gradients, one step late. Call "
                "gf.step(loss=loss) after loss.backward() and optimizer.step()."
            )
