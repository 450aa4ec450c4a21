"""The doctor on small programs with each planted pattern: every rule fires at the planted line, stays
silent on the fixed program and on clean ones, and applying its fix drops the peak (torch.profiler) by
what the finding predicted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from doctor_support import (
    ChunkedLinearCrossEntropy,
    assert_fix_measures,
    chunk_from,
    combined,
    findings,
    measure,
)
from programs import ScaledDifference
from torch import nn
from torch.utils.checkpoint import checkpoint

from memtrim.cases.gsq import GumbelQuantizer2Bit, minmax_scales
from memtrim.cases.gsq import function as gsq_function
from memtrim.cases.heads import head_results, head_results_broadcast
from memtrim.doctor.rules.elementwise import einsum_equation


def line_of(marker: str) -> int:
    """The line of this file that carries ``# <marker>``."""
    lines = Path(__file__).read_text().splitlines()
    hits = [n for n, text in enumerate(lines, start=1) if text.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, marker
    return hits[0]


# -- logits-cross-entropy, kept-output ------------------------------------------------------------
TOKENS, WIDTH, VOCAB = 256, 64, 4096


def _lm_head(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, WIDTH, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(VOCAB, WIDTH, generator=gen).to(dtype).requires_grad_()
    target = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    return hidden, weight, target


def test_logits_cross_entropy_fires_at_the_loss_and_the_chunked_loss_measures_its_prediction() -> None:
    hidden, weight, target = _lm_head()

    def original() -> None:
        logits = (hidden * 1.0) @ weight.t()  # planted: lm_head
        loss = F.cross_entropy(logits, target)  # planted: loss
        loss.backward()

    before = measure(original)
    (finding,) = findings(before.trace, "logits-cross-entropy")
    assert finding.site is not None and finding.site.line == line_of("planted: loss")
    assert [s.line for s in finding.sites] == [line_of("planted: loss"), line_of("planted: lm_head")]
    assert "memtrim.fixes.chunked_linear_cross_entropy(hidden, weight, target" in finding.fix
    assert "weight the [4096, 64] weight" in finding.fix
    assert f"[{TOKENS}, {WIDTH}] input" in finding.fix
    # the four [tokens, vocab] buffers: logits, saved log-softmax, two gradients in backward; and the
    # scaled copy of hidden the matmul saved (the fix is handed hidden itself, the scale folded in)
    assert sorted(a.bytes for a in finding.allocations) == [TOKENS * WIDTH * 4] + [TOKENS * VOCAB * 4] * 4
    grads = (hidden.grad, weight.grad)
    hidden.grad = weight.grad = None

    def fixed() -> None:
        loss = ChunkedLinearCrossEntropy.apply(hidden * 1.0, weight, None, target, chunk_from(finding))
        loss.backward()

    after = measure(fixed)
    assert_fix_measures(finding, before, after)
    torch.testing.assert_close((hidden.grad, weight.grad), grads)
    assert findings(after.trace, "logits-cross-entropy") == [] and findings(after.trace, "kept-output") == []


def test_kept_output_fires_at_the_held_result_and_letting_it_go_measures_its_prediction() -> None:
    hidden, weight, target = _lm_head()

    def model() -> dict[str, torch.Tensor]:
        logits = (hidden * 1.0) @ weight.t()  # planted: held logits
        return {"logits": logits, "loss": F.cross_entropy(logits, target)}

    def original() -> None:
        out = model()
        out["loss"].backward()

    before = measure(original)
    (finding,) = findings(before.trace, "kept-output")
    assert finding.site is not None and finding.site.line == line_of("planted: held logits")
    assert [a.bytes for a in finding.allocations] == [TOKENS * VOCAB * 4]
    hidden.grad = weight.grad = None

    def fixed() -> None:
        loss = model()["loss"]
        loss.backward()

    after = measure(fixed)
    assert_fix_measures(finding, before, after)
    assert findings(after.trace, "kept-output") == []


def test_a_small_classification_head_is_not_a_logits_finding() -> None:
    hidden = torch.randn(4096, 256, requires_grad=True)
    head = nn.Linear(256, 10)
    target = torch.randint(0, 10, (4096,))
    trace = measure(lambda: F.cross_entropy(head(hidden), target).backward()).trace
    assert findings(trace, "logits-cross-entropy") == []


def test_logits_the_program_reads_into_its_own_buffer_are_not_a_logits_finding() -> None:
    # an out= op (softmax.int_out) makes no storage: it is no view, it reads the logits into a tensor
    # the program keeps, which the chunked loss (no logits at all) could not fill
    hidden, weight, target = _lm_head()
    probs = torch.empty(TOKENS, VOCAB)

    def original() -> None:
        logits = (hidden * 1.0) @ weight.t()
        with torch.no_grad():
            torch.softmax(logits, dim=-1, out=probs)
        F.cross_entropy(logits, target).backward()

    trace = measure(original).trace
    assert "aten.softmax.int_out" in [op.op for op in trace.log.ops]
    assert findings(trace, "logits-cross-entropy") == []


# -- upcast-copy -----------------------------------------------------------------------------------
def test_upcast_copy_counts_the_downstream_buffers_and_staying_narrow_measures_it() -> None:
    hidden, weight, target = _lm_head(torch.bfloat16)

    def original() -> None:
        logits = (hidden * 1) @ weight.t()
        loss = F.cross_entropy(logits.float(), target)  # planted: upcast
        del logits
        loss.backward()

    before = measure(original)
    (finding,) = findings(before.trace, "upcast-copy")
    assert finding.site is not None and finding.site.line == line_of("planted: upcast")
    shrunk = finding.edits.resize
    # the fp32 log-softmax and both fp32 gradients of the loss would be bf16 without the upcast
    assert sum(1 for i in shrunk if before.trace.allocations[i].bytes == TOKENS * VOCAB * 4) == 3
    assert "chunked_linear_cross_entropy" in finding.fix  # it feeds a cross-entropy
    hidden.grad = weight.grad = None

    def fixed() -> None:
        logits = (hidden * 1) @ weight.t()
        loss = F.cross_entropy(logits, target)
        del logits
        loss.backward()

    after = measure(fixed)
    assert_fix_measures(finding, before, after)
    assert findings(after.trace, "upcast-copy") == []


# -- broadcast-then-reduce ------------------------------------------------------------------------
def _heads() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(64, 12, 64, generator=gen, requires_grad=True)
    W_O = torch.randn(12, 64, 768, generator=gen, requires_grad=True)
    return z, W_O


def _equation(fix: str) -> str:
    match = re.search(r"torch\.einsum\('([^']+)'", fix)
    assert match, fix
    return match.group(1)


def test_broadcast_then_reduce_gives_the_einsum_of_the_recorded_shapes_and_it_measures() -> None:
    z, W_O = _heads()
    before = measure(lambda: head_results_broadcast(z, W_O).square().sum().backward())
    (finding,) = findings(before.trace, "broadcast-then-reduce")
    assert finding.site is not None and finding.site.function == "head_results_broadcast"
    assert len(finding.allocations) == 3  # the forward product and both backward products
    equation = _equation(finding.fix)
    assert equation == "abc,bcd->abd"
    z.grad = W_O.grad = None
    after = measure(lambda: torch.einsum(equation, z, W_O).square().sum().backward())
    assert_fix_measures(finding, before, after)
    assert after.trace.diagnoses() == []


def test_broadcast_then_reduce_fires_under_no_grad_too() -> None:
    z, W_O = _heads()

    def original() -> None:
        with torch.no_grad():
            per_head = (z[..., None] * W_O).mean(-2)  # planted: no_grad broadcast
            del per_head

    before = measure(original)
    (finding,) = findings(before.trace, "broadcast-then-reduce")
    assert finding.site is not None and finding.site.line == line_of("planted: no_grad broadcast")
    assert finding.fix.startswith("torch.einsum('abc,bcd->abd', x, y).div_(64)")

    def fixed() -> None:
        with torch.no_grad():
            per_head = torch.einsum(_equation(finding.fix), z, W_O).div_(64)
            del per_head

    after = measure(fixed)
    assert_fix_measures(finding, before, after)
    with torch.no_grad():  # the equation is the broadcast's: the same result, summed in another order
        expected = (z[..., None] * W_O).mean(-2)
        torch.testing.assert_close(
            torch.einsum("abc,bcd->abd", z, W_O).div_(64), expected, rtol=1e-4, atol=1e-5
        )


def test_a_scalar_multiply_then_sum_is_not_a_broadcast() -> None:
    x = torch.randn(1024, 1024)
    trace = measure(lambda: (x.exp() * 2).sum()).trace
    assert findings(trace, "broadcast-then-reduce") == []


def test_einsum_equation_needs_one_way_to_fit_each_operand() -> None:
    assert einsum_equation([(8, 8), (8, 8)], (8, 8, 8), (8, 8)) is None  # ambiguous
    assert einsum_equation([(4, 5), (5, 6)], (4, 5, 6), (4, 6)) == ("ab,bc->ac", (1,))
    assert einsum_equation([(4, 1), (5,)], (4, 5), (4,)) is None  # a size-1 dim: squeeze first


# -- out-of-place-chain ----------------------------------------------------------------------------
class InPlace(ScaledDifference):
    """ScaledDifference with the prescribed rewrite: the same ops in the same order, in place."""

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        s, d = ctx.saved_tensors  # type: ignore[attr-defined]
        a = g - d
        a.mul_(s)
        a.mul_(3.0)
        return a, None


def test_out_of_place_chain_in_a_custom_backward_is_bit_exact_in_place() -> None:
    x = torch.randn(256, 1024, requires_grad=True)
    d = torch.randn(256, 1024)
    before = measure(lambda: ScaledDifference.apply(x, d).sum().backward())
    (finding,) = findings(before.trace, "out-of-place-chain")
    assert finding.site is not None and finding.site.function == "backward"
    assert finding.fix.startswith("t.mul_(u); t.mul_(3.0), t the result of the sub at programs.py:19")
    assert finding.verify_mode == "exact"
    assert finding.note is None  # one scalar step only
    original_grad, x.grad = x.grad, None
    after = measure(lambda: InPlace.apply(x, d).sum().backward())
    assert_fix_measures(finding, before, after)
    assert torch.equal(x.grad, original_grad)
    assert findings(after.trace, "out-of-place-chain") == []


def test_out_of_place_chain_in_ordinary_no_grad_code() -> None:
    x = torch.randn(1024, 1024)

    def original() -> None:
        with torch.no_grad():
            y = x * 2  # planted: chain head
            w = (y + 1).exp()
            del y, w

    before = measure(original)
    (finding,) = findings(before.trace, "out-of-place-chain")
    assert finding.site is not None and finding.site.line == line_of("planted: chain head")
    code, explained = finding.fix.split(", t the ", 1)
    assert code == "t.add_(1.0); t.exp_()", finding.fix
    head = line_of("planted: chain head")
    assert explained.startswith(f"result of the mul at test_doctor_programs.py:{head}"), explained

    def fixed() -> None:
        with torch.no_grad():
            t = x * 2
            exec(code, {"t": t})  # as printed
            del t

    after = measure(fixed)
    assert_fix_measures(finding, before, after)
    assert findings(after.trace, "out-of-place-chain") == []


def test_out_of_place_chain_names_a_number_the_line_holds_in_a_variable() -> None:
    """``/ temperature``: the printed call names the number (its value this run said) rather than pasting
    0.7 where the program reads a variable; executed as printed it is bit for bit the program's."""
    x = torch.randn(1024, 1024)
    temperature = 0.7
    kept: list[torch.Tensor] = []

    def original() -> None:
        with torch.no_grad():
            y = x - 1.5  # planted: named chain head
            kept.append((y / temperature).exp())

    before = measure(original)
    (finding,) = findings(before.trace, "out-of-place-chain")
    code, explained = finding.fix.split(", t the ", 1)
    assert code == "t.div_(c); t.exp_()", finding.fix
    head = line_of("planted: named chain head")
    assert f"c the number line {head + 1} divides it by (0.7 in this run) (kept.append(" in explained
    with torch.no_grad():
        t = x - 1.5
        exec(code, {"t": t, "c": temperature})  # as printed, c bound as the text says
    assert torch.equal(t, kept[0])

    def fixed() -> None:
        with torch.no_grad():
            t = x - 1.5
            exec(code, {"t": t, "c": temperature})
            kept.append(t)

    assert_fix_measures(finding, before, measure(fixed))


def test_a_result_read_later_or_saved_breaks_the_chain() -> None:
    x = torch.randn(1024, 1024, requires_grad=True)

    def program() -> None:
        y = x * 2
        z = y.exp()  # exp saves its result: nothing may write into it
        w = z * 3
        kept = y + 1
        (w.sum() + kept.sum() + y.sum()).backward()  # y is read after its chain step

    trace = measure(program).trace
    assert findings(trace, "out-of-place-chain") == []


def _gsq(variant: str) -> tuple[GumbelQuantizer2Bit, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 256, generator=gen)
    x = torch.randn(16, 256, generator=gen)
    torch.manual_seed(0)
    return GumbelQuantizer2Bit(weight, minmax_scales(weight, 128), group_size=128, backward=variant), x


def _backward_with_chains_in_place(
    grad_output, logits, scales, values, state, group_size, temperature, scale
):  # type: ignore[no-untyped-def]
    """GSQ's original backward with exactly the out-of-place-chain findings applied, nothing else."""
    dtype, eps = values.dtype, gsq_function._EPS
    u = gsq_function._draw_uniform(logits, state)
    noise = u.add_(eps).log_().neg_().add_(eps).log_().neg_().to(dtype)
    noise.add_(logits.to(dtype) * scale).div_(temperature)
    soft_quant = F.softmax(noise, dim=0)
    soft_output = (soft_quant * values.view(4, 1, 1)).sum(dim=0)
    scale_per_col = gsq_function._scale_per_col(scales, group_size).to(dtype)
    g_scale_per_col = soft_output.mul_(grad_output)
    grad_scales = gsq_function._grad_scales(g_scale_per_col, scales, group_size)
    g_soft_output = grad_output * scale_per_col
    g_q = g_soft_output.unsqueeze(0) * values.view(4, 1, 1)
    dot = (g_q * soft_quant).sum(dim=0, keepdim=True)
    grad_quant_logits = soft_quant.mul_(g_q - dot).mul_(scale).div_(temperature)
    return grad_quant_logits.to(logits.dtype), grad_scales


def test_gsq_original_backward_chains_fire_and_in_place_measures_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    q, x = _gsq("original")
    before = measure(lambda: (x @ q(0.5, 100.0).t()).square().mean().backward(), rng_states=1)
    chains = findings(before.trace, "out-of-place-chain")
    assert {d.site.function for d in chains if d.site} == {"_backward_original", "_draw_uniform"}
    assert all(d.verify_mode == "exact" for d in chains)
    tail = next(d for d in chains if "div_" in d.fix and d.site and d.site.function == "_backward_original")
    assert tail.note is not None and "bf16" in tail.note  # * scale / temperature: two scalar steps
    original_grad = q.quant_logits.grad.clone()
    q2, x2 = _gsq("original")
    monkeypatch.setattr(gsq_function, "_backward_original", _backward_with_chains_in_place)
    after = measure(lambda: (x2 @ q2(0.5, 100.0).t()).square().mean().backward(), rng_states=1)
    assert torch.equal(q2.quant_logits.grad, original_grad)  # same ops, same order: bit for bit
    predicted = before.trace.analysis.peak_with(combined(chains))
    measured = before.peak - after.peak
    assert measured > 0
    assert abs((before.trace.peak_bytes - predicted) - measured) <= 0.10 * measured


# -- checkpoint-candidates -------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Tower(nn.Module):
    def __init__(self, width: int = 128, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def test_checkpoint_candidates_name_the_blocks_and_checkpointing_measures_the_prediction() -> None:
    torch.manual_seed(0)
    tower, x = Tower(), torch.randn(2048, 128)
    before = measure(lambda: tower(x).square().mean().backward())
    (finding,) = findings(before.trace, "checkpoint-candidates")
    assert 'checkpoint_modules(model, ["blocks.*"])' in finding.fix
    # the recompute cost, from the recorded matmuls: what torch's FlopCounterMode counts on the live model
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        tower.blocks(x)
    assert finding.cost is not None and f"{counter.get_total_flops() / 1e9:.3g} GFLOP" in finding.cost
    grads = [p.grad.clone() for p in tower.parameters()]
    tower.zero_grad(set_to_none=True)

    def fixed() -> None:
        h = x
        for block in tower.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        tower.head(h).square().mean().backward()

    after = measure(fixed, rng_states=len(tower.blocks))
    assert_fix_measures(finding, before, after)
    assert all(torch.equal(p.grad, g) for p, g in zip(tower.parameters(), grads, strict=True))


# -- optimizer-step --------------------------------------------------------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))


def test_optimizer_step_temporaries_at_the_peak_suggest_fused() -> None:
    net, x = _mlp(), torch.randn(8, 1024)
    results = {}
    for kind in ("foreach", "fused"):
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, **{kind: True})

        def step(opt: torch.optim.Optimizer = opt) -> None:
            net(x).square().mean().backward()
            opt.step()  # planted: step
            opt.zero_grad()

        step()  # the state exists before the measured step
        results[kind] = measure(step)
    (finding,) = findings(results["foreach"].trace, "optimizer-step")
    assert finding.site is not None and finding.site.line == line_of("planted: step")
    assert "fused=True" in finding.fix and "foreach" in finding.problem
    assert_fix_measures(finding, results["foreach"], results["fused"])
    assert findings(results["fused"].trace, "optimizer-step") == []


def test_optimizer_state_made_and_dropped_in_the_region_is_not_counted_as_a_removable_temporary() -> None:
    # The whole first step inside the region, the optimizer dropped at its end (a test body, a script's
    # function): AdamW's state is made and freed in the optimizer phase like its temporaries, but a fused
    # step still makes it, so the prediction must keep it.
    x = torch.randn(8, 1024)

    def run(kind: str) -> None:
        torch.manual_seed(0)
        net = _mlp()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, **{kind: True})
        net(x).square().mean().backward()
        opt.step()  # planted: first step

    results = {kind: measure(lambda kind=kind: run(kind)) for kind in ("foreach", "fused")}
    (finding,) = findings(results["foreach"].trace, "optimizer-step")
    assert finding.site is not None and finding.site.line == line_of("planted: first step")
    state_bytes = 2 * sum(p.numel() * 4 for p in _mlp().parameters())
    assert state_bytes > finding.peak_before - finding.peak_after  # the state is not in the saving
    assert "alive at the peak" in finding.problem
    assert_fix_measures(finding, results["foreach"], results["fused"])
    # nor is it listed among the largest temporaries: torch.optim.AdamW makes its state with zeros_like
    analysis = results["foreach"].trace.analysis
    listed = analysis.largest_temporaries(1000)
    assert listed and all(a.op != "aten.zeros_like.default" for a in listed)
    made_state = [a for a in analysis.allocations if a.op == "aten.zeros_like.default"]
    assert sum(a.bytes for a in made_state) == state_bytes


def test_gradients_zeroed_in_place_into_the_next_forward_suggest_set_to_none() -> None:
    net, x = _mlp(), torch.randn(1024, 1024)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
    net(x).square().mean().backward()
    opt.step()

    def loop(set_to_none: bool) -> None:
        for _ in range(2):
            opt.zero_grad(set_to_none=set_to_none)  # planted: zero_grad
            y = net(x)
            (y * y).mean().backward()
            opt.step()

    runs = {}
    for set_to_none in (False, True):
        opt.zero_grad(set_to_none=True)  # the region makes its own gradients
        runs[set_to_none] = measure(lambda set_to_none=set_to_none: loop(set_to_none))
    (finding,) = findings(runs[False].trace, "optimizer-step")
    assert finding.site is not None and finding.site.line == line_of("planted: zero_grad")
    assert "set_to_none=True" in finding.fix
    assert_fix_measures(finding, runs[False], runs[True])
    assert findings(runs[True].trace, "optimizer-step") == []


# -- cache-in-training -----------------------------------------------------------------------------
class CachingAttention(nn.Module):
    """Attention that appends its keys and values to a cache (as generation code does), by default."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def update_cache(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = torch.cat([self.keys, k], dim=1)  # planted: cache
        self.values = torch.cat([self.values, v], dim=1)
        return self.keys, self.values

    def forward(self, x: torch.Tensor, use_cache: bool = True) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if use_cache:
            self.keys = self.values = x.new_empty(x.shape[0], 0, x.shape[2])
            k, v = self.update_cache(k, v)
        return self.out(F.scaled_dot_product_attention(q, k, v))


def test_cache_in_training_fires_on_the_cache_line_and_use_cache_false_measures_it() -> None:
    torch.manual_seed(0)
    attention, x = CachingAttention(), torch.randn(8, 512, 64)
    before = measure(lambda: attention(x).square().mean().backward())
    (finding,) = findings(before.trace, "cache-in-training")
    assert finding.site is not None and finding.site.line == line_of("planted: cache")
    assert "use_cache=False" in finding.fix
    assert findings(before.trace, "kept-output") == []  # the cache is not called a kept output
    attention.zero_grad(set_to_none=True)
    del attention.keys, attention.values
    after = measure(lambda: attention(x, use_cache=False).square().mean().backward())
    assert_fix_measures(finding, before, after)
    assert findings(after.trace, "cache-in-training") == []


# -- clean programs --------------------------------------------------------------------------------
def test_no_advice_for_clean_programs() -> None:
    torch.manual_seed(0)
    net, x = _mlp(), torch.randn(64, 1024)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)

    def mlp_step() -> None:
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    mlp_step()
    q = nn.Linear(64, 192)
    tokens = torch.randn(4, 256, 64)

    def attention() -> None:  # one projection, heads split by views, fused attention
        qkv = q(tokens).view(4, 256, 3, 4, 16).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        out.transpose(1, 2).reshape(4, 256, 64).square().mean().backward()

    z, W_O = _heads()
    lean, lean_x = _gsq("lean")
    programs = {
        "mlp": mlp_step,
        "attention": attention,
        "einsum heads": lambda: head_results(z, W_O).square().sum().backward(),
        "gsq lean": lambda: (lean_x @ lean(0.5, 100.0).t()).square().mean().backward(),
    }
    for name, program in programs.items():
        trace = measure(program, rng_states=1).trace
        found = trace.diagnoses()
        if name == "mlp":
            # any step that keeps every gradient until optimizer.step() can step in backward instead:
            # the one lever left on a clean training step (tests/test_doctor_optimizer_state.py)
            assert [(d.rule, "optimizer_in_backward" in d.fix) for d in found] == [("optimizer-state", True)]
            continue
        assert found == [], (name, [(d.rule, d.problem) for d in found])
