"""The CUDA checks issues 2 and 5 ask for, as one prepared script for a session that is lent a GPU.

    python bench/gpu_check.py            # needs a CUDA build of torch and a GPU; ~1-2 minutes

1. memtrim's peak vs torch.cuda.max_memory_allocated (same region) for the head-results broadcast and
   einsum (GPT-2 small, 512 tokens, fwd+bwd) and a custom-backward program (GSQ's quantizer).
2. The fake-mode prediction (FakeTensorMode on the cuda device; 512-byte blocks) vs the real CUDA peak.
3. GSQ lean vs original on CUDA: bit-exactness with CUDA RNG replay, both backward peaks from
   max_memory_allocated, and one full-size Qwen3-14B down_proj step vs its fake-mode estimate.

Nothing here runs in CI. It prints figures; it asserts only that the run was possible.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

import memtrim
from memtrim.cases.gsq import GumbelQuantizer2Bit
from memtrim.cases.gsq.memory import measure_step
from memtrim.cases.gsq.scales import minmax_scales
from memtrim.cases.heads import head_results, head_results_broadcast

MiB = 2**20


def heads_program(fn: Callable[..., torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        z = torch.randn(512, 12, 64, device="cuda", requires_grad=True)
        W_O = torch.randn(12, 64, 768, device="cuda", requires_grad=True)
        fn(z, W_O).square().sum().backward()

    return run


def custom_backward_program() -> None:
    # GSQ's quantizer: a custom autograd.Function whose backward replays the forward's CUDA RNG draw
    weight = torch.randn(2048, 4096, device="cuda") * 0.02
    q = GumbelQuantizer2Bit(weight, minmax_scales(weight, 128), backward="original")
    (torch.randn(64, 4096, device="cuda") @ q(0.5, 100.0).T).square().mean().backward()


def compare_with_cuda(name: str, program: Callable[[], None]) -> None:
    torch.cuda.synchronize()
    with memtrim.track() as real:
        program()
    with memtrim.track(fake=True) as fake:
        program()
    measured = real.cuda_max_allocated.get("cuda:0", -1)
    ours, predicted = real.peak_bytes, fake.peak_bytes
    print(
        f"{name:34s} memtrim {ours / MiB:10.2f} MiB | max_memory_allocated {measured / MiB:10.2f} MiB | "
        f"delta {(measured - ours) / MiB:+8.3f} MiB | fake prediction {predicted / MiB:10.2f} MiB "
        f"(delta {(measured - predicted) / MiB:+8.3f} MiB)"
    )


def gsq_step(q: GumbelQuantizer2Bit, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """One step; returns the soft weight and the backward's peak above its start (max_memory_allocated)."""
    w = q(0.5, 100.0)
    loss = (x @ w.T).float().square().mean()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    return w.detach(), torch.cuda.max_memory_allocated() - start


def gsq_checks() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    out_f, in_f, group = 2048, 4096, 128
    weight = torch.randn(out_f, in_f, device="cuda", generator=gen) * 0.02
    x = torch.randn(64, in_f, device="cuda", generator=gen)
    for logits_dtype in (torch.float32, torch.bfloat16):
        results = {}
        for variant in ("original", "lean"):
            torch.manual_seed(1)
            q = GumbelQuantizer2Bit(
                weight,
                minmax_scales(weight, group),
                group_size=group,
                logits_dtype=logits_dtype,
                backward=variant,
            )
            torch.cuda.manual_seed(7)
            w, peak = gsq_step(q, x)
            assert q.quant_logits.grad is not None and q.scales.grad is not None
            results[variant] = (w, q.quant_logits.grad.clone(), q.scales.grad.clone(), peak, q.quant_logits)
        o, lean = results["original"], results["lean"]
        buffer = o[4].numel() * o[4].element_size()
        equal = all(torch.equal(a, b) for a, b in zip(o[:3], lean[:3], strict=True))
        print(
            f"GSQ {tuple(weight.shape)} {logits_dtype}: lean == original bit for bit: {equal}; backward peak "
            f"original {o[3] / buffer:.3f} buffers, lean {lean[3] / buffer:.3f} buffers"
        )

    out_f, in_f = 5120, 17408  # Qwen3-14B mlp.down_proj
    bf16 = torch.bfloat16
    weight = torch.randn(out_f, in_f, device="cuda", dtype=bf16) * 0.02
    x = torch.randn(64, in_f, device="cuda", dtype=bf16)
    for variant in ("original", "lean"):
        with memtrim.track(fake=True):  # the same step with fake CUDA tensors: nothing allocated
            wf = torch.randn(out_f, in_f, device="cuda", dtype=bf16) * 0.02
            qf = GumbelQuantizer2Bit(wf, minmax_scales(wf.float(), 128), logits_dtype=bf16, backward=variant)
            estimate = measure_step(qf, torch.randn(64, in_f, device="cuda", dtype=bf16)).backward_peak
        q = GumbelQuantizer2Bit(
            weight, minmax_scales(weight.float(), 128), logits_dtype=bf16, backward=variant
        )
        _, measured = gsq_step(q, x)
        print(
            f"GSQ down_proj {variant:8s}: real backward peak {measured / 2**30:.3f} GiB "
            f"(max_memory_allocated), fake estimate {estimate / 2**30:.3f} GiB "
            f"(delta {(measured - estimate) / MiB:+.2f} MiB)"
        )
        del q
        torch.cuda.empty_cache()


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/gpu_check.py needs a CUDA GPU and a CUDA build of torch; nothing was run.")
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    torch.cuda.init()
    compare_with_cuda("heads broadcast, 512 tokens, fwd+bwd", heads_program(head_results_broadcast))
    compare_with_cuda("heads einsum, 512 tokens, fwd+bwd", heads_program(head_results))
    compare_with_cuda("GSQ original (custom backward)", custom_backward_program)
    gsq_checks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
