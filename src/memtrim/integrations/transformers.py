"""``MemtrimCallback`` for Hugging Face ``Trainer``: records one training step and writes its trace,
HTML report and findings (docs/pytest-and-trainers.md).

    trainer = Trainer(model, args, train_dataset=data, callbacks=[MemtrimCallback(step=2, output_dir="mem")])

Trainer calls ``on_step_begin`` after it has fetched the step's batch and ``on_step_end`` after the
optimizer step, the scheduler step and ``zero_grad()`` (transformers 5.17, ``Trainer._inner_training_loop``):
the recorded region is forward, backward, gradient clipping and the optimizer step, with every
micro-batch of gradient accumulation. Needs ``pip install 'memtrim[transformers]'``; ``import memtrim``
never imports this module.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.utils import logging

from memtrim.integrations.step import RecordedStep, StepRecording

# the Trainer's own logger: its lines obey TrainingArguments(log_level=...), as the Trainer's do
logger = logging.get_logger("transformers.trainer")


class MemtrimCallback(RecordedStep, TrainerCallback):
    """Record training step ``step`` (1 is the first, as ``TrainerState.global_step`` counts) of
    ``Trainer.train()`` and write ``memtrim-step{step}.json`` (the trace), ``.html`` (the report) and
    ``.findings.json`` (the doctor's findings) to ``output_dir``.

    When the step ends, the peak and the bytes of each role alive at it are logged at INFO through the
    Trainer's logger and added to ``state.log_history`` as ``memtrim/peak_bytes`` and
    ``memtrim/<role>_bytes_at_peak`` (saved with each checkpoint's ``trainer_state.json``).
    Afterwards ``callback.trace`` is the :class:`memtrim.Trace` and ``callback.files`` the paths.
    """

    def __init__(self, step: int = 1, output_dir: str = "memtrim") -> None:
        self._recording = StepRecording(step, output_dir)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # global_step counts the steps done: the step beginning now is global_step + 1
        if state.global_step + 1 == self.step and state.is_world_process_zero:
            self._recording.start()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._recording.recording:
            self._write(state)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._recording.files is None and state.is_world_process_zero:
            logger.warning(
                f"memtrim: step {self.step} was not recorded: training ran {state.global_step} steps "
                f"(MemtrimCallback(step=...) names one of them, 1 for the first)"
            )

    def failed(self, error: BaseException, state: TrainerState | None = None) -> None:
        """Write the step up to ``error`` when it ended the step — Trainer calls no callback then::

            try:
                trainer.train()
            except torch.OutOfMemoryError as error:
                callback.failed(error, trainer.state)  # memtrim-step{N}.json: what was alive at the failure
                raise

        Does nothing when the step was not being recorded."""
        if self._recording.recording:
            self._write(state, error)

    def _write(self, state: TrainerState | None, error: BaseException | None = None) -> None:
        self._recording.finish(error)
        for line in self._recording.lines():
            logger.info(line)
        if state is not None:
            state.log_history.append({**self._recording.metrics(), "step": self.step})
