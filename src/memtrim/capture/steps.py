"""Recording only chosen training steps, so that a run of hours costs memory and time only there.

A region records every op: about 330 bytes each kept until the trace is dropped (README, "Limits"),
so a multi-hour run would keep gigabytes. ``record(steps=range(a, b))`` records steps ``a`` to
``b - 1`` of the region and nothing else: a step ends when an optimizer's ``step()`` returns (a global
optimizer post-hook counts them; step 0 starts when the region opens). Outside the window the
recorder is off the dispatch-mode stack, so the program runs at full speed; storages alive when the
window opens count as from before it (as at a region's start), and the window's trace ends when
step ``b - 1`` does (what is alive then is its output).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from memtrim.trace.model import TraceLog

if TYPE_CHECKING:
    from memtrim.capture.recorder import Recorder

STEPS_KEY = "steps"
"""The :attr:`TraceLog.metadata` key of ``[first, stop, steps the window saw]``."""


class StepWindow:
    """Attach ``mode`` for the optimizer steps in ``steps``; ``on_open``/``on_close`` run at the
    window's ends (the CUDA peak watch)."""

    def __init__(
        self,
        mode: Recorder,
        log: TraceLog,
        steps: range,
        *,
        finish: Callable[[], None],
        on_open: Callable[[], None],
        on_close: Callable[[], None],
    ) -> None:
        if steps.step != 1 or steps.start < 0 or steps.stop <= steps.start:
            raise ValueError(
                f"steps must be a non-empty range(first, stop) of step numbers from 0, got {steps!r}"
            )
        self.mode, self.log, self.steps = mode, log, steps
        self._finish, self._on_open, self._on_close = finish, on_open, on_close
        self.done = 0  # optimizer steps completed in the region
        self.state = "waiting"
        self._thread = threading.get_ident()
        self._handle = register_optimizer_step_post_hook(self._after_step)
        log.metadata[STEPS_KEY] = [steps.start, steps.stop, 0]

    def begin(self) -> None:
        """The region opened (``mode`` is on the stack): step 0 starts now."""
        if self.steps.start == 0:
            self._open()
        else:
            self.mode.detach()
            self.mode.set_recording(False)

    def _open(self) -> None:
        self.state = "recording"
        self._on_open()
        if self.mode._detached:
            self.mode.attach()
        self.mode.set_recording(True)

    def _close(self) -> None:
        if self.state != "recording":
            return
        self.state = "closed"
        self.mode.detach()
        self._finish()
        self._on_close()

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if threading.get_ident() != self._thread or self.state == "closed":
            return  # another thread's optimizer: not this region's steps
        self.done += 1
        if self.state == "recording":
            self.log.metadata[STEPS_KEY][2] += 1
        if self.done == self.steps.stop:
            self._close()
        elif self.done == self.steps.start:
            self._open()

    def end(self) -> None:
        """The region closes (also by an exception inside the window: the trace ends there)."""
        self._handle.remove()  # not from inside the hook: the optimizer iterates the hooks then
        self._close()
