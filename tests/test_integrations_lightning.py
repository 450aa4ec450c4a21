"""``memtrim.integrations.lightning.MemtrimCallback`` on a real Lightning ``Trainer`` (tiny GPT-2, CPU,
random weights): the recorded step's peak against torch.profiler's for the same region, the roles at
the peak against the model's own tensors, the files, the log lines and the metrics the loggers get."""

from __future__ import annotations

import csv
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from groundtruth import _peak, memtrim_deltas
from models import _gpt2, nbytes, new_optimizer
from trainer_support import Profile, Tokens

pytorch_lightning = pytest.importorskip("pytorch_lightning")

import memtrim  # noqa: E402
from memtrim.analysis.roles import Role  # noqa: E402
from memtrim.integrations.lightning import MemtrimCallback  # noqa: E402


class TinyGPT2(pytorch_lightning.LightningModule):
    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.model = _gpt2()
        self.fail_at = fail_at

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        if self.fail_at is not None and self.global_step + 1 == self.fail_at:
            raise RuntimeError("planted failure after the forward")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return new_optimizer(self.model)


class ProfiledCallback(MemtrimCallback):
    """The callback with torch.profiler opened before its step begins and closed after it ends."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.profile = Profile()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step + 1 == self.step:
            self.profile.open()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.profile.close()


def _fit(callback: Any, folder: Path, *, steps: int = 3, module: Any = None) -> Any:
    torch.manual_seed(0)
    module = module or TinyGPT2()
    trainer = pytorch_lightning.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, callbacks=[callback], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        logger=pytorch_lightning.loggers.CSVLogger(str(folder), name="run", version=0), log_every_n_steps=1,
    )  # fmt: skip
    data = torch.utils.data.DataLoader(Tokens(), batch_size=2)
    trainer.fit(module, data)
    return trainer


@pytest.mark.parametrize("step", [1, 2])
def test_the_recorded_step_peaks_as_torch_profiler_saw_it(step: int, tmp_path: Path) -> None:
    callback = ProfiledCallback(step=step, output_dir=str(tmp_path / "memtrim"))
    trainer = _fit(callback, tmp_path)
    trace, truth = callback.trace, callback.profile.truth
    assert trace is not None and truth is not None and trace.finished and trace.error is None
    assert truth.peak_in_window > 100_000  # the step's gradients alone are 119,296 B
    model = trainer.lightning_module.model
    params = nbytes(model.parameters())
    # Lightning's zero_grad runs inside the step, after the forward: from step 2 on it frees the last
    # step's gradients, blocks from before the profile whose frees the profiler cannot see (or size).
    # Like for like: memtrim's events without those frees peak where the profiler's in-window ones do.
    freed_before = [a for a in trace.allocations if a.preexisting and a.free_tick is not None]
    assert sum(a.bytes for a in freed_before) == (0 if step == 1 else params)
    assert {trace.role(a) for a in freed_before if a.bytes} <= {"gradient"}
    assert _peak(memtrim_deltas(trace, preexisting_frees=False)) == truth.peak_in_window
    if step == 1:
        assert trace.peak_bytes == truth.peak
    assert {"forward", "backward", "optimizer"} <= {p.value for p in trace.analysis.peak_by_phase}
    optimizer = trainer.optimizers[0]
    state = nbytes(t for per_param in optimizer.state.values() for t in per_param.values())
    assert state == 2 * params + 4 * len(optimizer.state)  # AdamW: two moments and a step count
    at_peak = trace.analysis.breakdown_at_peak
    assert at_peak.total(Role.PARAMETER) == at_peak.preexisting[Role.PARAMETER] == params
    if step == 1:
        assert at_peak.made[Role.GRADIENT] == params
        assert at_peak.made[Role.OPTIMIZER_STATE] == state
    else:
        assert at_peak.preexisting[Role.OPTIMIZER_STATE] == state
    # the loggers got the figures as exact integers, at the recorded step
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("memtrim/peak_bytes")]
    assert [(int(row["step"]), int(row["memtrim/peak_bytes"])) for row in rows] == [(step, trace.peak_bytes)]
    assert int(rows[0]["memtrim/parameter_bytes_at_peak"]) == params


def test_it_writes_trace_html_findings_and_logs_through_lightning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    callback = MemtrimCallback(step=2, output_dir=str(tmp_path / "memtrim"))
    with caplog.at_level(logging.INFO, logger="pytorch_lightning"):
        _fit(callback, tmp_path)
    assert callback.files is not None and callback.trace is not None
    assert sorted(os.listdir(tmp_path / "memtrim")) == [
        "memtrim-step2.findings.json",
        "memtrim-step2.html",
        "memtrim-step2.json",
    ]
    assert memtrim.load(callback.files.trace).peak_bytes == callback.trace.peak_bytes
    assert Path(callback.files.html).read_text().lstrip().lower().startswith("<!doctype html")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memtrim:")]
    assert lines[0].startswith("memtrim: step 2 peaked at ")
    assert f"({callback.trace.peak_bytes:,} B)" in lines[0]
    assert lines[1].startswith("memtrim: alive at the peak: ")
    assert lines[-1].startswith("memtrim: wrote ")


def test_a_step_that_raises_is_written_up_to_the_failure(tmp_path: Path) -> None:
    callback = MemtrimCallback(step=2, output_dir=str(tmp_path / "memtrim"))
    with pytest.raises(RuntimeError, match="planted failure"):
        _fit(callback, tmp_path, module=TinyGPT2(fail_at=2))
    assert callback.trace is not None and callback.files is not None
    assert callback.trace.error == "RuntimeError: planted failure after the forward"
    saved = memtrim.load(callback.files.trace)
    assert saved.error == callback.trace.error
    # the recorder has stopped: what runs now is not recorded
    ops = len(callback.trace.ops)
    torch.ones(8) + 1
    assert len(callback.trace.ops) == ops
