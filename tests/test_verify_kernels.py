"""verify's rounding model against PyTorch's own kernels (issue 23, items 10-12): a formula and torch's
fused op for it verify either way round on every vector path, a wrong rewrite still fails, and a failure
at each row's max says where the error comes from.

`make test` runs the verify tests again under ATEN_CPU_CAPABILITY=avx2 and =default (torch's AVX2 and
scalar kernels), so these hold on CPUs without AVX-512 as well as on this one."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from memtrim.verify import verify
from memtrim.verify.compare import row_extreme_hint


def gelu_formula(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _verify(reference, candidate, **kw):  # type: ignore[no-untyped-def]
    # 16,384 elements: the size at which an AVX2 EPYC failed 435 of them against the 2-ulp erf budget
    x = torch.randn(128, 128, requires_grad=True)
    return verify(reference, candidate, x, mode="reference", progress=False, memory=False, **kw)


def test_the_gelu_formula_and_torchs_fused_gelu_verify_either_way_round() -> None:
    assert _verify(gelu_formula, F.gelu).passed
    assert _verify(F.gelu, gelu_formula).passed


def test_the_tanh_approximation_of_gelu_still_fails_against_the_exact_one() -> None:
    report = _verify(F.gelu, gelu_tanh, dtypes=[torch.float64, torch.float32])
    assert not report.passed
    failed = {c.case.dtype for c in report.cases if c.status != "passed"}
    assert failed == {torch.float64, torch.float32}


def logsumexp_manual(x: torch.Tensor) -> torch.Tensor:
    m = x.amax(-1, keepdim=True)
    return (m + (x - m).exp().sum(-1, keepdim=True).log()).squeeze(-1)


def test_a_manual_logsumexp_failing_at_each_rows_max_says_so() -> None:
    x = torch.randn(16, 64, requires_grad=True)
    report = verify(
        lambda t: torch.logsumexp(t, -1), logsumexp_manual, x, mode="reference", progress=False,
        memory=False, dtypes=[torch.float16], seeds=[0, 1, 2],
    )  # fmt: skip
    grads = [q for c in report.cases for q in c.quantities if q.name == "grad of input[0]" and not q.passed]
    assert grads, "the fp16 gradient at the row max carries 1 - sum(softmax) rounding"
    for q in grads:
        assert "the largest of its row (dim 1) of input[0]" in q.message
        assert "1 - sum(softmax)" in q.message


def test_the_row_extreme_hint_names_only_what_it_checked() -> None:
    x = torch.tensor([[0.0, 5.0, 1.0, 2.0], [3.0, -1.0, 0.5, 0.0]])
    assert "largest of its row (dim 1)" in str(row_extreme_hint(x, [(0, 1), (1, 0)], "x"))
    assert "smallest of its row (dim 1)" in str(row_extreme_hint(x, [(1, 1)], "x"))
    assert row_extreme_hint(x, [(0, 1), (1, 2)], "x") is None  # (1, 2) is neither
    assert row_extreme_hint(torch.arange(3.0), [(2,)], "x") is None  # a row of 3 proves nothing
