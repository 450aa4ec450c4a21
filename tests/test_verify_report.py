"""VerifyReport renderings, memory side by side, cancellation probes and the progress bar."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from memtrim.analysis import Footprint as Memory
from memtrim.units import format_bytes
from memtrim.verify import CancellationProbe, VerifyReport, verify

FAST: dict[str, Any] = {"memory": False, "progress": False, "seeds": (0,), "dtypes": ("fp32", "bf16")}


def broadcast(z: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    return (z[..., None] * W).sum(-2)


def einsum(z: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    return torch.einsum("...hd,hdm->...hm", z, W)


def zw() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(6, 2, 8, requires_grad=True), torch.randn(2, 8, 5, requires_grad=True)


@pytest.fixture(scope="module")
def passing() -> VerifyReport:
    return verify(broadcast, einsum, zw(), **FAST)


@pytest.fixture(scope="module")
def failing() -> VerifyReport:
    return verify(broadcast, lambda z, W: einsum(z, W) * 1.01, zw(), **FAST)


def test_json_round_trips_and_names_everything(passing: VerifyReport, failing: VerifyReport) -> None:
    d = json.loads(passing.to_json())
    assert d["schema"] == "memtrim.verify/1" and d["passed"] is True and d["failures"] == []
    assert len(d["cases"]) == len(passing.cases) == 8
    q = d["cases"][0]["quantities"][0]
    assert {"name", "rule", "norm_err", "budget_used", "assert_close", "u_acc"} <= set(q)
    f = json.loads(failing.to_json())
    assert f["passed"] is False and f["failures"][0]["case"] == "float32/contiguous/seed=0"
    # The JSON index is the in-memory one (a tuple) as a list of ints, and points inside the output.
    index = f["failures"][0]["details"]["offending"][0]["index"]
    in_memory = failing.failures[0].details["offending"][0]["index"]
    assert isinstance(in_memory, tuple) and index == list(in_memory)
    assert len(index) == 3 and all(0 <= i < n for i, n in zip(index, (6, 2, 5), strict=True))


def test_markdown_has_a_table_and_the_failures(failing: VerifyReport) -> None:
    md = failing.to_markdown()
    assert md.startswith("**memtrim.verify: FAILED**")
    assert "| case | result | held |" in md and "| float32/contiguous/seed=0 | failed" in md
    assert "Failures:" in md and "exceed the rounding budget" in md


def test_terminal_table_and_summary(passing: VerifyReport, failing: VerifyReport) -> None:
    text = passing.render(width=200)
    assert (
        "float32/noncontiguous/seed=0" in text and "PASSED: 8 cases ran in " in text and "(auto mode)" in text
    )
    lines = str(failing).splitlines()
    header = next(i for i, ln in enumerate(lines) if "case" in ln and "result" in ln and "held" in ln)
    summary = next(i for i, ln in enumerate(lines) if ln.startswith("FAILED: 8 cases ran in "))
    assert header < summary  # the table, then the verdict, then each failure with its case
    after = lines[summary + 1 :]
    assert after[0].startswith("  x output: ") and "(case float32/contiguous/seed=0)" in " ".join(after)


def test_every_result_object_prints_serialises_and_renders_markdown(failing: VerifyReport) -> None:
    case = failing.cases[0]
    q = next(q for q in case.quantities if not q.passed)
    objects = [failing, case, q, failing.failures[0]]
    for obj in objects:
        assert str(obj) and obj.to_markdown() and json.dumps(obj.to_dict())
    assert str(case).startswith("float32/contiguous/seed=0: failed") and q.name in str(case)
    assert "FAILED" in str(q) and "exceed the rounding budget" in str(q)
    assert json.loads(json.dumps(q.to_dict()))["n_over"] == q.n_over > 0
    assert failing.failures[0].to_markdown().startswith("- `float32/contiguous/seed=0`: ")


def test_assert_ok_names_the_first_failing_case_and_numbers(failing: VerifyReport) -> None:
    with pytest.raises(AssertionError) as err:
        failing.assert_ok()
    msg = str(err.value)
    assert msg.startswith("memtrim.verify failed in case float32/contiguous/seed=0: output:")
    assert "|candidate - oracle|" in msg and "> budget" in msg and "more failures" in msg


def test_failures_carry_offending_indices_and_values(failing: VerifyReport) -> None:
    off = failing.failures[0].details["offending"][0]
    assert set(off) == {"index", "candidate", "oracle", "original", "error", "budget"}
    assert off["error"] > off["budget"]


def test_per_case_assert_close_and_normalized_error() -> None:
    # mode="reference": every case is judged against the oracle, so every quantity carries the figures
    # (in "auto" mode a bit-exact case would carry none and the loop below could pass vacuously).
    r = verify(broadcast, einsum, zw(), mode="reference", **FAST)
    judged = [q for c in r.cases for q in c.quantities]
    assert r.passed and {c.held for c in r.cases} == {"reference"} and len(judged) == 8 * 3
    for q in judged:
        assert q.assert_close is not None and q.norm_err is not None and q.budget_used is not None
        assert 0 <= q.budget_used <= 1 and q.rule == "per element, budget traced"


def test_memory_side_by_side() -> None:
    z, W = torch.randn(16, 4, 32, requires_grad=True), torch.randn(4, 32, 64, requires_grad=True)
    r = verify(
        broadcast, einsum, (z, W), dtypes=("fp32",), layouts=("contiguous",), seeds=(0,), progress=False
    )
    r.assert_ok()
    ref, cand = r.cases[0].memory_ref, r.cases[0].memory_cand
    assert isinstance(ref, Memory) and isinstance(cand, Memory)
    assert ref.largest_temporary_bytes == 16 * 4 * 32 * 64 * 4  # the broadcast product
    assert ref.largest_temporary_where is not None and "aten.mul" in ref.largest_temporary_where
    assert cand.largest_temporary_bytes < ref.largest_temporary_bytes // 4
    assert ref.peak_bytes > cand.peak_bytes
    summary = r.summary()
    assert "memory (float32/contiguous/seed=0): equal results" in summary and "less at peak" in summary
    assert json.loads(r.to_json())["cases"][0]["memory"]["reference"]["peak_bytes"] == ref.peak_bytes


def test_format_bytes() -> None:
    assert (
        format_bytes(1_207_959_552) == "1.12 GiB"
        and format_bytes(18_874_368) == "18 MiB"
        and format_bytes(512) == "512 B"
        and format_bytes(-1536) == "-1.5 KiB"
    )


# -- cancellation probes ----------------------------------------------------------------------------
def fp16_loop_sum(x: torch.Tensor) -> torch.Tensor:
    acc = x[0]
    for t in x[1:]:
        acc = acc + t  # rounds each partial sum to fp16 before the terms can cancel
    return acc


def test_probe_catches_partial_sums_rounded_before_cancelling() -> None:
    x = torch.tensor([2048.0, 1.0, 1.0, -2050.0], dtype=torch.float16)  # exact sum: 0
    r = verify(
        lambda x: x.sum(0), fp16_loop_sum, (torch.randn(4),), probes=[(x,)], **{**FAST, "dtypes": ("fp32",)}
    )
    assert all(c.status == "passed" for c in r.cases)  # four terms in fp32: within the budget
    assert not r.passed and r.probes[0].passed is False and r.probes[0].original_passed is True
    assert "residue where the exact value is zero" in r.failures[0].message
    ok = verify(lambda x: x.sum(0), lambda x: x.flip(0).sum(0), (torch.randn(4),), probes=[(x,)], **FAST)
    assert ok.passed and ok.probes[0].zeros == 1


def test_probe_on_head_results_weight_gradient_fp16() -> None:
    # Seed 001: the weight gradient sums over tokens; these contributions cancel exactly.
    z = torch.tensor([2048.0, 1.0, 1.0, -2050.0], dtype=torch.float16).view(4, 1, 1).requires_grad_()
    W = torch.ones(1, 1, 2, dtype=torch.float16, requires_grad=True)
    probe = CancellationProbe(
        (z, W), grad_outputs=[torch.ones(4, 1, 2, dtype=torch.float16)], name="fp16 W_O grad"
    )
    r = verify(broadcast, einsum, zw(), probes=[probe], **FAST)
    r.assert_ok()
    assert r.probes[0].zeros == 2 and "2 exact zeros kept" in r.probes[0].message


def test_probe_without_any_exact_zero_is_an_error() -> None:
    r = verify(lambda x: x * 2, lambda x: x * 2, (torch.randn(3),), probes=[(torch.ones(3),)], **FAST)
    assert not r.passed and "has no element whose exact value is zero" in r.failures[0].message


# -- progress bar -----------------------------------------------------------------------------------
def test_progress_bar_off_without_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    verify(lambda x: x * 2, lambda x: x * 2, (torch.randn(3),), memory=False, seeds=(0,), dtypes=("fp32",))
    assert capsys.readouterr().err == ""


def test_progress_bar_on_request(capsys: pytest.CaptureFixture[str]) -> None:
    verify(
        lambda x: x * 2,
        lambda x: x * 2,
        (torch.randn(3),),
        memory=False,
        seeds=(0,),
        dtypes=("fp32",),
        progress=True,
    )
    assert "memtrim.verify" in capsys.readouterr().err
