"""memtrim pauses Python's cycle collector only while it works on a trace, and leaves it as it was."""

from __future__ import annotations

import gc

import torch

import memtrim
from memtrim.trace.collector import collector_paused


def test_the_collector_is_back_after_each_step_even_when_the_block_raises() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    try:
        with collector_paused():
            raise KeyError("inside")
    except KeyError:
        pass
    assert gc.isenabled()


def test_a_caller_that_turned_the_collector_off_keeps_it_off() -> None:
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_tracking_analysing_and_saving_leave_the_collector_on(tmp_path) -> None:
    with memtrim.track() as trace:
        torch.nn.Linear(4, 4)(torch.randn(2, 4)).sum().backward()
    trace.diagnoses()
    trace.save(str(tmp_path / "t.json"))
    trace.save_html(str(tmp_path / "t.html"))
    memtrim.load(str(tmp_path / "t.json")).report()
    assert gc.isenabled()
