"""GSQ quantizer: lean == original bit for bit, analytic gradients, RNG replay, fake mode, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from memtrim.cases.gsq import (
    CODES,
    VARIANTS,
    GumbelQuantizer2Bit,
    gumbel_soft_weight,
    minmax_scales,
    pack_2bit,
    unpack_2bit,
)

# (out, in, group_size)
SHAPES = [(8, 64, 32), (33, 96, 48), (64, 256, 128), (5, 12, 4)]
# (weight / compute dtype, logits dtype)
DTYPES = [
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
]


def _quantizer(shape: tuple[int, int, int], dtypes: tuple[torch.dtype, torch.dtype], seed: int, variant: str):
    out_f, in_f, group = shape
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_f, in_f, generator=gen).to(dtypes[0])
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return GumbelQuantizer2Bit(
            weight, minmax_scales(weight, group), group_size=group, logits_dtype=dtypes[1], backward=variant
        )


def _step(
    q: GumbelQuantizer2Bit,
    seed: int,
    temperature: float,
    scale: float,
    between: bool = False,
    transposed: bool = False,
):
    """Forward, optionally drain the global RNG, backward; returns (soft weight, grad logits, grad scales)."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(q.in_features, 7, generator=gen).to(q.values.dtype)
    torch.manual_seed(seed)
    w = q(temperature, scale)
    if between:
        # Other ops consume the stream the forward drew from; backward must still replay the forward's draw.
        torch.rand(1000)
        torch.randn(3, 5)
        torch.randint(0, 10, (17,))
        F.dropout(torch.ones(64), 0.5)
    if transposed:
        (w.t() * x.float().sum(1, keepdim=True)).square().sum().backward()
    else:
        (w.float() @ x.float()).square().mean().backward()
    return w.detach(), q.quant_logits.grad, q.scales.grad


@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-logits_{d[1]}".replace("torch.", ""))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("seed", [0, 1, 7])
def test_lean_equals_original_bitwise(shape, dtypes, seed):
    temperature, scale = [(2.0, 100.0), (0.7, 3.0), (0.05, 500.0)][seed % 3]
    results = {}
    for variant in ("original", "lean"):
        for between in (False, True):
            results[variant, between] = _step(
                _quantizer(shape, dtypes, seed, variant), seed, temperature, scale, between
            )
    ref = results["original", False]
    assert ref[1] is not None and ref[1].dtype == dtypes[1] and ref[2].dtype == torch.float32
    assert ref[1].abs().sum() > 0 and ref[2].abs().sum() > 0
    for key, got in results.items():
        for name, a, b in zip(("output", "grad logits", "grad scales"), ref, got, strict=True):
            assert torch.equal(a, b), f"{key}: {name} differs"


@pytest.mark.parametrize("dtypes", DTYPES[:3], ids=lambda d: f"{d[0]}-logits_{d[1]}".replace("torch.", ""))
def test_lean_equals_original_for_a_transposed_consumer(dtypes):
    results = [_step(_quantizer((16, 64, 32), dtypes, 3, v), 3, 0.6, 40.0, transposed=True) for v in VARIANTS]
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_backward_accepts_a_non_contiguous_gradient():
    # Autograd hands this Function contiguous gradients today; the backward must not rely on it.
    from memtrim.cases.gsq.function import _backward_lean, _backward_original

    q = _quantizer((16, 64, 32), (torch.bfloat16, torch.bfloat16), 0, "lean")
    state = torch.get_rng_state()
    grad = torch.randn(64, 16).to(torch.bfloat16).t()
    assert not grad.is_contiguous()
    args = (q.quant_logits.detach(), q.scales.detach(), q.values, state, 32, 0.6, 40.0)
    lean = _backward_lean(grad, *args)
    original = _backward_original(grad, *args)
    contiguous = _backward_lean(grad.contiguous(), *args)
    for a, b, c in zip(lean, original, contiguous, strict=True):
        assert torch.equal(a, b)
        # A strided reduction may sum in another order than a contiguous one: equal up to rounding.
        torch.testing.assert_close(a, c)


def _reference_soft_weight(logits, scales, values, u, group_size, temperature, scale):
    """Plain autograd (no custom Function) on the same uniform sample: an independent check of the math."""
    noise = -torch.log(-torch.log(u + 1e-8) + 1e-8)
    soft = F.softmax((logits * scale + noise) / temperature, dim=0)
    idx = torch.arange(logits.shape[2]) // group_size
    return (soft * values.view(4, 1, 1)).sum(0) * scales[:, idx]


@pytest.mark.parametrize("variant", ["original", "lean"])
def test_gradients_match_plain_autograd(variant):
    out_f, in_f, group = 16, 64, 16
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(4, out_f, in_f, generator=gen) * 0.02).requires_grad_()
    scales = (torch.rand(out_f, in_f // group, generator=gen) + 0.5).requires_grad_()
    values = torch.tensor(CODES)
    g = torch.randn(out_f, in_f, generator=gen)
    torch.manual_seed(11)
    u = torch.rand_like(logits)
    torch.manual_seed(11)
    w = gumbel_soft_weight(
        logits, scales, values, group_size=group, temperature=0.8, scale=50.0, backward=variant
    )
    ref_logits = logits.detach().clone().requires_grad_()
    ref_scales = scales.detach().clone().requires_grad_()
    ref = _reference_soft_weight(ref_logits, ref_scales, values, u, group, 0.8, 50.0)
    torch.testing.assert_close(w, ref)
    (w * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)
    torch.testing.assert_close(scales.grad, ref_scales.grad)


@pytest.mark.parametrize("variant", ["original", "lean"])
def test_gradcheck_float64_with_fixed_noise(variant):
    out_f, in_f, group = 3, 8, 4
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, out_f, in_f, generator=gen, dtype=torch.float64) * 0.5).requires_grad_()
    scales = (torch.rand(out_f, in_f // group, generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
    values = torch.tensor(CODES, dtype=torch.float64)

    def f(lg: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
        # Same seed on every call: gradcheck's perturbed forwards all see the same Gumbel noise.
        with torch.random.fork_rng():
            torch.manual_seed(1234)
            return gumbel_soft_weight(
                lg, sc, values, group_size=group, temperature=0.9, scale=1.3, backward=variant
            )

    assert torch.autograd.gradcheck(f, (logits, scales), eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("variant", ["original", "lean"])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_replay_leaves_no_trace_on_the_global_rng(variant, logits_dtype):
    q = _quantizer((16, 64, 32), (torch.float32, logits_dtype), 2, variant)
    torch.manual_seed(99)
    w = q(1.0, 10.0)
    w.sum().backward()
    w2 = q(1.0, 10.0)  # a second step draws from where the first forward left the stream
    after_two = torch.get_rng_state()
    w2.square().sum().backward()
    after_backward = torch.get_rng_state()

    torch.manual_seed(99)
    torch.rand_like(q.quant_logits)  # only the forward's draw
    torch.rand_like(q.quant_logits)
    assert torch.equal(torch.get_rng_state(), after_two)
    assert torch.equal(after_backward, after_two)


def test_backward_twice_replays_the_same_noise():
    q = _quantizer((8, 64, 32), (torch.float32, torch.float32), 4, "lean")
    w = q(0.5, 20.0)
    w.square().sum().backward(retain_graph=True)
    first = q.quant_logits.grad.clone()
    q.quant_logits.grad = None
    torch.rand(100)
    w.square().sum().backward()
    assert torch.equal(first, q.quant_logits.grad)


@pytest.mark.parametrize("variant", ["original", "lean"])
def test_fake_mode_runs_without_rng_state(variant):
    # Fake tensors draw nothing, so the Function takes no RNG state and the real generator stays put.
    # (Fake *CUDA* tensors cannot go through autograd on a CPU-only torch: the engine aborts the process.)
    before = torch.get_rng_state()
    with FakeTensorMode(allow_non_fake_inputs=False):
        weight = torch.empty(64, 256, dtype=torch.bfloat16)
        scales = torch.ones(64, 2)
        q = GumbelQuantizer2Bit(weight, scales, group_size=128, logits_dtype=torch.bfloat16, backward=variant)
        w = q(0.5, 200.0)
        w.float().square().mean().backward()
        assert w.shape == (64, 256) and w.dtype == torch.bfloat16
        assert q.quant_logits.grad.shape == (4, 64, 256) and q.quant_logits.grad.dtype == torch.bfloat16
        assert q.scales.grad.shape == (64, 2) and q.scales.grad.dtype == torch.float32
    assert torch.equal(torch.get_rng_state(), before)


def test_hard_weights_and_packing():
    q = _quantizer((8, 64, 32), (torch.float32, torch.float32), 0, "lean")
    codes = q.hard_codes()
    assert set(codes.unique().tolist()) <= {-2, -1, 0, 1}
    idx = torch.arange(64) // 32
    assert torch.equal(q.hard_weights(), codes.float() * q.scales.detach()[:, idx])
    packed = pack_2bit(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 16)
    assert torch.equal(unpack_2bit(packed), codes)


@pytest.mark.parametrize(("strength", "at_least"), [(6.0, 0.75), (600.0, 0.99)])
def test_initial_hard_codes_approach_round_to_nearest_with_strength(strength, at_least):
    # Init logits = std * (randn + strength * centred log-likelihood of each code): the larger the strength,
    # the more often argmax is the nearest code, i.e. round-to-nearest.
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=gen)
    scales = minmax_scales(weight, 64)
    q = GumbelQuantizer2Bit(weight, scales, group_size=64, strength=strength)
    rtn = (weight.view(64, 2, 64) / scales.unsqueeze(-1)).round().clamp(-2, 1).view(64, 128)
    assert (q.hard_codes().float() == rtn).float().mean() >= at_least


def test_errors_name_the_fix():
    weight = torch.randn(8, 96)
    with pytest.raises(ValueError, match=r"group_size=64 does not divide in=96; pick a positive divisor"):
        GumbelQuantizer2Bit(weight, torch.ones(8, 1), group_size=64)
    with pytest.raises(
        ValueError, match=r"scales must have shape \(out, in // group_size\) = \(8, 3\); got \(8, 2\)"
    ):
        GumbelQuantizer2Bit(weight, torch.ones(8, 2), group_size=32)
    with pytest.raises(
        ValueError, match=r"unknown backward variant 'fast'; use backward='lean' or backward='original'"
    ):
        GumbelQuantizer2Bit(weight, torch.ones(8, 3), group_size=32, backward="fast")
    with pytest.raises(ValueError, match=r"weight must be a 2-D floating matrix"):
        GumbelQuantizer2Bit(torch.randn(2, 8, 96), torch.ones(8, 3), group_size=32)
    with pytest.raises(ValueError, match=r"logits_dtype must be a floating dtype"):
        GumbelQuantizer2Bit(weight, torch.ones(8, 3), group_size=32, logits_dtype=torch.int8)
    q = GumbelQuantizer2Bit(weight, torch.ones(8, 3), group_size=32)
    with pytest.raises(ValueError, match=r"temperature must be > 0"):
        q(0.0)
