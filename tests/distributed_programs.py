"""Programs run on each rank of a small gloo world (tests/test_distributed_ranks.py spawns them).

Each rank initialises a gloo process group on localhost and runs, in one process (so that a test pays
for one spawn): FSDP2 training steps, DDP training steps and a few collectives, each under
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
        "trace": trace,
        "memtrim_peak": trace.peak_bytes,
        "profiler_peak": truth.peak_in_window,
        "profiler_peak_with_reuse_frees": truth.peak_in_window_with_reuse_frees,
        # Frees of blocks made before the window are left out on both sides: memtrim sees one only if
        # an op in the region reads it, the profiler only if an earlier profile in this process saw
        # the block allocated (the CPU allocator keeps those sizes), which retries and earlier steps
        # make depend on addresses.
        "memtrim_deltas": memtrim_deltas(trace, preexisting_frees=False),
        "memtrim_deltas_as_profiled": memtrim_deltas_as_profiled(
            trace, truth.unfreed, preexisting_frees=False
        ),
        "profiler_deltas": truth.deltas_in_window,
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


def measure_settled(
    step: Callable[[], None], attempts: int = 5, before: Callable[[], None] | None = None
) -> dict[str, Any]:
    """:func:`measure`, again (up to ``attempts`` steps, every rank as long as any rank needs it)
    while memtrim and the profiler disagree. They do when gloo's worker thread drops a collective's
    buffers after wait() returned: that free comes late, on a thread the profiler does not watch
    (it never sees the free, or sees it at another point than the main thread's next op). A real
    disagreement shows in every attempt. ``before`` runs ahead of each attempt, untracked."""
    attempt = 0
    while attempt < attempts:
        attempt += 1
        if before is not None:
            before()
        result = measure(step)
        differs = result["memtrim_deltas"] != result["profiler_deltas"]  # (both in the window)
        late = torch.tensor([int(differs)])
        dist.all_reduce(late)  # the ranks agree, or one would wait for the other's next step forever
        if not int(late):
            break
    result["attempts"] = attempt
    return result


def _roles(trace: Any) -> dict[str, int]:
    found: dict[str, int] = {}
    for a in trace.allocations:
        role = str(trace.role(a))
        found[role] = found.get(role, 0) + a.bytes
    return found


def diagnoses(trace: Any) -> list[dict[str, Any]]:
    """What the doctor says of a rank's trace, as JSON."""
    return [
        {
            "rule": d.rule,
            "peak_before": d.peak_before,
            "peak_after": d.peak_after,
            "site": d.site.text() if d.site else None,
            "sites": [s.text() for s in d.sites],
            "module": d.module,
            "fix": d.fix,
            "problem": d.problem,
            "cost": d.cost,
            "verify_mode": d.verify_mode,
            "bytes_at_stake": d.bytes_at_stake,
            "allocations": [a.id for a in d.allocations],
        }
        for d in trace.diagnoses()
    ]


def fsdp_model(
    mesh: Any = None, reshard_after_forward: bool | tuple[bool, ...] | None = None, printed: str | None = None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The MLP with each layer and the root fully_shard'ed, and plain SGD: no ``.item()`` (Adam's step
    count), so the same step runs under fake tensors, and no temporaries made inside DTensor's own
    dispatch (SGD's momentum makes some), which torch.profiler cannot tell from a kernel's workspace.
    ``reshard_after_forward``: every layer's, or one per layer. ``printed``: a finding's
    ``fully_shard(...)`` call, run as printed first (``model`` the Mlp) in place of the program's own
    call for the layer it names; the other layers as ``reshard_after_forward`` says."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    torch.manual_seed(0)
    model = Mlp()
    if printed is not None:
        exec(printed, {"model": model, "fully_shard": fully_shard})
    per_layer = (
        reshard_after_forward
        if isinstance(reshard_after_forward, tuple)
        else (reshard_after_forward,) * len(model.layers)
    )
    for layer, reshard in zip(model.layers, per_layer, strict=True):
        if not isinstance(layer, FSDPModule):  # the printed call sharded it already
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(x).sum().backward()  # FSDP_LINE
    optimizer.step()


def fsdp_step(rank: int) -> dict[str, Any]:
    model, optimizer = fsdp_model()
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))
    train_step(model, optimizer, x)  # gradients exist before the measured step, as in every later one
    result = measure_settled(lambda: train_step(model, optimizer, x))
    result["parameter_bytes"] = sum(nbytes(p) for p in Mlp().parameters())
    result["local_shard_bytes"] = sum(nbytes(p.to_local()) for p in model.parameters())  # type: ignore[attr-defined]
    return result


def fsdp_reshard_step(
    rank: int, reshard_after_forward: bool | tuple[bool, ...], printed: str | None = None
) -> dict[str, Any]:
    """The FSDP2 step with each layer's ``reshard_after_forward`` given (``printed``: a finding's call
    run first, :func:`fsdp_model`), and what the doctor says of FSDP2's resharding."""
    model, optimizer = fsdp_model(reshard_after_forward=reshard_after_forward, printed=printed)
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))
    train_step(model, optimizer, x)
    # the last step's gradients are freed before the region: torch.profiler reports the free of a
    # block made before it started when an earlier profile saw that address allocated (a later FSDP
    # model in this process), a free memtrim rightly leaves out of the region's bytes
    result = measure_settled(lambda: train_step(model, optimizer, x), before=optimizer.zero_grad)
    result["diagnoses"] = diagnoses(result.pop("trace"))
    result["unsharded_bytes"] = sum(nbytes(p) for p in Mlp().parameters())
    return result


def fake_fsdp_peak(world: int) -> Any:
    """The same FSDP2 step in this process, at world size ``world`` of a fake process group and with
    fake tensors: the trace of the second step (the first makes the optimizer's state)."""
    from torch.distributed.device_mesh import init_device_mesh

    with memtrim.fake_world(world):
        mesh = init_device_mesh("cpu", (world,))  # outside fake mode: it reads values
        with memtrim.track(fake=True, steps=range(1, 2)) as trace:
            model, optimizer = fsdp_model(mesh)
            x = torch.randn(4, DIM)
            for _ in range(2):
                train_step(model, optimizer, x)
    return trace


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
    step()
    result = measure_settled(step)
    result["parameter_bytes"] = sum(nbytes(p) for p in model.parameters())
    return result


def ddp_bucket_view_step(
    rank: int, view: bool, hook: bool = False, printed: str | None = None
) -> dict[str, Any]:
    """A DDP step with Adam (forward, backward, step, ``zero_grad()``) on ``Mlp(64)``, the model wrapped
    with ``gradient_as_bucket_view=view``, and what the doctor says of it. With ``False`` each
    gradient autograd makes lives on beside its copy in DDP's bucket; with ``True`` ``.grad`` is the
    bucket's view and the gradient autograd made is freed once copied in. ``hook``: with
    ``fp16_compress_hook``, which all-reduces a float16 copy of each bucket."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    if printed is None:
        model = DistributedDataParallel(Mlp(64), gradient_as_bucket_view=view)
    else:  # a finding's DistributedDataParallel(...) as printed, model the module the program wrapped
        model = eval(printed, {"model": Mlp(64), "DistributedDataParallel": DistributedDataParallel})
    if hook:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)  # its state exists from the first step on
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        model(x).sum().backward()  # BUCKET_VIEW_LINE
        optimizer.step()
        optimizer.zero_grad()

    step()  # DDP rebuilds its buckets in the second step's forward, in the order grads came
    step()
    result = measure_settled(step)
    result["diagnoses"] = diagnoses(result.pop("trace"))
    result["parameter_bytes"] = sum(nbytes(p) for p in model.parameters())
    return result


class BranchyMlp(Mlp):
    """:class:`Mlp` and one more layer that only some ranks run (``find_unused_parameters=True``)."""

    def __init__(self, dim: int, branch: bool) -> None:
        super().__init__(dim)
        self.branch = nn.Linear(dim, dim)
        self.use_branch = branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return x + self.branch(x) if self.use_branch else x


def ddp_unused_step(rank: int, view: bool) -> dict[str, Any]:
    """:func:`ddp_bucket_view_step` on :class:`BranchyMlp` with the branch run on rank 0 only: on rank 1
    its ``.grad`` is ``None`` when the all-reduced bucket comes back, and with ``view`` False the
    reducer makes it as a copy of the bucket view (with True it is the view)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(
        BranchyMlp(64, branch=rank == 0), gradient_as_bucket_view=view, find_unused_parameters=True
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        model(x).sum().backward()  # UNUSED_LINE
        optimizer.step()
        optimizer.zero_grad()

    step()
    step()
    result = measure_settled(step)
    result["diagnoses"] = diagnoses(result.pop("trace"))
    result["branch_bytes"] = sum(nbytes(p) for p in model.module.branch.parameters())
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


SP_TOKENS, SP_DIM, SP_LAYERS = 64, 512, 3
"""The sequence-parallel program: 64 tokens split over the ranks, 512 features, 3 layers."""


def sp_layer(shard: torch.Tensor, mixing: torch.Tensor) -> torch.Tensor:
    """A sequence-parallel token-mixing layer: all-gather every rank's tokens (``[tokens, dim]``, world
    times this rank's ``shard``) and mix them into this rank's rows (``mixing`` is this rank's rows of a
    ``[tokens, tokens]`` weight). The matmul saves the gathered tensor for ``mixing``'s gradient."""
    import torch.distributed._functional_collectives as funcol

    gathered = funcol.all_gather_single_autograd(shard, 0, dist.group.WORLD)  # SP_GATHER_LINE
    return mixing @ gathered  # SP_MIX_LINE


class GatherFromSequenceParallel(torch.autograd.Function):
    """Megatron-LM's gather from the sequence-parallel region: ``dist.all_gather_into_tensor`` into a
    tensor it allocates in forward, ``dist.reduce_scatter_tensor`` of the gradient in backward."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor) -> torch.Tensor:
        gathered = shard.new_empty(shard.shape[0] * dist.get_world_size(), *shard.shape[1:])
        dist.all_gather_into_tensor(gathered, shard)  # SP_C10D_GATHER_LINE
        return gathered

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        shard = grad.new_empty(grad.shape[0] // dist.get_world_size(), *grad.shape[1:])
        dist.reduce_scatter_tensor(shard, grad.contiguous())
        return shard


def sp_c10d_layer(shard: torch.Tensor, mixing: torch.Tensor) -> torch.Tensor:
    """:func:`sp_layer` with :class:`GatherFromSequenceParallel` (c10d's all-gather)."""
    return mixing @ GatherFromSequenceParallel.apply(shard)


def sequence_parallel_step(
    rank: int, checkpointed: bool, layer: Callable[..., Any] = sp_layer
) -> dict[str, Any]:
    """:data:`SP_LAYERS` of :func:`sp_layer` and a loss, forward and backward, as written
    (``checkpointed`` False: each layer's gathered tensor is saved from forward through backward) or
    with each layer in ``torch.utils.checkpoint.checkpoint`` (only its input shard is kept; the
    all-gather runs again in backward); what the doctor says, and a digest of the gradients."""
    import hashlib

    from torch.utils.checkpoint import checkpoint

    world = dist.get_world_size()
    rows = SP_TOKENS // world
    generator = torch.Generator().manual_seed(rank)
    mixing = [
        nn.Parameter(torch.randn(rows, SP_TOKENS, generator=generator) / SP_TOKENS**0.5)
        for _ in range(SP_LAYERS)
    ]
    x = torch.randn(rows, SP_DIM, generator=generator)

    def step() -> None:
        h = x
        for w in mixing:
            h = checkpoint(layer, h, w, use_reentrant=False) if checkpointed else layer(h, w)
        h.pow(2).sum().backward()

    def zero_grad() -> None:
        for w in mixing:
            w.grad = None

    result = measure_settled(step, before=zero_grad)
    result["diagnoses"] = diagnoses(result.pop("trace"))
    gradients = b"".join(w.grad.numpy().tobytes() for w in mixing if w.grad is not None)
    result["gradients"] = hashlib.sha256(gradients).hexdigest()
    result["gathered_bytes"] = SP_TOKENS * SP_DIM * 4
    result["shard_bytes"] = nbytes(x)
    return result


def printed_call(result: dict[str, Any], rule: str, pattern: str) -> str:
    """The code a finding's write text starts with, the same on every rank (each rank runs it: a
    collective call that differed between ranks would hang them)."""
    import re

    (fix,) = [d["fix"] for d in result["diagnoses"] if d["rule"] == rule]
    found = re.match(pattern, fix)
    assert found, fix
    calls: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(calls, found.group(1))
    assert len(set(calls)) == 1, calls
    return found.group(1)


def all_steps(rank: int, world: int, port: int, out: str) -> None:
    init(rank, world, port)
    result: dict[str, Any] = {}  # run in this order (an earlier profile sees addresses a later run frees)
    result["fsdp"] = fsdp_step(rank)
    result["fsdp_kept"] = fsdp_reshard_step(rank, False)
    result["fsdp_resharded"] = fsdp_reshard_step(rank, True)
    # the fix as the finding names it: layer 0 alone (layer 1's prefetched all-gather is as large as its
    # parameters, and layer 2's own backward is the peak)
    result["fsdp_named"] = fsdp_reshard_step(rank, (True, False, False))
    # and as it prints it: its fully_shard(...) run as printed, the other layers as the program shards them
    call = printed_call(result["fsdp_kept"], "fsdp-reshard-after-forward", r"(fully_shard\(.*?\)) \(")
    result["fsdp_printed"] = fsdp_reshard_step(rank, False, printed=call)
    result["ddp"] = ddp_step(rank)
    result["ddp_copies"] = ddp_bucket_view_step(rank, False)
    result["ddp_views"] = ddp_bucket_view_step(rank, True)
    wrap = r"(DistributedDataParallel\(.*?\)): "
    call = printed_call(result["ddp_copies"], "ddp-gradient-as-bucket-view", wrap)
    result["ddp_printed"] = ddp_bucket_view_step(rank, False, printed=call)
    result["ddp_hook_copies"] = ddp_bucket_view_step(rank, False, hook=True)
    result["ddp_hook_views"] = ddp_bucket_view_step(rank, True, hook=True)
    result["ddp_unused_copies"] = ddp_unused_step(rank, False)
    result["ddp_unused_views"] = ddp_unused_step(rank, True)
    result["collectives"] = collectives(rank)
    result["sp_gathered"] = sequence_parallel_step(rank, checkpointed=False)
    result["sp_checkpointed"] = sequence_parallel_step(rank, checkpointed=True)
    result["sp_c10d"] = sequence_parallel_step(rank, checkpointed=False, layer=sp_c10d_layer)
    for step in result.values():
        step.pop("trace", None)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank tears gloo down while its peer is still in a collective
    dist.destroy_process_group()


def run(out: str, world: int = 2) -> list[dict[str, Any]]:
    """:func:`all_steps` on ``world`` spawned ranks; each rank's result."""
    import torch.multiprocessing as mp

    mp.spawn(all_steps, args=(world, free_port(), out), nprocs=world, join=True)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


class _RmsNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Block(nn.Module):
    """A Llama decoder layer: RMSNorm, causal attention (no rotary: it adds no parameters), RMSNorm,
    SwiGLU MLP."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = _RmsNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.ffn_norm = _RmsNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(batch, seq, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(attended.transpose(1, 2).reshape(batch, seq, dim))
        h = self.ffn_norm(x)
        return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


class TinyLlama(nn.Module):
    """A Llama-style decoder in plain torch (no download): embedding, layers, norm, output head."""

    def __init__(
        self, vocab: int = 100, dim: int = 64, heads: int = 4, hidden: int = 176, layers: int = 2
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_Block(dim, heads, hidden) for _ in range(layers))
        self.norm = _RmsNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def fake_llama_trace(world: int) -> Any:
    """One FSDP2 training step of :class:`TinyLlama` (each layer and the root sharded), rank 0 of a
    fake world of ``world`` ranks, with fake tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with memtrim.fake_world(world):
        mesh = init_device_mesh("cpu", (world,))
        with memtrim.track(fake=True) as trace:
            torch.manual_seed(0)
            model = TinyLlama()
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            tokens = torch.randint(0, 100, (2, 16))
            logits = model(tokens)
            nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    return trace
