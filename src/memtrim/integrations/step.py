"""One training step recorded from a trainer's callbacks: what the Hugging Face and Lightning
``MemtrimCallback``s share. The trainer calls :meth:`StepRecording.start` when the step begins and
:meth:`StepRecording.finish` when it has ended (forward, backward, optimizer step, zero_grad); finish
writes the trace, the HTML report and the findings, and gives the figures the callback logs.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass

from memtrim.api import Trace, track
from memtrim.report.files import write_text
from memtrim.report.json import diagnosis_json
from memtrim.units import format_bytes


@dataclass(frozen=True)
class StepFiles:
    """What :meth:`StepRecording.finish` wrote, each file atomically."""

    trace: str
    """The trace (``memtrim.load`` reads it; ``memtrim report FILE`` shows it)."""
    html: str
    """The HTML report: one self-contained file."""
    findings: str
    """The doctor's findings ("How to cut it"), as the trace's JSON lists them."""


def step_number(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(
            f"step must be a training step number, 1 or more (the first step is 1); got {step!r}"
        )
    return step


class StepRecording:
    """Records training step ``step`` (1 for the first) and writes it to ``output_dir``."""

    def __init__(self, step: int, output_dir: str) -> None:
        self.step = step_number(step)
        if not isinstance(output_dir, (str, os.PathLike)) or not str(output_dir):
            raise ValueError(f"output_dir must be a folder to write the trace to; got {output_dir!r}")
        self.output_dir = os.fspath(output_dir)
        self.trace: Trace | None = None
        """The recorded step once it has ended."""
        self.files: StepFiles | None = None
        self._recording: contextlib.ExitStack | None = None

    @property
    def recording(self) -> bool:
        return self._recording is not None

    def start(self) -> None:
        if self._recording is not None or self.trace is not None:
            return
        stack = contextlib.ExitStack()
        self.trace = stack.enter_context(track())
        self._recording = stack

    def finish(self, error: BaseException | None = None) -> StepFiles:
        """Stop recording, write the files, and say where they are. ``error``: the exception the step
        ended with (an out-of-memory error): the trace then holds the step up to it and names it."""
        assert self._recording is not None and self.trace is not None, "finish() before start()"
        stack, self._recording = self._recording, None
        if error is None:
            stack.close()
        else:  # the recorder sees the exception as if it had left its with-block
            stack.__exit__(type(error), error, error.__traceback__)
        os.makedirs(self.output_dir, exist_ok=True)
        base = os.path.join(self.output_dir, f"memtrim-step{self.step}")
        files = StepFiles(trace=base + ".json", html=base + ".html", findings=base + ".findings.json")
        self.trace.save(files.trace)
        self.trace.save_html(files.html)
        findings = [diagnosis_json(d) for d in self.trace.diagnoses()]
        write_text(files.findings, json.dumps(findings, indent=1) + "\n")
        self.files = files
        return files

    def metrics(self) -> dict[str, int]:
        """The step's figures as numbers for a trainer's metric loggers: the peak above the step's start
        and, per role, the bytes alive at the peak (made in the step or before it)."""
        assert self.trace is not None
        breakdown = self.trace.analysis.breakdown_at_peak
        roles = sorted(set(breakdown.made) | set(breakdown.preexisting), key=lambda r: -breakdown.total(r))
        out = {"memtrim/peak_bytes": self.trace.peak_bytes}
        out.update({f"memtrim/{role.value}_bytes_at_peak": breakdown.total(role) for role in roles})
        return out

    def lines(self) -> list[str]:
        """What the callback logs: the peak, the roles alive at it, the first finding, the files."""
        assert self.trace is not None and self.files is not None
        trace = self.trace
        breakdown = trace.analysis.breakdown_at_peak
        roles = sorted(set(breakdown.made) | set(breakdown.preexisting), key=lambda r: -breakdown.total(r))
        alive = ", ".join(
            f"{role.value} {format_bytes(breakdown.total(role))}" for role in roles if breakdown.total(role)
        )
        device = f" on {trace.peak.device}" if trace.peak.device else ""
        out = [
            f"memtrim: step {self.step} peaked at {format_bytes(trace.peak_bytes)} above its start{device} "
            f"({trace.peak_bytes:,} B)",
            f"memtrim: alive at the peak: {alive or 'nothing'}",
        ]
        if trace.error is not None:
            out.insert(0, f"memtrim: step {self.step} failed: {trace.error}")
        found = trace.diagnoses()
        if found:
            d = found[0]
            at = f" at {d.site.text(path_parts=2)}" if d.site else ""
            out.append(
                f"memtrim: how to cut it{at}: {d.fix} "
                f"(peak {format_bytes(d.peak_before)} -> {format_bytes(d.peak_after)})"
            )
        out.append(f"memtrim: wrote {self.files.trace}, {self.files.html}, {self.files.findings}")
        return out


class RecordedStep:
    """What every trainer callback shows of its :class:`StepRecording` (kept in ``self._recording``)."""

    _recording: StepRecording

    @property
    def step(self) -> int:
        return self._recording.step

    @property
    def trace(self) -> Trace | None:
        return self._recording.trace

    @property
    def files(self) -> StepFiles | None:
        return self._recording.files
