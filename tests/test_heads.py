"""memtrim.cases.heads (seed 001): the einsum rewrite is as accurate as the broadcast, without its temporary.

Numerics go through ``memtrim.verify`` in reference mode (a float64 oracle and a derived rounding budget per
element), with independent cross-checks computed here. Memory goes through ``memtrim.track`` and is held in
bytes against torch.profiler's allocation events (tests/groundtruth.py) in the same run.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import pytest
import torch
from groundtruth import ProfiledMemory, memtrim_deltas, profiler_memory

import memtrim
from memtrim.analysis import Footprint as Memory
from memtrim.cases.heads import head_results, head_results_broadcast, result_dtype
from memtrim.verify import CancellationProbe, VerifyReport, verify
from memtrim.verify.results import Quantity

HeadsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
QUIET = {"memory": False, "progress": False}


def zw(*z_shape: int, d_model: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Example inputs for verify (shapes and requires_grad; verify draws the values per seed)."""
    heads, d_head = z_shape[-2], z_shape[-1]
    z = torch.randn(*z_shape, requires_grad=True)
    W_O = torch.randn(heads, d_head, d_model, requires_grad=True)
    return z, W_O


def quantities(report: VerifyReport) -> list[tuple[str, str, Quantity]]:
    return [(c.case.id, q.name, q) for c in report.cases for q in c.quantities]


def assert_normalized_error_within_bound(
    report: VerifyReport,
    shapes: dict[str, tuple[torch.Size, torch.Size]],
    u_out: dict[str, float] | None = None,
) -> int:
    """|candidate - oracle| / S <= gamma_n(u_acc) + u_out (1 + gamma_n) for every compared tensor, n the
    number of products each element sums (d_head for the output, d_model for z's gradient, the leading
    positions for W_O's), from the inputs' shapes per variant; how many held. Independent of verify's
    budget: Higham's worst case for any summation order.

    ``u_out`` overrides the final rounding per quantity name, where a tensor was rounded to a lower
    precision than its dtype shows (a gradient passed back through a cast).
    """
    checked = 0
    for c in report.cases:
        z_shape, w_shape = shapes[c.case.variant]
        n = {
            "output": w_shape[1],
            "grad of input[0]": w_shape[2],
            "grad of input[1]": math.prod(z_shape[:-2]),
        }
        u_acc = 2.0**-53 if c.case.dtype == torch.float64 else 2.0**-24
        for q in c.quantities:
            if q.norm_err is None:
                continue  # S is zero everywhere (empty reduction): nothing to normalise
            assert q.u_out is not None
            g = gamma_n(n[q.name], u_acc)
            bound = g + (u_out or {}).get(q.name, q.u_out) * (1 + g)
            assert q.norm_err <= bound, f"{c.case.id} {q.name}: {q.norm_err:.3g} > {bound:.3g}"
            checked += 1
    return checked


def shapes_of(**variants: tuple[torch.Tensor, torch.Tensor]) -> dict[str, tuple[torch.Size, torch.Size]]:
    return {name: (z.shape, W.shape) for name, (z, W) in variants.items()}


def gamma_n(n: int, u: float) -> float:
    return n * u / (1 - n * u)


# -- numerics through memtrim.verify -----------------------------------------------------------------
def test_outputs_and_both_gradients_against_float64_in_every_dtype_and_layout() -> None:
    inputs = zw(2, 8, 4, 16)
    r = verify(head_results_broadcast, head_results, inputs, mode="reference", **QUIET)
    r.assert_ok()
    assert {c.case.dtype for c in r.cases} == set(FLOATS)
    assert {c.case.layout for c in r.cases} == {"contiguous", "noncontiguous", "transposed", "expanded"}
    assert len(r.cases) == 4 * 4 * 3 and all(c.held == "reference" for c in r.cases)
    names = {name for _, name, _ in quantities(r)}
    assert names == {"output", "grad of input[0]", "grad of input[1]"}  # z and W_O both get gradients
    # Each element was judged against its own budget (traced through the broadcast), not tensor maxima.
    assert {q.rule for _, _, q in quantities(r)} == {"per element, budget traced"}
    assert assert_normalized_error_within_bound(r, shapes_of(default=inputs)) == len(quantities(r))


def test_normalized_error_below_the_rounding_bound_computed_independently() -> None:
    """The same claim without verify: max |cand - exact| / S <= gamma_n(u_acc) + u_out (1 + gamma_n)."""
    gen = torch.Generator().manual_seed(1)
    z64 = torch.randn(2, 8, 12, 64, generator=gen, dtype=torch.float64)
    W64 = torch.randn(12, 64, 96, generator=gen, dtype=torch.float64)
    g64 = torch.randn(2, 8, 12, 96, generator=gen, dtype=torch.float64)
    for dtype in FLOATS:
        z, W, g = (t.to(dtype) for t in (z64, W64, g64))
        zc, Wc = z.clone().requires_grad_(), W.clone().requires_grad_()
        out = head_results(zc, Wc)
        out.backward(g)
        # Exact values on the rounded inputs, and S = the same contraction on absolute values.
        ze, We, ge = (t.double() for t in (z, W, g))
        exact = {
            "output": torch.einsum("...hd,hdm->...hm", ze, We),
            "grad z": torch.einsum("...hm,hdm->...hd", ge, We),
            "grad W_O": torch.einsum("...hd,...hm->hdm", ze, ge),
        }
        S = {
            "output": torch.einsum("...hd,hdm->...hm", ze.abs(), We.abs()),
            "grad z": torch.einsum("...hm,hdm->...hd", ge.abs(), We.abs()),
            "grad W_O": torch.einsum("...hd,...hm->hdm", ze.abs(), ge.abs()),
        }
        n = {"output": 64, "grad z": 96, "grad W_O": 2 * 8}
        got = {"output": out.detach(), "grad z": zc.grad, "grad W_O": Wc.grad}
        u_out = torch.finfo(dtype).eps / 2
        u_acc = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps / 2
        for key in exact:
            assert got[key] is not None and got[key].dtype == dtype
            norm_err = float(((got[key].double() - exact[key]).abs() / S[key]).max())
            bound = gamma_n(n[key], u_acc) + u_out * (1 + gamma_n(n[key], u_acc))
            assert norm_err <= bound, f"{dtype} {key}: {norm_err:.3g} > {bound:.3g}"
        if dtype in (torch.float16, torch.bfloat16):
            # The check can fail: summing the d_head products in the low dtype itself exceeds the bound.
            low = torch.zeros_like(out)
            for d in range(64):
                low = low + z[..., d, None] * W[:, d]  # rounded to fp16/bf16 after every addition
            bound = gamma_n(64, u_acc) + u_out * (1 + gamma_n(64, u_acc))
            assert float(((low.double() - exact["output"]).abs() / S["output"]).max()) > bound


def test_batchless_more_leading_dims_and_empty_inputs() -> None:
    variants = {
        "batchless": zw(8, 4, 16),
        "two leading dims": zw(2, 3, 5, 4, 16),
        "no leading dims": zw(4, 16),
        "no positions": zw(2, 0, 4, 16),
        "no heads": zw(2, 8, 0, 16),
        "d_head 0": zw(2, 8, 4, 0),
        "d_model 0": zw(2, 8, 4, 16, d_model=0),
    }
    default = zw(2, 8, 4, 16)
    r = verify(
        head_results_broadcast,
        head_results,
        default,
        mode="reference",
        dtypes=("fp32", "bf16"),
        seeds=(0,),
        variants=variants,
        **QUIET,
    )
    r.assert_ok()
    assert {c.case.variant for c in r.cases} == {"default", *variants}
    assert all(c.status == "passed" for c in r.cases)  # no layout skipped: every input shape is accepted
    by_variant = {v: [q for c in r.cases if c.case.variant == v for q in c.quantities] for v in variants}
    assert {q.rule for q in by_variant["no heads"]} == {"empty"}
    # No positions: the output and z's gradient are empty; W_O's gradient is an empty sum, all zeros.
    assert {(q.name, q.rule) for q in by_variant["no positions"]} == {
        ("output", "empty"),
        ("grad of input[0]", "empty"),
        ("grad of input[1]", "per element, budget traced"),
    }
    # d_head 0: an empty sum, so the output is all zeros (and nonempty) and the gradients are empty.
    assert {(q.name, q.rule) for q in by_variant["d_head 0"]} == {
        ("output", "per element, budget traced"),
        ("grad of input[0]", "empty"),
        ("grad of input[1]", "empty"),
    }
    assert assert_normalized_error_within_bound(r, shapes_of(default=default, **variants)) > 0


def test_second_derivatives_of_both_inputs() -> None:
    r = verify(
        head_results_broadcast,
        head_results,
        zw(2, 6, 3, 8, d_model=10),
        mode="reference",
        dtypes=("fp64", "fp32"),
        layouts=("contiguous", "noncontiguous"),
        seeds=(0,),
        second_order=True,
        **QUIET,
    )
    r.assert_ok()
    second = {q.name for _, _, q in quantities(r) if q.kind == "grad2"}
    assert second == {"2nd derivative of input[0]", "2nd derivative of input[1]"}
    z = torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    W_O = torch.randn(4, 5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(head_results, (z, W_O))


def einsum_without_autocast_guard(z: torch.Tensor, W_O: torch.Tensor) -> torch.Tensor:
    return torch.einsum("...hd,hdm->...hm", z, W_O)


def test_cpu_autocast_bf16_keeps_the_original_dtype_and_accuracy() -> None:
    r = verify(
        head_results_broadcast,
        head_results,
        zw(2, 8, 4, 16),
        dtypes=("fp32",),
        seeds=(0, 1),
        autocast=True,
        **QUIET,
    )
    r.assert_ok()
    autocast_cases = [c for c in r.cases if c.case.autocast]
    assert len(autocast_cases) == 4 * 2 and {c.case.dtype for c in autocast_cases} == {torch.bfloat16}
    assert all(c.held in ("exact", "reference") for c in autocast_cases)
    z, W_O = torch.randn(8, 4, 16), torch.randn(4, 16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = head_results(z, W_O), head_results_broadcast(z, W_O)
        naive = einsum_without_autocast_guard(z, W_O)
    assert got.dtype == want.dtype == torch.float32 and naive.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)  # fp32 tolerances: computed in fp32, as the original is
    # The check can fail: a bare einsum runs its matmul in bf16 under autocast and changes the dtype.
    bad = verify(
        head_results_broadcast,
        einsum_without_autocast_guard,
        zw(2, 8, 4, 16),
        dtypes=("fp32",),
        layouts=("contiguous",),
        seeds=(0,),
        autocast=True,
        **QUIET,
    )
    assert not bad.passed
    assert {f.case for f in bad.failures} == {"autocast(bfloat16)/contiguous/seed=0"}
    assert bad.failures[0].kind == "meta" and "bfloat16" in bad.failures[0].message


def mixed(fn: HeadsFn, z_dtype: torch.dtype) -> HeadsFn:
    """``fn`` on ``z`` cast to ``z_dtype`` (verify casts every input to one case dtype, so mix inside).

    In the float64 oracle run ``z`` takes the same rounded values but stays float64, and its gradient
    passes through unrounded (a rounding with identity gradient), so the oracle stays exact.
    """

    def call(z: torch.Tensor, W_O: torch.Tensor) -> torch.Tensor:
        if z.dtype == torch.float64:
            return fn(z + (z.to(z_dtype).to(z.dtype) - z).detach(), W_O)
        return fn(z.to(z_dtype), W_O)

    return call


@pytest.mark.parametrize("z_dtype", [torch.float16, torch.bfloat16])
def test_mixed_half_z_with_fp32_W_O_promotes_like_the_broadcast(z_dtype: torch.dtype) -> None:
    inputs = zw(2, 8, 4, 16)
    r = verify(
        mixed(head_results_broadcast, z_dtype),
        mixed(head_results, z_dtype),
        inputs,
        mode="reference",
        abs_reference=head_results_broadcast,  # S of the contraction itself, not of the rounding trick
        dtypes=("fp32",),
        seeds=(0, 1),
        **QUIET,
    )
    r.assert_ok()  # includes: the candidate's output dtype equals the reference's (fp32)
    assert {name for _, name, _ in quantities(r)} == {"output", "grad of input[0]", "grad of input[1]"}
    # z's gradient is rounded to z_dtype on its way back through the cast, then widened to fp32.
    u_z = torch.finfo(z_dtype).eps / 2
    assert_normalized_error_within_bound(r, shapes_of(default=inputs), u_out={"grad of input[0]": u_z})
    z = torch.randn(8, 4, 16, dtype=z_dtype)
    assert head_results(z, torch.randn(4, 16, 32)).dtype == torch.float32


MIXED = (*FLOATS, torch.int64, torch.int32, torch.int8, torch.bool)


@pytest.mark.parametrize("z_dtype", MIXED, ids=str)
def test_every_dtype_pair_gives_the_broadcasts_dtype_and_values(z_dtype: torch.dtype) -> None:
    for w_dtype in MIXED:
        gen = torch.Generator().manual_seed(0)
        z = torch.randint(-3, 4, (2, 5, 3, 4), generator=gen).to(z_dtype)
        W_O = torch.randint(-3, 4, (3, 4, 6), generator=gen).to(w_dtype)
        want, got = head_results_broadcast(z, W_O), head_results(z, W_O)
        assert got.dtype == want.dtype == result_dtype(z, W_O), (z_dtype, w_dtype)
        assert torch.equal(got, want), (z_dtype, w_dtype)  # small integers: every order is exact
        if not (z_dtype.is_floating_point and w_dtype.is_floating_point):
            continue
        g = torch.randint(-3, 4, want.shape, generator=gen).to(want.dtype)
        grads = []
        for fn in (head_results_broadcast, head_results):
            zc, Wc = z.clone().requires_grad_(), W_O.clone().requires_grad_()
            grads.append(torch.autograd.grad(fn(zc, Wc), (zc, Wc), g))
        (gz_want, gw_want), (gz_got, gw_got) = grads
        assert gz_got.dtype == z_dtype and torch.equal(gz_got, gz_want), (z_dtype, w_dtype)
        assert gw_got.dtype == w_dtype and torch.equal(gw_got, gw_want), (z_dtype, w_dtype)


def test_shape_mismatch_is_a_clear_error_in_both() -> None:
    for fn in (head_results, head_results_broadcast):
        with pytest.raises(ValueError, match=r"z must end in \[head, d_head\] = \[4, 16\]"):
            fn(torch.randn(8, 4, 15), torch.randn(4, 16, 32))
        with pytest.raises(ValueError, match=r"W_O must be \[head, d_head, d_model\]"):
            fn(torch.randn(8, 4, 16), torch.randn(64, 32))


# -- FP16 cancellation -------------------------------------------------------------------------------
def cancelling_fp16_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W_O's gradient sums z over tokens, and these tokens cancel exactly: the exact gradient is zero.

    d_head 0: partial sums overflow fp16 (40000 + 40000 > 65504) before the negatives cancel them.
    d_head 1: partial sums round in fp16 (2048 + 1 is not representable) before they cancel.
    """
    column0 = [40000.0, 40000.0, -40000.0, -40000.0]
    column1 = [2048.0, 1.0, 1.0, -2050.0]
    z = torch.tensor([column0, column1], dtype=torch.float16).T.reshape(2, 2, 1, 2)  # [batch, pos, 1, 2]
    W_O = torch.ones(1, 2, 3, dtype=torch.float16)
    g = torch.ones(2, 2, 1, 3, dtype=torch.float16)
    return z.requires_grad_(), W_O.requires_grad_(), g


def chunked_over_tokens(z: torch.Tensor, W_O: torch.Tensor) -> torch.Tensor:
    """The seed PR's first attempt, reduced: one token per chunk, so W_O's gradient adds up in fp16."""
    tokens = z.reshape(-1, *z.shape[-2:])
    chunks = [head_results(token, W_O) for token in tokens.split(1)]
    return torch.cat(chunks).reshape(*z.shape[:-1], W_O.shape[-1])


PROBE_ONLY = {**QUIET, "dtypes": ("fp16",), "layouts": ("contiguous",), "seeds": (0,)}  # plus one fp16 case


def test_fp16_cancellation_gives_an_exact_zero_weight_gradient() -> None:
    z, W_O, g = cancelling_fp16_inputs()
    probe = CancellationProbe((z, W_O), grad_outputs=[g], name="fp16 W_O grad cancels")
    r = verify(head_results_broadcast, head_results, zw(2, 8, 4, 16), probes=[probe], **PROBE_ONLY)
    r.assert_ok()
    assert r.probes[0].passed and r.probes[0].original_passed
    assert r.probes[0].zeros == 6  # all of W_O's gradient [1, 2, 3]
    # Directly, too: exactly zero, not just small.
    head_results(z, W_O).backward(g)
    assert W_O.grad is not None and torch.equal(W_O.grad, torch.zeros_like(W_O))
    # The check can fail: fp16 partial sums leave NaN (overflow) and a residue (rounding).
    bad = verify(head_results_broadcast, chunked_over_tokens, zw(2, 8, 4, 16), probes=[probe], **PROBE_ONLY)
    assert not bad.passed and not bad.probes[0].passed and bad.probes[0].original_passed
    assert "residue where the exact value is zero" in bad.failures[-1].message
    z2, W2, _ = cancelling_fp16_inputs()
    chunked_over_tokens(z2, W2).backward(g)
    assert W2.grad is not None and not W2.grad[0, 0].isfinite().any() and (W2.grad[0, 1] != 0).all()


# -- memory through memtrim.track, held against torch.profiler -------------------------------------------
SMALL = {"batch": 2, "pos": 32, "heads": 12, "d_head": 64, "d_model": 128}


def tracked_forward_backward(
    fn: HeadsFn, *, z_grad: bool = True, w_grad: bool = True
) -> tuple[int, dict[str, tuple[memtrim.Trace, ProfiledMemory]]]:
    """Forward and backward, each its own tracked and profiled region; the result's bytes."""
    s = SMALL
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(s["batch"], s["pos"], s["heads"], s["d_head"], generator=gen, requires_grad=z_grad)
    W_O = torch.randn(s["heads"], s["d_head"], s["d_model"], generator=gen, requires_grad=w_grad)
    g = torch.randn(s["batch"], s["pos"], s["heads"], s["d_model"], generator=gen)
    phases: dict[str, tuple[memtrim.Trace, ProfiledMemory]] = {}
    with profiler_memory() as truth, memtrim.track() as trace:
        out = fn(z, W_O)
    phases["forward"] = (trace, truth)
    with profiler_memory() as truth, memtrim.track() as trace:
        out.backward(g)
    phases["backward"] = (trace, truth)
    for trace, truth in phases.values():  # memtrim sees exactly what the allocator saw
        assert memtrim_deltas(trace) == truth.deltas
        assert trace.peak_bytes == truth.peak
    return out.nbytes, phases


def check_no_temporary_above_twice_the_result(fn: HeadsFn, **grads: bool) -> None:
    """The issue's memory claim, in forward and in backward. Raises AssertionError naming each offender."""
    result_bytes, phases = tracked_forward_backward(fn, **grads)
    limit = 2 * result_bytes
    offenders = []
    for phase, (trace, truth) in phases.items():
        temps = [t for t in trace.largest_temporaries(50) if t.phase == phase]
        for t in temps:
            if t.bytes > limit:
                where = f"{t.file.rsplit('/', 1)[-1]}:{t.line}" if t.file else "?"
                offenders.append(f"{phase}: {t.op} {t.bytes:,} B at {where}")
        # Ground truth: with no temporary above the limit, no block the allocator handed out is either
        # (outputs and gradients are at most the size of W_O's gradient, below the limit at this size).
        if not any(t.bytes > limit for t in temps):
            assert max(truth.allocated_sizes, default=0) <= limit, phase
            assert max(truth.intra_op_bytes, default=0) <= limit, phase
    if offenders:
        raise AssertionError(
            f"temporaries above 2x the {result_bytes:,}-byte result: " + "; ".join(offenders)
        )


@pytest.mark.parametrize(
    "grads",
    [{"z_grad": True, "w_grad": True}, {"z_grad": False, "w_grad": True}, {"z_grad": True, "w_grad": False}],
    ids=["both grads", "W_O grad only", "z grad only"],
)
def test_einsum_has_no_temporary_above_twice_the_result_in_forward_and_backward(
    grads: dict[str, bool],
) -> None:
    check_no_temporary_above_twice_the_result(head_results, **grads)


def test_the_same_check_fails_on_the_broadcast_in_forward_and_backward() -> None:
    with pytest.raises(AssertionError) as info:
        check_no_temporary_above_twice_the_result(head_results_broadcast)
    s = SMALL
    product = s["batch"] * s["pos"] * s["heads"] * s["d_head"] * s["d_model"] * 4  # 25,165,824 B
    file = inspect.getsourcefile(head_results_broadcast)
    assert file is not None
    lines, start = inspect.getsourcelines(head_results_broadcast)
    line = start + next(i for i, text in enumerate(lines) if "z[..., None] * W_O" in text)
    where = f"{file.rsplit('/', 1)[-1]}:{line}"
    msg = str(info.value)
    assert f"forward: aten.mul.Tensor {product:,} B at {where}" in msg
    assert msg.count(f"backward: aten.mul.Tensor {product:,} B at {where}") == 2  # one per input gradient
    # Ground truth: the allocator handed out exactly that block in each phase, and got it back.
    _, phases = tracked_forward_backward(head_results_broadcast)
    for phase, count in (("forward", 1), ("backward", 2)):
        trace, truth = phases[phase]
        assert truth.deltas.count(product) == count and truth.deltas.count(-product) == count
        assert max(truth.allocated_sizes) == product == trace.largest_temporaries(1)[0].bytes


def test_memory_side_by_side_in_the_verify_report() -> None:
    s = SMALL
    r = verify(
        head_results_broadcast,
        head_results,
        zw(s["batch"], s["pos"], s["heads"], s["d_head"], d_model=s["d_model"]),
        dtypes=("fp32",),
        layouts=("contiguous",),
        seeds=(0,),
        progress=False,
    )
    r.assert_ok()
    ref, cand = r.cases[0].memory_ref, r.cases[0].memory_cand
    assert isinstance(ref, Memory) and isinstance(cand, Memory)
    memory = {"broadcast": ref, "einsum": cand}
    assert cand.peak_bytes < ref.peak_bytes and cand.largest_temporary_bytes < ref.largest_temporary_bytes
    # Ground truth: the same forward and backward (both gradients), profiled on its own.
    result_bytes = s["batch"] * s["pos"] * s["heads"] * s["d_model"] * 4
    product = math.prod(s.values()) * 4
    z, W_O = zw(s["batch"], s["pos"], s["heads"], s["d_head"], d_model=s["d_model"])
    g = torch.randn(s["batch"], s["pos"], s["heads"], s["d_model"])
    for name, fn in (("broadcast", head_results_broadcast), ("einsum", head_results)):
        with profiler_memory() as truth:
            grads = torch.autograd.grad(fn(z, W_O), (z, W_O), g)
        del grads
        assert memory[name].peak_bytes == truth.peak, name
        largest = memory[name].largest_temporary_bytes
        if name == "broadcast":
            assert largest == product == max(truth.allocated_sizes)
        else:
            assert largest <= 2 * result_bytes and max(truth.allocated_sizes) <= 2 * result_bytes
