"""GSQ's Gumbel-softmax backward, original vs lean: measured on this CPU and predicted at full size.

1. Real run on the CPU at a larger size: the backward peak from memtrim and, independently, from
   torch.profiler's allocator events in the same run, in units of one (4, out, in) buffer; the lines memtrim
   names at the original's peak; bit-exactness of outputs and gradients; backward wall time (median).
2. memtrim.track(fake=True) at the full Qwen3-14B down_proj size, (out, in) = (5120, 17408), bf16 logits:
   nothing is allocated. Backward peak and whole-step needs with Lion and with Adam, and whether one
   backward's temporaries fit in 12 GiB next to the logits, their gradient and the optimizer state.

Backward peak: during loss.backward(), the highest live bytes minus those live when it starts.
Run: python bench/gsq.py [--out 1024 --in 4096]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import memtrim
from memtrim.cases.gsq import GumbelQuantizer2Bit, Lion, minmax_scales
from memtrim.cases.gsq.memory import measure_step

GIB = 2**30
MIB = 2**20
BUDGET_GIB = 12
QWEN3_14B_DOWN_PROJ = (5120, 17408)


def _make(out_f: int, in_f: int, dtype: torch.dtype, variant: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_f, in_f, generator=gen).to(dtype)
    x = torch.randn(64, in_f, generator=gen).to(dtype)
    torch.manual_seed(seed)
    q = GumbelQuantizer2Bit(weight, minmax_scales(weight, 128), group_size=128, backward=variant)
    return q, x


def _backward_seconds(q: GumbelQuantizer2Bit, x: torch.Tensor) -> float:
    w = q(0.5, 100.0)
    loss = (x @ w.T).float().square().mean()
    del w
    start = time.perf_counter()
    loss.backward()
    elapsed = time.perf_counter() - start
    q.zero_grad(set_to_none=True)
    return elapsed


def measured(out_f: int, in_f: int, repeats: int) -> None:
    print(f"== measured on this CPU: (out, in) = ({out_f}, {in_f}), group 128, 64 tokens ==")
    print(
        f"{'dtype':<9} {'variant':<9} {'buffer':>9} {'bwd peak memtrim':>20} {'bwd peak profiler':>20} "
        f"{'step peak':>10} {'bwd median':>11}"
    )
    for dtype in (torch.float32, torch.bfloat16):
        qs = {v: _make(out_f, in_f, dtype, v) for v in ("original", "lean")}
        steps = {v: measure_step(q, x, with_profiler=True) for v, (q, x) in qs.items()}
        for q, _ in qs.values():
            q.zero_grad(set_to_none=True)
        times: dict[str, list[float]] = {v: [] for v in qs}
        for _ in range(repeats):  # A/B interleaved
            for v, (q, x) in qs.items():
                times[v].append(_backward_seconds(q, x))
        for v, s in steps.items():
            buf = s.buffer_bytes
            assert s.profiler_backward_peak is not None
            print(
                f"{str(dtype).replace('torch.', ''):<9} {v:<9} {buf / MIB:>5.0f} MiB "
                f"{s.backward_peak / buf:>9.3f} buffers {s.profiler_backward_peak / buf:>9.3f} buffers "
                f"{s.step_peak / buf:>7.3f} b {statistics.median(times[v]) * 1e3:>8.1f} ms"
            )
        saved = (steps["original"].backward_peak - steps["lean"].backward_peak) / steps["lean"].buffer_bytes
        print(f"{'':<9} lean saves {saved:.3f} buffers of backward peak")
        _check_bitwise(out_f, in_f, dtype)
        if dtype == torch.float32:
            _print_peak_lines(steps["original"])


def _check_bitwise(out_f: int, in_f: int, dtype: torch.dtype) -> None:
    results = []
    for variant in ("original", "lean"):
        q, x = _make(out_f, in_f, dtype, variant, seed=1)
        torch.manual_seed(5)
        w = q(0.5, 100.0)
        torch.rand(1000)  # the forward's stream is consumed before backward
        (x @ w.T).float().square().mean().backward()
        results.append((w.detach(), q.quant_logits.grad, q.scales.grad))
    same = all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    print(f"{'':<9} lean == original bit for bit (output, grad logits, grad scales): {same}")


def _print_peak_lines(step) -> None:
    print("  memtrim, live at the original step's peak (largest source lines):")
    for group in step.trace.live_at_peak()[:6]:
        site = group.site
        where = f"{site.file.rsplit('/', 1)[-1]}:{site.line} {site.function}" if site else "?"
        print(f"    {group.bytes / step.buffer_bytes:6.2f} buffers  {where}  ({', '.join(group.ops)})")


def _state_bytes(q: GumbelQuantizer2Bit, optimizer: torch.optim.Optimizer) -> int:
    return sum(
        t.numel() * t.element_size()
        for p in q.parameters()
        for t in optimizer.state[p].values()
        if isinstance(t, torch.Tensor)
    )


def predicted(out_f: int, in_f: int) -> None:
    print(
        f"\n== predicted with memtrim.track(fake=True): Qwen3-14B down_proj (out, in) = ({out_f}, {in_f}), "
        "bf16 weight and logits, group 128, 64 tokens =="
    )
    start = time.perf_counter()
    rows = []
    for opt_name in ("lion", "adam"):
        for variant in ("original", "lean"):
            with memtrim.track(fake=True):
                q, x = _make(out_f, in_f, torch.bfloat16, variant)
                opt = (
                    Lion(q.parameters(), lr=1e-4) if opt_name == "lion" else torch.optim.Adam(q.parameters())
                )
                measure_step(q, x, optimizer=opt)  # the first step creates the optimizer state
                step = measure_step(q, x, optimizer=opt)
                params = sum(p.numel() * p.element_size() for p in q.parameters())
                logits = q.quant_logits.numel() * q.quant_logits.element_size()
                state = _state_bytes(q, opt)
            rows.append((opt_name, variant, step, params, logits, state))
    seconds = time.perf_counter() - start
    buf = rows[0][2].buffer_bytes
    print(
        f"one (4, out, in) bf16 buffer = {buf / MIB:.0f} MiB; "
        f"8 fake steps measured in {seconds:.1f} s on this CPU"
    )
    print(
        f"{'optimizer':<9} {'variant':<9} {'bwd peak':>20} {'bwd temporaries':>16} {'logits+grad+state':>18} "
        f"{'sum':>9} {'whole step':>11}  fits {BUDGET_GIB} GiB?"
    )
    for opt_name, variant, step, params, logits, state in rows:
        # The logits' gradient is born in backward, so it is part of the backward peak; count it once.
        temporaries = step.backward_peak - logits
        beside = logits + logits + state + (params - logits)  # logits, their gradient, state, scales
        total = temporaries + beside
        whole = params + state + step.step_peak  # resident before the step + the step's own peak
        verdict = "yes" if total <= BUDGET_GIB * GIB else "no"
        print(
            f"{opt_name:<9} {variant:<9} "
            f"{step.backward_peak / GIB:>6.2f} GiB ({step.backward_buffers:5.2f} b) "
            f"{temporaries / GIB:>12.2f} GiB {beside / GIB:>14.2f} GiB {total / GIB:>5.2f} GiB "
            f"{whole / GIB:>7.2f} GiB  {verdict}, {(BUDGET_GIB * GIB - total) / GIB:.2f} GiB left"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=int, default=1024)
    p.add_argument("--in", dest="in_f", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    measured(args.out, args.in_f, args.repeats)
    predicted(*QWEN3_14B_DOWN_PROJ)


if __name__ == "__main__":
    main()
