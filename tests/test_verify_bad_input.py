"""Bad input to memtrim.verify: each a clear error naming the case and the fix, never a silent pass."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from memtrim.verify import verify

FAST: dict[str, Any] = {"memory": False, "progress": False, "seeds": (0,), "dtypes": ("fp32",)}


def mm(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    return x @ W


def xw() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, 4, requires_grad=True), torch.randn(4, 5, requires_grad=True)


def first(report: Any) -> str:
    assert not report.passed
    f = report.failures[0]
    assert f"(case {f.case})" in f.message
    return str(f.message)


def test_different_output_structures() -> None:
    r = verify(mm, lambda x, W: (x @ W, x), xw(), **FAST)
    msg = first(r)
    assert "candidate returned a tuple of 2 tensors but the reference returned a single tensor" in msg
    assert "make both callables return the same structure" in msg


def test_different_dict_keys() -> None:
    r = verify(lambda x, W: {"out": x @ W}, lambda x, W: {"y": x @ W}, xw(), **FAST)
    assert "dict with keys ['y']" in first(r) and "['out']" in first(r)


def test_non_tensor_output_in_reference() -> None:
    r = verify(lambda x, W: (x @ W, 3), lambda x, W: (x @ W, 3), xw(), **FAST)
    msg = first(r)
    assert "reference output[1] is an int, not a tensor" in msg and "return tensors only" in msg


def test_non_tensor_output_in_candidate() -> None:
    r = verify(lambda x, W: (x @ W, x), lambda x, W: (x @ W, 1.5), xw(), **FAST)
    # Same pytree structure (two leaves), so the leaf type check names the output.
    assert "candidate output[1] is a float, not a tensor" in first(r)


def test_candidate_raises_names_case_and_line() -> None:
    def broken(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        raise ValueError("kernel not implemented for this shape")

    r = verify(mm, broken, xw(), memory=False, progress=False, seeds=(0, 1))
    assert not r.passed and len(r.failures) == len(r.cases) == 4 * 4 * 2
    msg = r.failures[0].message
    assert "the candidate raised ValueError in forward at test_verify_bad_input.py" in msg
    assert "kernel not implemented" in msg and "float64/contiguous/seed=0" in msg
    assert {f.case for f in r.failures} == {c.case.id for c in r.cases}


def test_candidate_raises_in_backward() -> None:
    class NoBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            raise NotImplementedError("backward missing")

    r = verify(lambda x: x * 2, NoBackward.apply, (torch.randn(3, requires_grad=True),), **FAST)
    assert "NotImplementedError in backward" in first(r)


def test_reference_raises_in_contiguous_layout() -> None:
    def bad_ref(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("reference broke")

    r = verify(bad_ref, lambda x: x, (torch.randn(3),), **FAST)
    assert "the reference raised RuntimeError" in first(r) and "reference broke" in first(r)


def test_reference_rejecting_a_layout_is_skipped_and_said() -> None:
    # .view() needs compatible strides: a legitimate limitation of the reference, not the candidate's.
    # (The noncontiguous layout's strides (8, 2) still merge, so only these two are rejected.)
    r = verify(lambda x: x.view(-1), lambda x: x.reshape(-1), (torch.randn(3, 4),), **FAST)
    skipped = [c for c in r.cases if c.status == "skipped"]
    assert r.passed and {c.case.layout for c in skipped} == {"transposed", "expanded"}
    assert "reference rejects transposed inputs: RuntimeError" in skipped[0].note
    assert any("skipped layouts" in n for n in r.notes)


def test_everything_skipped_is_not_a_pass() -> None:
    r = verify(
        lambda x: x.view(-1), lambda x: x.view(-1), (torch.randn(3, 4),), layouts=("transposed",), **FAST
    )
    assert not r.passed
    with pytest.raises(AssertionError, match="ran no case"):
        r.assert_ok()


def test_uncastable_inputs_complex() -> None:
    r = verify(lambda x: x * 2, lambda x: x * 2, (torch.randn(3, dtype=torch.complex64),), **FAST)
    msg = first(r)
    assert "argument leaf 0 is complex64 and cannot be cast to float32" in msg and "dtypes=" in msg


def test_builder_that_cannot_make_a_dtype() -> None:
    def build(dtype: torch.dtype, device: torch.device, seed: int) -> tuple[torch.Tensor]:
        if dtype == torch.bfloat16:
            raise TypeError("this model has no bf16 weights")
        return (torch.randn(3, 4, dtype=dtype, device=device, requires_grad=True),)

    r = verify(lambda x: x * 2, lambda x: x * 2, build, memory=False, progress=False, seeds=(0,))
    bad = {f.case.split("/")[0] for f in r.failures}
    assert bad == {"bfloat16"}
    assert "the inputs builder raised TypeError: this model has no bf16 weights" in r.failures[0].message
    assert "leave bfloat16 out of dtypes=" in r.failures[0].message


def test_integer_arguments_are_passed_as_given() -> None:
    def build(dtype: torch.dtype, device: torch.device, seed: int) -> Any:
        x = torch.randn(3, requires_grad=True)
        return (x, torch.arange(3))

    r = verify(lambda x, i: x[i], lambda x, i: x[i], build, **FAST)
    assert r.passed  # integer index passed as given, not cast


def test_api_misuse_raises_immediately() -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        verify(mm, mm, xw(), mode="fuzzy")
    with pytest.raises(TypeError, match="candidate must be callable"):
        verify(mm, 3, xw())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layouts must be a non-empty subset"):
        verify(mm, mm, xw(), layouts=("diagonal",))
    with pytest.raises(ValueError, match="unknown dtype"):
        verify(mm, mm, xw(), dtypes=("fp8",))


def test_candidate_mutating_its_input() -> None:
    def sneaky(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y.mul_(2).add(x)  # y does not require grad, so autograd allows it

    r = verify(lambda x, y: x + 2 * y, sneaky, (torch.randn(4, requires_grad=True), torch.randn(4)), **FAST)
    assert "modifies input[1] in place" in first(r)


def test_candidate_writing_into_hidden_slots() -> None:
    def scribble(x: torch.Tensor) -> torch.Tensor:
        out = x * 2
        if not x.is_contiguous():
            torch.as_strided(x, (x.numel(),), (1,), x.storage_offset() - 1).fill_(0.0)  # hits a NaN slot
        return out

    r = verify(lambda x: x * 2, scribble, (torch.randn(2, 3),), layouts=("noncontiguous",), **FAST)
    assert "wrote into the hidden NaN slots around input[0]" in first(r)
