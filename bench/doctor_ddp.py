"""``ddp-gradient-as-bucket-view`` on DDP programs the tests do not run, predicted against measured.

Two gloo ranks (``torch.multiprocessing.spawn``), each running every probe twice: the model wrapped
with ``gradient_as_bucket_view=False`` and with ``True``. A warm step (after two untracked ones) is
measured under torch.profiler and memtrim at once (``distributed_programs.measure_settled``). For each
probe and rank it prints whether the rule fires on the ``False`` run, the peak its what-if predicts
after the fix, the torch.profiler peak of the ``True`` run, and whether the rule is silent there. A
block freed on a gloo worker thread (a comm hook's compressed bucket, dropped by the future's
callback) is never seen freed by the profiler; its free is placed where its address is handed out
again, and the verdict says so.

Probes: transformers' GPT-2 (``GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000)``, random
weights) with AdamW and the loss from ``labels=``; the same with small buckets (``bucket_cap_mb``);
gradient accumulation over 2 micro-batches with ``no_sync()`` on the first, and without it;
``zero_grad(set_to_none=False)``; a frozen part and an unused branch (``find_unused_parameters=True``);
bf16 autocast; bf16 weights; a comm hook (``fp16_compress_hook``; ``bf16_compress_hook`` needs CUDA
and NCCL). About six minutes on a shared 2-core CPU.

    python bench/doctor_ddp.py [probe ...]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import distributed_programs
from distributed_programs import measure_settled

RULE = "ddp-gradient-as-bucket-view"
WORLD = 2
BATCH, TOKENS, VOCAB = 2, 32, 1000

Step = Callable[[], None]


def _gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB)
    return transformers.GPT2LMHeadModel(config)


def _ids(rank: int, micro: int = 0, shape: tuple[int, int] = (BATCH, TOKENS)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(10 * rank + micro))


def _wrap(model: nn.Module, view: bool, **kwargs: Any) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, gradient_as_bucket_view=view, **kwargs)


def gpt2(
    rank: int,
    view: bool,
    *,
    autocast: bool = False,
    bf16: bool = False,
    shape: tuple[int, int] = (BATCH, TOKENS),
    **ddp: Any,
) -> Step:
    torch.manual_seed(0)
    model = _gpt2()
    if bf16:
        model = model.to(torch.bfloat16)
    model = _wrap(model, view, **ddp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = _ids(rank, shape=shape)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def gpt2_hook(rank: int, view: bool, shape: tuple[int, int] = (BATCH, TOKENS)) -> Step:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    model = _wrap(_gpt2(), view)
    model.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)  # type: ignore[operator]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = _ids(rank, shape=shape)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def accumulate(rank: int, view: bool, *, no_sync: bool) -> Step:
    torch.manual_seed(0)
    model = _wrap(_gpt2(), view)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    micro = [_ids(rank, 0), _ids(rank, 1)]

    def step() -> None:
        with model.no_sync() if no_sync else nullcontext():  # type: ignore[operator]
            (model(input_ids=micro[0], labels=micro[0]).loss / 2).backward()
        (model(input_ids=micro[1], labels=micro[1]).loss / 2).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def keep_zeroed(rank: int, view: bool) -> Step:
    torch.manual_seed(0)
    model = _wrap(_gpt2(), view)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = _ids(rank)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    return step


class Branchy(nn.Module):
    """A frozen embedding, a trained trunk, and a branch used only on rank 0 (``find_unused_parameters``)."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.trunk = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        self.branch = nn.Linear(dim, dim)
        self.use_branch = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.frozen(x)
        for layer in self.trunk:
            x = torch.relu(layer(x))
        if self.use_branch:
            x = x + self.branch(x)
        return x


def unused(rank: int, view: bool, *, branch_on: tuple[int, ...]) -> Step:
    torch.manual_seed(0)
    inner = Branchy()
    inner.use_branch = rank in branch_on
    model = _wrap(inner, view, find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


PROBES: dict[str, Callable[[int, bool], Step]] = {
    "gpt2": gpt2,
    "gpt2 bucket_cap_mb=0.1": lambda r, v: gpt2(r, v, bucket_cap_mb=0.1),
    "gpt2 1x8 tokens": lambda r, v: gpt2(r, v, shape=(1, 8)),
    "gpt2 1x8 tokens, bucket_cap_mb=0.1": lambda r, v: gpt2(r, v, shape=(1, 8), bucket_cap_mb=0.1),
    "accumulate, no_sync first": lambda r, v: accumulate(r, v, no_sync=True),
    "accumulate, no no_sync": lambda r, v: accumulate(r, v, no_sync=False),
    "zero_grad(set_to_none=False)": keep_zeroed,
    "frozen + unused branch (none)": lambda r, v: unused(r, v, branch_on=()),
    "frozen + unused branch (rank 0)": lambda r, v: unused(r, v, branch_on=(0,)),
    "bf16 autocast": lambda r, v: gpt2(r, v, autocast=True),
    "bf16 weights": lambda r, v: gpt2(r, v, bf16=True),
    "fp16_compress_hook": gpt2_hook,
    "fp16_compress_hook 1x8 tokens": lambda r, v: gpt2_hook(r, v, shape=(1, 8)),
}


def probe(rank: int, name: str, view: bool, keep: str | None) -> dict[str, Any]:
    step = PROBES[name](rank, view)
    step()  # DDP rebuilds its buckets in the second step's forward, in the order grads came
    step()
    result = measure_settled(step)
    trace = result["trace"]
    if keep:
        trace.save(str(Path(keep, f"{name.replace(' ', '_')}.{view}.rank{rank}.json")))
    findings = [d for d in trace.diagnoses() if d.rule == RULE]
    return {
        "memtrim_peak": result["memtrim_peak"],
        # a block freed on a gloo worker thread is never seen freed by the profiler; it was freed
        # no later than its address was handed out again, where this peak places the free
        "profiler_peak": result["profiler_peak_with_reuse_frees"],
        "profiler_peak_as_seen": result["profiler_peak"],
        "findings": [(d.peak_before, d.peak_after, d.bytes_at_stake) for d in findings],
    }


def ranks(rank: int, world: int, port: int, out: str, names: list[str], keep: str | None) -> None:
    distributed_programs.init(rank, world, port)
    results = {name: {str(view): probe(rank, name, view, keep) for view in (False, True)} for name in names}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def verdict(copies: dict[str, Any], views: dict[str, Any]) -> str:
    caveat = ""
    for run, result in (("False", copies), ("True", views)):
        seen, placed, ours = result["profiler_peak_as_seen"], result["profiler_peak"], result["memtrim_peak"]
        if seen != ours:
            caveat += f"; {run} run: memtrim {ours:,} B, the profiler {seen:,} B"
            if placed != seen:
                caveat += f" ({placed:,} B with the free it missed placed at its address's reuse)"
    if views["findings"]:
        return "WRONG: fires on the True run" + caveat
    drop = copies["profiler_peak"] - views["profiler_peak"]
    if not copies["findings"]:
        material = drop >= 0.01 * copies["profiler_peak"]
        return f"silent; measured drop {drop:,} B" + (" (material)" if material else "") + caveat
    (_, after, _), *_ = copies["findings"]
    off = after - views["profiler_peak"]
    return ("exact" if off == 0 else f"off by {off:+,} B") + caveat


def main() -> None:
    import torch.multiprocessing as mp

    names = sys.argv[1:] or list(PROBES)
    keep = os.environ.get("MEMTRIM_KEEP_TRACES")
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(ranks, args=(WORLD, distributed_programs.free_port(), out, names, keep), nprocs=WORLD)
        results = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    header = f"{'peak (False)':>12}  {'predicted':>10}  {'measured (True)':>15}  {'memtrim (True)':>14}"
    print(f"{'probe':34} rank  fires  {header}  verdict")
    for name in names:
        for rank, result in enumerate(results):
            copies, views = result[name]["False"], result[name]["True"]
            predicted = f"{copies['findings'][0][1]:,}" if copies["findings"] else "-"
            print(
                f"{name:34} {rank:>4}  {'yes' if copies['findings'] else 'no':>5}  "
                f"{copies['profiler_peak']:>12,}  {predicted:>10}  {views['profiler_peak']:>15,}  "
                f"{views['memtrim_peak']:>14,}  {verdict(copies, views)}"
            )


if __name__ == "__main__":
    main()
