"""Programs run on each rank of a small gloo world (tests/test_distributed_ranks.py spawns them).

Each rank initialises a gloo process group on localhost and runs, in one process (so that a test pays
for one spawn): an FSDP2 training step, a DDP training step and a few collectives, each under
torch.profiler and memtrim at once. What the tests compare goes to ``<out>/rank<r>.json``: memtrim's
per-rank peak and events, the profiler's, and sizes from the program's own tensors.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from groundtruth import memtrim_deltas, memtrim_deltas_as_profiled, profiler_memory
from torch import nn

import memtrim

DIM = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Mlp(nn.Module):
    """Three linear layers: each is its own FSDP2 unit in :func:`fsdp_step`."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))  # LAYER_LINE
        return x


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def init(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))


def measure(step: Callable[[], None]) -> dict[str, Any]:
    """One step under the profiler and memtrim at once."""
    with profiler_memory() as truth, memtrim.track() as trace:
        step()
    made = sorted((a for a in trace.allocations if not a.preexisting), key=lambda a: a.alloc_tick)
    return {
        "memtrim_peak": trace.peak_bytes,
        "profiler_peak": truth.peak,
        "memtrim_deltas": memtrim_deltas(trace),
        "memtrim_deltas_as_profiled": memtrim_deltas_as_profiled(trace, truth.unfreed),
        "profiler_deltas": truth.deltas,
        # what memtrim saw freed and the profiler never did
        "unseen_frees": [str(trace.role(made[n])) for n in truth.unfreed if made[n].free_tick is not None],
        "roles": _roles(trace),
        "metadata": trace.log.metadata.get("distributed"),
        "allocations": [
            {
                "bytes": a.bytes,
                "op": a.op,
                "role": str(trace.role(a)),
                "alloc_tick": a.alloc_tick,
                "free_tick": a.free_tick,
                "site": a.site.text() if a.site else None,
            }
            for a in trace.allocations
        ],
        "collectives": [
            (op.op, op.site.text() if op.site else None, op.tick)
            for op in trace.log.ops
            if op.op.startswith(("c10d.", "_c10d_functional."))
        ],
    }


def _roles(trace: Any) -> dict[str, int]:
    found: dict[str, int] = {}
    for a in trace.allocations:
        role = str(trace.role(a))
        found[role] = found.get(role, 0) + a.bytes
    return found


def fsdp_step(rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Mlp()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        model(x).sum().backward()  # FSDP_LINE
        optimizer.step()
        optimizer.zero_grad()

    step()  # Adam's state, made once, exists before the measured step
    result = measure(step)
    result["parameter_bytes"] = sum(nbytes(p) for p in Mlp().parameters())
    result["local_shard_bytes"] = sum(nbytes(p.to_local()) for p in model.parameters())  # type: ignore[attr-defined]
    return result


def ddp_step(rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(Mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        model(x).sum().backward()  # DDP_LINE
        optimizer.step()
        optimizer.zero_grad()

    step()  # DDP builds its buckets again in the second step's forward, in the order grads came
    result = measure(step)
    result["parameter_bytes"] = sum(nbytes(p) for p in model.parameters())
    return result


def collectives(rank: int) -> dict[str, Any]:
    """A functional all-gather (its output is a new buffer, alive until it is waited on and dropped)
    and a DTensor op that issues a collective inside torch (clip_grad_norm_ over sharded gradients)."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.fsdp import fully_shard

    x = torch.ones(256) * rank
    torch.manual_seed(0)
    model = Mlp()
    fully_shard(model)
    model(x[:DIM].unsqueeze(0)).sum().backward()

    def step() -> None:
        gathered = funcol.all_gather_single(x, 0, dist.group.WORLD)  # GATHER_LINE
        assert float(gathered.sum()) == 256 * sum(range(dist.get_world_size()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # CLIP_LINE

    result = measure(step)
    result["x_bytes"] = nbytes(x)
    return result


def all_steps(rank: int, world: int, port: int, out: str) -> None:
    init(rank, world, port)
    result = {"fsdp": fsdp_step(rank), "ddp": ddp_step(rank), "collectives": collectives(rank)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run(out: str, world: int = 2) -> list[dict[str, Any]]:
    """:func:`all_steps` on ``world`` spawned ranks; each rank's result."""
    import torch.multiprocessing as mp

    mp.spawn(all_steps, args=(world, free_port(), out), nprocs=world, join=True)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
