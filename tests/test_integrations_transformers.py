"""``memtrim.integrations.transformers.MemtrimCallback`` on a real Hugging Face ``Trainer`` (tiny
GPT-2, CPU, random weights): the recorded step's peak against torch.profiler's for the same region,
the roles at the peak against the model's own tensors, the files and the log lines."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from models import _gpt2, nbytes
from trainer_support import Profile, Tokens

import memtrim
from memtrim.analysis.roles import Role
from memtrim.integrations.transformers import MemtrimCallback
from memtrim.units import format_bytes


class ProfiledCallback(MemtrimCallback):
    """The callback with torch.profiler opened before its step begins and closed after it ends."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.profile = Profile()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step + 1 == self.step:
            self.profile.open()
        super().on_step_begin(args, state, control, **kwargs)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        super().on_step_end(args, state, control, **kwargs)
        self.profile.close()


def _trainer(
    callback: transformers.TrainerCallback,
    folder: Path,
    *,
    steps: int = 3,
    model: torch.nn.Module | None = None,
) -> transformers.Trainer:
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(folder / "run"), max_steps=steps, per_device_train_batch_size=2, use_cpu=True,
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, log_level="info",
        dataloader_num_workers=0,
    )  # fmt: skip
    model = model or _gpt2()
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])


def _train(callback: transformers.TrainerCallback, folder: Path, *, steps: int = 3) -> transformers.Trainer:
    trainer = _trainer(callback, folder, steps=steps)
    trainer.train()
    return trainer


@pytest.mark.parametrize("step", [1, 2])
def test_the_recorded_step_peaks_as_torch_profiler_saw_it(step: int, tmp_path: Path) -> None:
    callback = ProfiledCallback(step=step, output_dir=str(tmp_path / "memtrim"))
    trainer = _train(callback, tmp_path)
    trace, truth = callback.trace, callback.profile.truth
    assert trace is not None and truth is not None and trace.finished
    assert truth.peak > 100_000  # the step's gradients alone are 119,296 B
    assert trace.peak_bytes == truth.peak
    # the region is the whole step: forward, backward and the optimizer's step
    assert {"forward", "backward", "optimizer"} <= {p.value for p in trace.analysis.peak_by_phase}
    # alive at the peak, against the program's own tensors: the parameters (from before the step);
    # in step 1 (peak in the optimizer's step) every gradient and the AdamW state it makes (two moments
    # and a step count per parameter); in step 2 that state is from before the step
    params = nbytes(trainer.model.parameters())
    state = nbytes(t for per_param in trainer.optimizer.state.values() for t in per_param.values())
    assert state == 2 * params + 4 * len(trainer.optimizer.state)
    at_peak = trace.analysis.breakdown_at_peak
    assert at_peak.total(Role.PARAMETER) == at_peak.preexisting[Role.PARAMETER] == params
    if step == 1:
        assert at_peak.made[Role.GRADIENT] == params
        assert at_peak.made[Role.OPTIMIZER_STATE] == state
    else:
        assert at_peak.preexisting[Role.OPTIMIZER_STATE] == state
    logged = [h for h in trainer.state.log_history if "memtrim/peak_bytes" in h]
    assert logged == [{**callback._recording.metrics(), "step": step}]
    assert logged[0]["memtrim/peak_bytes"] == truth.peak
    assert logged[0]["memtrim/parameter_bytes_at_peak"] == params


def test_it_writes_trace_html_findings_and_logs_through_the_trainer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    callback = MemtrimCallback(step=2, output_dir=str(tmp_path / "memtrim"))
    trainer = _train(callback, tmp_path)  # log_level="info": the Trainer's logger shows INFO lines
    assert callback.files is not None
    names = sorted(os.listdir(tmp_path / "memtrim"))
    assert names == ["memtrim-step2.findings.json", "memtrim-step2.html", "memtrim-step2.json"]
    saved = memtrim.load(callback.files.trace)
    assert saved.peak_bytes == callback.trace.peak_bytes  # type: ignore[union-attr]
    assert Path(callback.files.html).read_text().lstrip().lower().startswith("<!doctype html")
    findings = json.loads(Path(callback.files.findings).read_text())
    assert [f["rule"] for f in findings] == [d.rule for d in callback.trace.diagnoses()]  # type: ignore[union-attr]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memtrim:")]
    peak = callback.trace.peak_bytes  # type: ignore[union-attr]
    assert lines[0].startswith("memtrim: step 2 peaked at ") and f"({peak:,} B)" in lines[0]
    params = nbytes(trainer.model.parameters())
    assert lines[1].startswith("memtrim: alive at the peak: optimizer_state ")
    assert f", parameter {format_bytes(params)}, " in lines[1]
    assert lines[2].startswith("memtrim: how to cut it at ")  # a finding: checkpoint the GPT-2 blocks
    assert (
        lines[-1]
        == f"memtrim: wrote {callback.files.trace}, {callback.files.html}, {callback.files.findings}"
    )


def test_a_step_the_run_never_reaches_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    callback = MemtrimCallback(step=5, output_dir=str(tmp_path / "memtrim"))
    _train(callback, tmp_path, steps=2)
    assert callback.trace is None and not (tmp_path / "memtrim").exists()
    assert "memtrim: step 5 was not recorded: training ran 2 steps" in caplog.text


def test_failed_writes_the_step_up_to_the_error(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _gpt2()
    forward, calls = model.forward, []

    @functools.wraps(forward)
    def failing_forward(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        out = forward(*args, **kwargs)
        if len(calls) == 2:
            raise RuntimeError("planted failure after the forward")
        return out

    model.forward = failing_forward  # type: ignore[method-assign]
    callback = MemtrimCallback(step=2, output_dir=str(tmp_path / "memtrim"))
    trainer = _trainer(callback, tmp_path, model=model)
    with pytest.raises(RuntimeError, match="planted failure"):
        try:
            trainer.train()
        except RuntimeError as error:
            callback.failed(error, trainer.state)
            raise
    assert callback.trace is not None and callback.files is not None
    assert callback.trace.error == "RuntimeError: planted failure after the forward"
    assert memtrim.load(callback.files.trace).error == callback.trace.error
    assert trainer.state.log_history[-1]["memtrim/peak_bytes"] == callback.trace.peak_bytes
    ops = len(callback.trace.ops)
    torch.ones(8) + 1  # the recorder has stopped
    assert len(callback.trace.ops) == ops


@pytest.mark.parametrize("step", [0, -1, 1.0, True, "2"])
def test_a_bad_step_is_refused_naming_what_it_should_be(step: object) -> None:
    with pytest.raises(ValueError, match="step must be a training step number, 1 or more"):
        MemtrimCallback(step=step, output_dir="unused")  # type: ignore[arg-type]
