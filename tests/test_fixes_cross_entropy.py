"""memtrim.fixes.chunked_linear_cross_entropy: F.cross_entropy(hidden @ weight.T, target) without the logits.

Numerics go through ``memtrim.verify`` in reference mode (a float64 oracle), over dtypes, layouts, the
ways the tokens and the vocabulary are tiled, ignore_index and an empty batch; a deliberately wrong
candidate must fail it. Memory is held in bytes against torch.profiler's allocation events.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from groundtruth import memtrim_deltas, profiler_memory
from hypothesis import given, settings
from hypothesis import strategies as st

import memtrim
from memtrim.fixes import auto_chunk_size, chunked_linear_cross_entropy
from memtrim.fixes.cross_entropy import MIN_COLUMNS, tiling
from memtrim.verify import LAYOUTS, verify

QUIET = {"memory": False, "progress": False}
HIDDEN = 24


def inputs(tokens: int, vocab: int, *, lead: int = 3, bias: bool = False) -> Callable[..., tuple[Any, ...]]:
    """A verify builder: hidden [lead, tokens, H], weight [vocab, H] (scaled like a trained lm_head),
    targets with every fourth position ignored, and optionally a bias."""

    def build(dtype: torch.dtype, device: torch.device, seed: int) -> tuple[Any, ...]:
        gen = torch.Generator().manual_seed(seed)
        h = torch.randn(lead, tokens, HIDDEN, generator=gen).to(dtype).requires_grad_()
        w = (torch.randn(vocab, HIDDEN, generator=gen) / HIDDEN**0.5).to(dtype).requires_grad_()
        t = torch.randint(0, vocab, (lead, tokens), generator=gen)
        t[:, ::4] = -100
        out: tuple[Any, ...] = (h, w, t)
        if bias:
            out += (torch.randn(vocab, generator=gen).to(dtype).requires_grad_(),)
        return tuple(x.detach().to(device).requires_grad_(x.requires_grad) for x in out)

    return build


def unfused(
    h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, b: torch.Tensor | None = None, **kw: Any
) -> Any:
    logits = h @ w.T if b is None else h @ w.T + b
    return F.cross_entropy(logits.flatten(0, -2), t.flatten(), **kw)


def chunked(chunk: int, **kw: Any) -> Callable[..., torch.Tensor]:
    def f(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        out = chunked_linear_cross_entropy(h, w, t, bias=b, chunk_size=chunk, **kw)
        return out.flatten() if kw.get("reduction") == "none" else out

    return f


# Tilings (tokens = 3 x 7 = 21, vocab 97 or 2000): each exercises a different loop of the Function.
TILINGS = {
    "token rows x whole vocabulary": (97, 4),  # 21 * 97 > 4 * 97: rows of 4 tokens, all 97 columns
    "all tokens x vocabulary blocks": (2000, 6),  # 21 * 512 <= 6 * 2000: 21 rows x 571 columns
    "token rows x vocabulary blocks": (2000, 3),  # rows of 11 tokens x 545 columns
}


def test_tilings_are_what_the_cases_claim() -> None:
    assert tiling(21, 97, 4) == (4, 97)
    assert tiling(21, 2000, 6) == (21, 571)
    rows, cols = tiling(21, 2000, 3)
    assert 1 < rows < 21 and cols == MIN_COLUMNS + 33 and rows * cols <= 3 * 2000


class CrossEntropyScale(torch.autograd.Function):
    """S for ``memtrim.verify`` 's float64 budget: a first-order bound on the rounding error of any
    implementation of the mean cross-entropy of ``hidden @ weight.T``, from ``|hidden|`` and ``|weight|``.

    Why it is needed: in float64 the oracle *is* the original, so without S verify allows a candidate 3
    roundings of each tensor's largest element, and no rewrite that sums in another order (a chunked
    log-sum-exp, a weight gradient summed over chunks) can promise that. The softmax is not multilinear,
    so verify cannot trace S itself. With ``Z = |h| @ |W|.T`` (each logit's S), per token r:

    * loss: logits err by ``gamma_H * Z``; the loss moves by at most ``max_j Z_rj + Z_r,target``; the
      log-sum-exp's own roundings scale with ``|max logit| + log V``: S = ``2 max_j Z_rj + Z_rt + log V``.
    * grad of hidden ``(p - onehot) @ W``: S = ``s * (amp_r * max_j |W_jk| + |W_target,k|)`` with
      ``amp_r = 1 + 2 max_j Z_rj`` (how far logit and exp roundings move the probabilities).
    * grad of weight ``(p - onehot).T @ h``: p <= 1 gives S = ``sum_r s (amp_r + [t_r = j]) |h_rk|``: loose by
      up to the vocabulary size where p is small, so it certifies agreement to ~1e-11 relative, not to
      the last bits (fp32/fp16/bf16 are judged without S, against the original's own error, below).
    """

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        hf, tf = h.reshape(-1, h.shape[-1]), t.reshape(-1)
        valid = tf != -100
        safe = tf.masked_fill(~valid, 0)
        z = hf @ w.T
        z_max = z.amax(1) if z.shape[0] else z.sum(1)
        rows = (2 * z_max + z.gather(1, safe[:, None]).squeeze(1) + math.log(w.shape[0])) * valid
        count = valid.sum()
        ctx.save_for_backward(hf, w, safe, valid, 1 + 2 * z_max, count)
        ctx.shape = h.shape
        return rows.sum() / count

    @staticmethod
    def backward(ctx: Any, up: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        hf, w, safe, valid, amp, count = ctx.saved_tensors
        s = torch.where(valid, up.abs() / count, torch.zeros((), dtype=hf.dtype))
        gh = s[:, None] * (amp[:, None] * w.amax(0)[None, :] + w[safe])
        gw = ((s * amp) @ hf)[None, :].expand_as(w) + torch.zeros_like(w).index_add_(0, safe, s[:, None] * hf)
        return gh.view(ctx.shape), gw, None


@pytest.mark.parametrize("name", list(TILINGS))
def test_loss_and_both_gradients_against_float64_in_every_dtype_layout_and_an_empty_batch(name: str) -> None:
    vocab, chunk = TILINGS[name]
    # every layout once, on the tiling with the most loops; the layouts only differ before the loops
    layouts = LAYOUTS if name == "token rows x vocabulary blocks" else ("contiguous", "noncontiguous")
    common: dict[str, Any] = {"mode": "reference", "seeds": (0,), "layouts": layouts, **QUIET}
    empty = {"empty": inputs(0, vocab)}
    low = verify(
        unfused, chunked(chunk), inputs(7, vocab), variants=empty, dtypes=("fp32", "fp16", "bf16"), **common
    )
    f64 = verify(
        unfused, chunked(chunk), inputs(7, vocab), variants=empty, dtypes=("fp64",),
        abs_reference=CrossEntropyScale.apply, reduction_length=max(HIDDEN, vocab), **common,
    )  # fmt: skip
    for r in (low, f64):
        r.assert_ok()
        assert {c.case.layout for c in r.cases} == set(layouts)
        assert {c.case.variant for c in r.cases} == {"default", "empty"}
        assert all(c.status == "passed" and c.held == "reference" for c in r.cases)
        names = {q.name for c in r.cases for q in c.quantities}
        assert names == {"output", "grad of input[0]", "grad of input[1]"}  # hidden and weight
    dtypes = {c.case.dtype for c in low.cases + f64.cases}
    assert dtypes == {torch.float64, torch.float32, torch.float16, torch.bfloat16}
    rules = {q.rule for c in f64.cases for q in c.quantities if c.case.variant == "default"}
    assert rules == {"per element, budget supplied"}


def test_float64_without_s_differs_from_the_original_by_a_few_ulps_at_most() -> None:
    """Why the float64 check supplies S: without it verify allows 3 roundings of each tensor's largest
    element (the fp64 oracle is the original itself), which a rewrite that sums in another order cannot
    promise. Whatever it flags here (on this CPU, some elements) must be such few-ulp differences."""
    r = verify(unfused, chunked(3), inputs(7, 2000), mode="reference", dtypes=("fp64",), seeds=(0,), **QUIET)
    assert {f.kind for f in r.failures} <= {"mismatch"}
    worst = [o for f in r.failures for o in f.details["offending"]]
    assert all(o["error"] < 1e-14 for o in worst)  # values 0.001 to 8: a few ulps


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_bias_label_smoothing_and_the_other_reductions(reduction: str) -> None:
    kw = {"reduction": reduction, "label_smoothing": 0.1}
    r = verify(
        lambda h, w, t, b: unfused(h, w, t, b, **kw).flatten(),
        lambda h, w, t, b: chunked(3, **kw)(h, w, t, b).flatten(),
        inputs(7, 2000, bias=True),
        mode="reference",
        dtypes=("fp32", "fp16", "bf16"),
        layouts=("contiguous", "noncontiguous"),
        seeds=(1,),
        **QUIET,
    )
    r.assert_ok()
    assert {q.name for c in r.cases for q in c.quantities} >= {"grad of input[1]", "grad of input[3]"}


def test_autocast_computes_as_the_unfused_loss_does_under_autocast() -> None:
    r = verify(
        unfused,
        chunked(4),
        inputs(7, 97),
        mode="reference",
        dtypes=("fp32",),
        layouts=("contiguous",),
        seeds=(0,),
        autocast=True,
        **QUIET,
    )
    r.assert_ok()
    assert any(c.case.autocast for c in r.cases)
    h, w, t = inputs(7, 97)(torch.float32, torch.device("cpu"), 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert chunked_linear_cross_entropy(h, w, t).dtype == unfused(h, w, t).dtype == torch.float32


def test_verify_fails_a_candidate_that_counts_ignored_tokens_in_the_mean() -> None:
    def wrong(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return chunked_linear_cross_entropy(h, w, t, chunk_size=4, reduction="sum") / t.numel()

    r = verify(unfused, wrong, inputs(7, 97), mode="reference", dtypes=("fp32",), seeds=(0,), **QUIET)
    assert not r.passed
    assert {f.what for f in r.failures} >= {"output", "grad of input[0]", "grad of input[1]"}


def test_ignored_tokens_contribute_nothing_and_all_ignored_gives_nan_like_torch() -> None:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([3, -100, 5, 7, -100, 0])
    per_token = chunked_linear_cross_entropy(h, w, t, reduction="none", chunk_size=2)
    assert per_token[1] == 0 and per_token[4] == 0
    torch.testing.assert_close(
        per_token, F.cross_entropy(h @ w.T, t, reduction="none"), rtol=1e-12, atol=1e-13
    )
    (gh,) = torch.autograd.grad(chunked_linear_cross_entropy(h, w, t, chunk_size=2), h)
    assert gh[1].abs().max() == 0 and gh[4].abs().max() == 0
    none = torch.full_like(t, -100)
    loss = chunked_linear_cross_entropy(h, w, none)
    assert loss.isnan() and F.cross_entropy(h @ w.T, none).isnan()
    gh, gw = torch.autograd.grad(loss, (h, w))
    assert gh.abs().max() == 0 and gw.abs().max() == 0  # torch gives zeros too
    t7 = t.clamp(min=0)
    assert chunked_linear_cross_entropy(h, w, t7, ignore_index=7).item() == pytest.approx(
        F.cross_entropy(h @ w.T, t7, ignore_index=7).item(), rel=1e-13
    )


def test_an_empty_batch_matches_torch_in_every_reduction() -> None:
    h = torch.randn(0, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    t = torch.zeros(0, dtype=torch.long)
    assert chunked_linear_cross_entropy(h, w, t).isnan()
    assert chunked_linear_cross_entropy(h, w, t, reduction="sum").item() == 0.0
    none = chunked_linear_cross_entropy(h, w, t, reduction="none")
    assert none.shape == (0,)
    gh, gw = torch.autograd.grad(chunked_linear_cross_entropy(h, w, t, reduction="sum"), (h, w))
    assert gh.shape == (0, 8) and gw.shape == (11, 8) and gw.abs().max() == 0


def test_only_the_gradients_asked_for_are_computed_and_no_grad_works() -> None:
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(2, 5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(300, 8, generator=gen, dtype=torch.float64)  # a frozen lm_head
    t = torch.randint(0, 300, (2, 5), generator=gen)
    loss = chunked_linear_cross_entropy(h, w, t, chunk_size=2)
    (gh,) = torch.autograd.grad(loss, h)
    (want,) = torch.autograd.grad(unfused(h, w, t), h)
    torch.testing.assert_close(gh, want, rtol=1e-12, atol=1e-15)
    w.requires_grad_()
    (gw,) = torch.autograd.grad(chunked_linear_cross_entropy(h.detach(), w, t, chunk_size=2), w)
    (want_w,) = torch.autograd.grad(unfused(h.detach(), w, t), w)
    torch.testing.assert_close(gw, want_w, rtol=1e-12, atol=1e-15)
    with torch.no_grad():
        per_token = chunked_linear_cross_entropy(h, w, t, reduction="none")
    assert per_token.shape == (2, 5) and not per_token.requires_grad


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(0, 40),
    vocab=st.integers(1, 700),
    chunk=st.integers(1, 50),
    smoothing=st.sampled_from([0.0, 0.25]),
    seed=st.integers(0, 2**16),
)
def test_any_tiling_gives_torch_s_loss_and_gradients_in_float64(
    tokens: int, vocab: int, chunk: int, smoothing: float, seed: int
) -> None:
    rows, cols = tiling(max(tokens, 1), vocab, chunk)
    assert rows >= 1 and 1 <= cols <= vocab and rows * cols <= chunk * vocab
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, vocab, (tokens,), generator=gen)
    t[::3] = -100
    kw = {"reduction": "sum", "label_smoothing": smoothing}
    got = chunked_linear_cross_entropy(h, w, t, chunk_size=chunk, **kw)
    want = F.cross_entropy(h @ w.T, t, **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# -- memory, in bytes, against torch.profiler ----------------------------------------------------------
TOKENS, VOCAB, WIDTH, CHUNK = 256, 6000, 32, 16


def _lm_head(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(TOKENS, WIDTH, generator=gen, requires_grad=True)
    w = (torch.randn(VOCAB, WIDTH, generator=gen) / WIDTH**0.5).requires_grad_()
    return h, w, torch.randint(0, VOCAB, (TOKENS,), generator=gen)


def test_the_chunked_loss_never_allocates_a_tokens_by_vocab_block() -> None:
    h, w, t = _lm_head()
    rows, cols = tiling(TOKENS, VOCAB, CHUNK)
    tile = rows * cols * 4
    logits = TOKENS * VOCAB * 4
    with profiler_memory() as truth, memtrim.track() as trace:
        chunked_linear_cross_entropy(h, w, t, chunk_size=CHUNK).backward()
    assert memtrim_deltas(trace) == truth.deltas and trace.peak_bytes == truth.peak
    sizes = truth.allocated_sizes
    grad_w, grad_h = w.numel() * 4, h.numel() * 4
    assert max(sizes) == grad_w <= logits / 8  # the largest block is the weight's own gradient
    assert sizes.count(tile) == 2  # one tile in forward, one in backward
    assert not [s for s in sizes if tile < s < grad_w and s != grad_h]
    # peak: the weight's gradient, hidden's, one tile and (the tokens span two row blocks) one block of
    # the weight's gradient summed over them, plus vectors of a few bytes per token
    assert rows < TOKENS
    block = cols * WIDTH * 4
    assert sizes.count(block) == 1
    assert grad_w + grad_h + tile + block <= truth.peak <= grad_w + grad_h + tile + block + 64 * TOKENS + 4096

    with profiler_memory() as before:
        unfused(h, w, t).backward()
    assert sorted(before.allocated_sizes).count(logits) >= 4  # logits, log_softmax and two in backward
    assert before.peak >= 3 * logits > 3 * truth.peak


def test_saved_for_backward_is_hidden_weight_target_and_a_few_bytes_per_token() -> None:
    h, w, t = _lm_head()
    saved: list[int] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append(x.numel() * x.element_size())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = chunked_linear_cross_entropy(h, w, t, chunk_size=CHUNK)
    loss.backward()
    # hidden, weight, target, and per token the log-sum-exp's max and log-sum (fp32), and the count
    assert sorted(saved) == sorted([h.numel() * 4, w.numel() * 4, t.numel() * 8, TOKENS * 4, TOKENS * 4, 8])


def test_auto_chunk_follows_the_documented_budget() -> None:
    for tokens, vocab, width, dtype in [
        (1024, 50257, 768, torch.float32),
        (8192, 128256, 4096, torch.bfloat16),
        (4096, 32000, 4096, torch.float16),
        (100, 1000, 64, torch.float64),
    ]:
        chunk = auto_chunk_size(tokens, vocab, width, dtype)
        per_logit = 4 + dtype.itemsize if dtype.itemsize == 2 else dtype.itemsize
        budget = max(vocab * width * dtype.itemsize // 8, 8 * 2**20)
        assert chunk == tokens or (chunk % 8 == 0 and chunk * vocab * per_logit <= budget)
        assert chunk == tokens or (chunk + 8) * vocab * per_logit > budget
    assert auto_chunk_size(0, 10, 4, torch.float32) == 1


# -- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "kw", "error", "text"),
    [
        (((4, 8), (11, 9), (4,)), {}, ValueError, "weight must be [vocab, H]"),
        (((4, 8), (11, 8), (5,)), {}, ValueError, "shaped like hidden"),
        (((4, 8), (11, 8), (4,)), {"reduction": "avg"}, ValueError, "reduction must be one of"),
        (((4, 8), (11, 8), (4,)), {"chunk_size": 0}, ValueError, "chunk_size must be at least 1"),
        (((4, 8), (11, 8), (4,)), {"label_smoothing": 1.5}, ValueError, "label_smoothing"),
        (((4, 8), (0, 8), (4,)), {}, ValueError, "at least one class"),
    ],
)
def test_bad_input_is_a_clear_error(
    args: tuple[Any, ...], kw: dict[str, Any], error: type, text: str
) -> None:
    h, w, t = torch.randn(*args[0]), torch.randn(*args[1]), torch.zeros(*args[2], dtype=torch.long)
    with pytest.raises(error, match=text.replace("[", r"\[")):
        chunked_linear_cross_entropy(h, w, t, **kw)


def test_wrong_dtypes_and_out_of_range_targets_name_the_fix() -> None:
    h, w = torch.randn(4, 8), torch.randn(11, 8)
    with pytest.raises(TypeError, match="soft targets"):
        chunked_linear_cross_entropy(h, w, torch.rand(4))
    with pytest.raises(TypeError, match="share a dtype"):
        chunked_linear_cross_entropy(h, w.double(), torch.zeros(4, dtype=torch.long))
    with pytest.raises(IndexError, match="target 11 is out of bounds for a vocabulary of 11"):
        chunked_linear_cross_entropy(h, w, torch.tensor([0, 11, 2, 3]))
    loss = chunked_linear_cross_entropy(h, w, torch.tensor([0, 1, 2, 3], dtype=torch.int32))
    torch.testing.assert_close(loss, F.cross_entropy(h @ w.T, torch.tensor([0, 1, 2, 3])))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_it_matches_the_unfused_loss() -> None:  # pragma: no cover - no GPU in CI
    r = verify(
        unfused,
        chunked(3),
        inputs(7, 2000),
        mode="reference",
        device="cuda",
        dtypes=("fp32", "bf16"),
        layouts=("contiguous",),
        seeds=(0,),
        **QUIET,
    )
    r.assert_ok()


@given(st.integers(1, 10**6), st.integers(1, 300_000), st.integers(1, 4096))
def test_the_doctors_copy_of_the_tiling_is_the_fixes(tokens: int, vocab: int, chunk: int) -> None:
    # the doctor may not import the fixes (tests/test_architecture.py): it predicts with its own copy
    from memtrim.doctor.rules import loss

    assert loss.MIN_COLUMNS == MIN_COLUMNS
    assert loss._tiling(tokens, vocab, chunk) == tiling(tokens, vocab, chunk)
