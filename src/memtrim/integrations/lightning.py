"""``MemtrimCallback`` for Lightning's ``Trainer``: records one training step and writes its trace, HTML
report and findings (docs/pytest-and-trainers.md).

    trainer = L.Trainer(max_steps=100, callbacks=[MemtrimCallback(step=2, output_dir="mem")])

Lightning calls ``on_train_batch_start`` after the batch is on its device and ``on_train_batch_end``
after the optimizer's step (automatic optimization runs zero_grad, ``training_step``, backward and
``optimizer.step`` in between; pytorch-lightning 2.6): the recorded region is the step's every
micro-batch, from the first whose start sees ``trainer.global_step == step - 1`` to the end of the one
that made it ``step``. The class is a callback of each Lightning that is installed — ``lightning``
(``lightning.pytorch``) and ``pytorch_lightning`` — so either's Trainer takes it. Needs
``pip install 'memtrim[lightning]'``; ``import memtrim`` never imports this module.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from memtrim.integrations.step import RecordedStep, StepRecording


def _callback_classes() -> tuple[type, ...]:
    found = []
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            found.append(importlib.import_module(package).Callback)
        except ImportError:
            continue
    if not found:
        raise ImportError(
            "memtrim.integrations.lightning needs Lightning: pip install 'memtrim[lightning]' "
            "(or pip install lightning)"
        )
    return tuple(found)


_Callback = _callback_classes()
# under Lightning's own logger ("lightning.pytorch" or "pytorch_lightning"): INFO lines show by default,
# as its "GPU available: ..." lines do
logger = logging.getLogger(_Callback[0].__module__.partition(".callbacks")[0] + ".memtrim")


class MemtrimCallback(RecordedStep, *_Callback):  # type: ignore[misc]
    """Record training step ``step`` (1 is the first; ``trainer.global_step`` is the steps done) and
    write ``memtrim-step{step}.json`` (the trace), ``.html`` (the report) and ``.findings.json`` (the
    doctor's findings) to ``output_dir``.

    When the step ends, the peak and the bytes of each role alive at it are logged at INFO and sent to
    the Trainer's loggers (``trainer.loggers``: CSV, TensorBoard, ...) as ``memtrim/peak_bytes`` and
    ``memtrim/<role>_bytes_at_peak``, exact integers. When the step raises (an out-of-memory error),
    the trace up to the failure is written. Afterwards ``callback.trace`` is the :class:`memtrim.Trace`
    and ``callback.files`` the paths.
    """

    def __init__(self, step: int = 1, output_dir: str = "memtrim") -> None:
        super().__init__()
        self._recording = StepRecording(step, output_dir)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step + 1 == self.step and trainer.is_global_zero:
            self._recording.start()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # with gradient accumulation, the step's later micro-batches start with global_step still step - 1
        if self._recording.recording and trainer.global_step >= self.step:
            self._write(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._recording.recording:
            self._write(trainer, exception)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._recording.recording:  # the run ended inside the step (max_steps in an accumulation)
            self._write(trainer)
        if self._recording.files is None and trainer.is_global_zero:
            logger.warning(
                f"memtrim: step {self.step} was not recorded: training ran {trainer.global_step} steps "
                f"(MemtrimCallback(step=...) names one of them, 1 for the first)"
            )

    def _write(self, trainer: Any, error: BaseException | None = None) -> None:
        self._recording.finish(error)
        for line in self._recording.lines():
            logger.info(line)
        metrics = self._recording.metrics()
        for each in trainer.loggers:
            each.log_metrics(metrics, step=self.step)
