"""all-gather-saved-for-backward on tensor- and sequence-parallel programs it was not built on.

Two gloo ranks (spawned), each program measured on a warm step under torch.profiler and memtrim at once
(``tests/distributed_programs.measure_settled``), as written and with the rule's fix applied
(``torch.utils.checkpoint.checkpoint(fn, shard, use_reentrant=False)`` around the gather and the ops
that read it; for a probe the rule should be silent on, the same program checkpointed). Prints, per
probe and rank: whether the rule fired, the peak as written, the peak it predicts after the fix, the
peak measured with the fix, and the verdict (a finding's predicted drop within 10% of the measured
one; silence where the rule should be silent). About 30 s on a 2-core CPU.

``DOCTOR_TP_VERBOSE=1`` prints each rank's JSON and tracebacks; ``DOCTOR_TP_SAVE=folder`` saves every
trace; names on the command line run those probes only.

    python bench/doctor_tp.py
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import distributed_programs
from distributed_programs import free_port, init, measure_settled

_profiled: list[Any] = []
_profiler_memory = distributed_programs.profiler_memory


@contextlib.contextmanager
def _keeping_profiled() -> Iterator[Any]:
    """``groundtruth.profiler_memory``, its last result kept (for the blocks it set aside)."""
    with _profiler_memory() as truth:
        _profiled[:] = [truth]
        yield truth


distributed_programs.profiler_memory = _keeping_profiled

RULE = "all-gather-saved-for-backward"
WORLD = 2


# -- the programs: each returns (step, zero_grad) for (rank, fixed) --------------------------------
def _zero(params: list[torch.Tensor]) -> Callable[[], None]:
    def zero_grad() -> None:
        for p in params:
            p.grad = None

    return zero_grad


class _SpMlp(nn.Module):
    """A sequence-parallel MLP block: RMSNorm (SequenceParallel), up (ColwiseParallel from Shard(1)),
    relu, down (RowwiseParallel to Shard(1)), residual."""

    def __init__(self, dim: int, hidden: int, fixed: bool) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.fixed = fixed

    def forward(self, x: Any) -> Any:
        h = self.norm(x)
        # the up projection's input hook all-gathers h (Shard(1) -> Replicate); the matmul saves it
        up = checkpoint(self.up, h, use_reentrant=False) if self.fixed else self.up(h)
        return x + self.down(torch.relu(up))


def dtensor_sp(rank: int, fixed: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    dim, hidden = 256, 128
    blocks = nn.Sequential(*(_SpMlp(dim, hidden, fixed) for _ in range(3)))
    for block in blocks:
        parallelize_module(
            block,
            mesh,
            {
                "norm": SequenceParallel(),
                "up": ColwiseParallel(input_layouts=Shard(1)),
                "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            },
        )
    x = distribute_tensor(torch.randn(2, 256, dim), mesh, [Shard(1)])

    def step() -> None:
        blocks(x).to_local().pow(2).sum().backward()

    return step, _zero(list(blocks.parameters()))


def _sp_mlp_forward(mlp: nn.Module, mesh: Any, fixed: bool) -> Callable[[Any], Any]:
    from torch.distributed.tensor import Replicate

    def gather_and_project(x: Any) -> tuple[torch.Tensor, torch.Tensor]:
        full = x.redistribute(mesh, [Replicate()]).to_local()  # LLAMA_MLP_GATHER
        return mlp.gate_proj(full), mlp.up_proj(full)

    def forward(x: Any) -> Any:
        gate, up = checkpoint(gather_and_project, x, use_reentrant=False) if fixed else gather_and_project(x)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    return forward


def llama_tp(rank: int, fixed: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=1000,
    )
    model = transformers.LlamaForCausalLM(config)
    parallelize_module(
        model,
        mesh,
        {
            "model.embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
            ),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for layer in model.model.layers:
        parallelize_module(
            layer,
            mesh,
            {
                "input_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                ),
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                "post_attention_layernorm": SequenceParallel(),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            },
        )
        # the MLP's gather written out (as PrepareModuleInput would run it), so that the fix can
        # checkpoint the gather and the two projections that read it, and nothing else
        layer.mlp.forward = _sp_mlp_forward(layer.mlp, mesh, fixed)  # type: ignore[method-assign]
    ids = torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    return step, _zero(list(model.parameters()))


class GatherC10d(torch.autograd.Function):
    """Megatron's gather-from-sequence-parallel-region: all-gather in forward, reduce-scatter in
    backward (``dist.all_gather_into_tensor`` into a tensor it allocates)."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor) -> torch.Tensor:
        out = torch.empty(shard.shape[0] * dist.get_world_size(), *shard.shape[1:], dtype=shard.dtype)
        dist.all_gather_into_tensor(out, shard.contiguous())
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        shard = torch.empty(grad.shape[0] // dist.get_world_size(), *grad.shape[1:], dtype=grad.dtype)
        dist.reduce_scatter_tensor(shard, grad.contiguous())
        return shard


TOKENS, DIM, LAYERS = 64, 512, 3


def _layer_weights(rank: int) -> tuple[list[nn.Parameter], torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    rows = TOKENS // WORLD
    w = [nn.Parameter(torch.randn(rows, TOKENS, generator=g) / TOKENS**0.5) for _ in range(LAYERS)]
    return w, torch.randn(rows, DIM, generator=g)


def c10d_function(rank: int, fixed: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    mixing, x = _layer_weights(rank)

    def layer(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w @ GatherC10d.apply(h)

    def step() -> None:
        h = x
        for w in mixing:
            h = checkpoint(layer, h, w, use_reentrant=False) if fixed else layer(h, w)
        h.pow(2).sum().backward()

    return step, _zero(mixing)


def _gather(shard: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    return funcol.all_gather_single_autograd(shard, 0, dist.group.WORLD)


def elementwise_only(rank: int, fixed: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    """The gathered tensor read by ``+ bias`` (whose backward saves nothing) and a matmul on the sum:
    autograd saves the sum, not the gathered tensor. Silent."""
    mixing, x = _layer_weights(rank)
    bias = nn.Parameter(torch.zeros(DIM))

    def layer(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w @ (_gather(h) + bias)

    def step() -> None:
        h = x
        for w in mixing:
            h = checkpoint(layer, h, w, use_reentrant=False) if fixed else layer(h, w)
        h.pow(2).sum().backward()

    return step, _zero([*mixing, bias])


def forward_only_read(rank: int, fixed: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    """The gathered tensor read only in forward (a sum of it scales the shard). Silent."""
    mixing, x = _layer_weights(rank)

    def layer(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w @ torch.cat([h, h]) * _gather(h).sum()

    def step() -> None:
        h = x
        for w in mixing:
            h = checkpoint(layer, h, w, use_reentrant=False) if fixed else layer(h, w)
        h.pow(2).sum().backward()

    return step, _zero(mixing)


def no_grad_gather(rank: int, fixed: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    """The gather under ``no_grad`` (a frozen input), its result read by a matmul (outside
    ``no_grad``) that saves it: checkpoint around both frees it, as around a gather with grad."""
    mixing, x = _layer_weights(rank)

    def layer(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            full = _gather(h)
        return w @ full

    def step() -> None:
        loss = 0
        for w in mixing:
            mixed = checkpoint(layer, x, w, use_reentrant=False) if fixed else layer(x, w)
            loss = loss + mixed.pow(2).sum()
        loss.backward()

    return step, _zero(mixing)


def no_grad_step(rank: int, fixed: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    """Every layer under ``no_grad`` (an evaluation step): nothing is saved. Silent."""
    mixing, x = _layer_weights(rank)

    def step() -> None:
        with torch.no_grad():
            h = x
            for w in mixing:
                h = w @ _gather(h)
            h.pow(2).sum()

    return step, _zero(mixing)


KEPT: list[torch.Tensor] = []


def kept_after_backward(rank: int, fixed: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    """The gathered tensors saved by the matmul and also kept by the caller past backward (logged,
    returned): checkpoint cannot free what the caller holds. Must promise no saving."""
    mixing, x = _layer_weights(rank)

    def layer(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full = _gather(h)
        return w @ full, full

    def step() -> None:
        KEPT.clear()
        h = x
        for w in mixing:
            h, full = checkpoint(layer, h, w, use_reentrant=False) if fixed else layer(h, w)
            KEPT.append(full)
        (h.pow(2).sum() + torch.cat([h] * 16).sum()).backward()  # the peak: forward's end

    return step, _zero(mixing)


def uneven_dtensor(rank: int, fixed: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    """A DTensor sharded unevenly (63 tokens over 2 ranks: 32 and 31) redistributed to Replicate (rank
    1 pads its shard to 32 rows first) and mixed by a replicated matmul, sharded again."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    tokens = TOKENS - 1
    g = torch.Generator().manual_seed(0)
    mixing = [nn.Parameter(torch.randn(tokens, tokens, generator=g) / tokens**0.5) for _ in range(LAYERS)]
    x = distribute_tensor(torch.randn(tokens, DIM, generator=g), mesh, [Shard(0)])

    def layer(h: Any, w: torch.Tensor) -> Any:
        full = h.redistribute(mesh, [Replicate()]).to_local()
        return DTensor.from_local(w @ full, mesh, [Replicate()]).redistribute(mesh, [Shard(0)])

    def step() -> None:
        h = x
        for w in mixing:
            h = checkpoint(layer, h, w, use_reentrant=False) if fixed else layer(h, w)
        h.to_local().pow(2).sum().backward()

    return step, _zero(mixing)


PROBES: dict[str, tuple[Callable[..., Any], bool]] = {
    # name: (program, whether the rule should fire on the program as written)
    "dtensor_sp_mlp": (dtensor_sp, True),
    "llama_tp_sp": (llama_tp, True),
    "c10d_function": (c10d_function, True),
    "elementwise_only": (elementwise_only, False),
    "forward_only_read": (forward_only_read, False),
    "no_grad_gather": (no_grad_gather, True),
    "no_grad_step": (no_grad_step, False),
    "kept_after_backward": (kept_after_backward, False),
    "uneven_dtensor": (uneven_dtensor, True),
}


def _allocations_agree(result: dict[str, Any]) -> bool:
    """Every block memtrim saw made, the profiler saw made: across ops in the same order, or inside
    one op (a composite such as ``rms_norm`` is one op to the profiler, its parts ops to memtrim:
    ``groundtruth`` sets blocks made and freed inside one op aside)."""
    ours = [d for d in result["memtrim_deltas_as_profiled"] if d > 0]
    truth = [d for d in result["profiler_deltas"] if d > 0]
    if ours == truth:
        return True
    inside = Counter(_profiled[0].intra_op_bytes) + Counter(_profiled[0].wrapped_number_bytes)
    return not Counter(truth) - Counter(ours) and not Counter(ours) - Counter(truth) - inside


def _measure(program: Callable[..., Any], rank: int, fixed: bool) -> dict[str, Any]:
    step, zero_grad = program(rank, fixed)
    step()  # warm: lazy state, the first step's allocations
    zero_grad()
    result = measure_settled(step, before=zero_grad)
    trace = result["trace"]
    if os.environ.get("DOCTOR_TP_SAVE"):
        trace.save(
            os.path.join(os.environ["DOCTOR_TP_SAVE"], f"{program.__name__}.{int(fixed)}.rank{rank}.json")
        )
    findings = [d for d in trace.diagnoses() if d.rule == RULE]
    return {
        "memtrim_peak": result["memtrim_peak"],
        "profiler_peak": result["profiler_peak"],
        "settled": result["memtrim_deltas"] == result["profiler_deltas"],
        # every allocation the same, in order (tests/test_distributed_ranks.py checks the same), and how
        # many frees the profiler never saw (made on gloo's worker thread)
        "allocations_agree": _allocations_agree(result),
        "unseen_frees": len(result["unseen_frees"]),
        "findings": [
            {
                "peak_before": d.peak_before,
                "peak_after": d.peak_after,
                "site": d.site.text() if d.site else None,
                "problem": d.problem,
                "bytes": d.bytes_at_stake,
            }
            for d in findings
        ],
    }


def run_rank(rank: int, world: int, port: int, out: str, names: list[str]) -> None:
    init(rank, world, port)
    results: dict[str, Any] = {}
    for name in names:
        program, _ = PROBES[name]
        try:
            results[name] = {"before": _measure(program, rank, False), "after": _measure(program, rank, True)}
        except Exception as error:  # a program torch cannot run here: shown, and the next probe runs
            results[name] = {
                "error": f"{type(error).__name__}: {error}".splitlines()[0][:200],
                "traceback": traceback.format_exc(),
            }
        dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def verdict(
    should_fire: bool, before: dict[str, Any], after: dict[str, Any]
) -> tuple[str, str, str, str, str]:
    """(fires?, peak as written, predicted peak, measured peak, verdict). Measured by torch.profiler;
    by memtrim's reruns where gloo's worker thread moved a collective buffer's free on the profiler's clock in
    either run (tests/test_distributed_ranks.py does the same). The finding checked is the one the fix
    removed (a program may get more, at lines the fix left alone)."""
    settled = before["settled"] and after["settled"]
    peak = "profiler_peak" if settled else "memtrim_peak"
    measured = after[peak]
    drop = before[peak] - measured
    star = "" if settled else "*"
    shown, written = f"{measured:,}{star}", f"{before[peak]:,}{star}"
    profiled = (
        ""
        if settled
        else f"; profiler {before['profiler_peak']:,} -> {after['profiler_peak']:,}, "
        f"{before['unseen_frees']} + {after['unseen_frees']} frees on gloo's thread unseen, allocations "
        + ("equal" if before["allocations_agree"] and after["allocations_agree"] else "DIFFER")
    )
    findings = before["findings"]
    if not findings:
        return "no", written, "-", shown, ("ok (silent)" if not should_fire else "MISSED") + profiled
    fires = "yes" if len(findings) == 1 else f"yes ({len(findings)})"
    if not should_fire:
        predicted = f"{findings[0]['peak_after']:,}"
        return fires, written, predicted, shown, f"WRONG (fired; measured drop {drop:,} B)"
    left = {f["site"] for f in after["findings"]}
    fixed = [f for f in findings if f["site"] not in left]
    if len(fixed) != 1:
        return fires, written, "-", shown, "WRONG (the fixed run still gets the finding)"
    (f,) = fixed
    predicted = f["peak_before"] - f["peak_after"]
    off = abs(predicted - drop) / drop if drop > 0 else float("inf")
    word = "ok" if off <= 0.1 else "WRONG"
    return (
        fires,
        written,
        f"{f['peak_after']:,}",
        shown,
        f"{word} (drop {drop:,} B, predicted off by {off:.1%}{profiled})",
    )


def main() -> None:
    import torch.multiprocessing as mp

    names = sys.argv[1:] or list(PROBES)
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(run_rank, args=(WORLD, free_port(), out, names), nprocs=WORLD, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    print(
        f"{'probe':22} {'rank':>4} {'fires':>7} {'as written':>13} {'predicted':>12} {'measured':>13}"
        "  verdict"
    )
    for name in names:
        for rank, results in enumerate(ranks):
            r = results[name]
            if "error" in r:
                print(f"{name:22} {rank:>4}  could not run: {r['error']}")
                if os.environ.get("DOCTOR_TP_VERBOSE"):
                    print(r["traceback"])
                continue
            fires, written, predicted, measured, word = verdict(PROBES[name][1], r["before"], r["after"])
            print(f"{name:22} {rank:>4} {fires:>7} {written:>13} {predicted:>12} {measured:>13}  {word}")
            if os.environ.get("DOCTOR_TP_VERBOSE"):
                print("   ", json.dumps(r))

    print(
        "peaks in bytes, torch.profiler's; * memtrim's, where gloo's worker thread moved a collective"
        " buffer's free on the profiler's clock in every attempt (the real peak moves with it)"
    )


if __name__ == "__main__":
    main()
