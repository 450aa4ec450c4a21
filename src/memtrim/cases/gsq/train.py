"""A small end-to-end GSQ run: quantize a random MLP block to 2 bits and beat round-to-nearest.

The block is ``down(silu(gate(x)) * up(x))`` with random weights; the calibration inputs are synthetic,
with a few loud channels as in real activations. Each linear layer gets a ``GumbelQuantizer2Bit``; logits
and scales are trained to reconstruct the full-precision block output (MSE), temperature annealed 2 -> 0.05
and logit scale 100 -> 500 linearly. The exported hard 2-bit weights are compared with round-to-nearest
2-bit from the same initial scales.

Data parallel: under ``torchrun --nproc-per-node N`` (gloo on CPU) each rank takes one of ``N`` equal shards
of the global batch. The quantizer's output -- the soft weights -- does not depend on the batch, so the
gradient that is all-reduced is the one w.r.t. the soft weights (``out x in``, 4x smaller than the logits'),
and every rank then runs the same quantizer backward. A single process splits the same global batch into
the same ``--shards`` (default 2) and accumulates their gradients in shard order. With 2 ranks every reduced
element is ``g0 + g1`` in both runs (IEEE addition commutes), so the runs are bitwise equal. Rounding cannot
be bounded into the result instead: Lion steps by ``sign(...)``, so one ulp can flip a step and the runs
then diverge (with ``--shards 1``, one GEMM over the whole batch, gradients differ by ~1e-7 relative and
the final codes can differ in over half the weights at the same final loss). More than 2 ranks would need a
fixed-order reduction (all_gather, then sum in rank order) to stay equal.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .function import check_variant
from .module import GumbelQuantizer2Bit, pack_2bit
from .optim import Lion
from .scales import minmax_scales, mse_scales, rtn_2bit

__all__ = ["TrainConfig", "run"]

LAYERS = ("gate", "up", "down")


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    hidden: int = 128
    intermediate: int = 256
    tokens: int = 4096
    heldout_tokens: int = 1024
    group_size: int = 64
    steps: int = 400
    optimizer: str = "lion"
    lr: float | None = None  # None: 1e-3 for Lion, 1e-2 for Adam (Adam's step shrinks with its variance)
    scale_lr: float = 1e-4
    scale_init: str = "mse"
    t_start: float = 2.0
    t_end: float = 0.05
    s_start: float = 100.0
    s_end: float = 500.0
    shards: int = 2
    threads: int = 1
    logits_dtype: str = "float32"
    backward: str = "lean"

    @property
    def logits_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        return 1e-3 if self.optimizer == "lion" else 1e-2

    def validate(self, world_size: int) -> None:
        check_variant(self.backward)
        if self.optimizer not in ("lion", "adam"):
            raise ValueError(f"unknown optimizer {self.optimizer!r}; use 'lion' or 'adam'")
        if self.scale_init not in ("minmax", "mse"):
            raise ValueError(f"unknown scale_init {self.scale_init!r}; use 'minmax' or 'mse'")
        if self.logits_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"unknown logits_dtype {self.logits_dtype!r}; use 'float32' or 'bfloat16'")
        if self.steps < 2:
            raise ValueError(f"steps must be at least 2 (the schedules interpolate); got {self.steps}")
        if self.tokens % self.shards != 0:
            raise ValueError(f"tokens={self.tokens} must divide into shards={self.shards}; change either")
        if world_size > 1 and self.shards != world_size:
            raise ValueError(
                f"shards={self.shards} but the world size is {world_size}: each rank takes one shard, "
                f"so pass --shards {world_size}"
            )


def _block(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def _make_problem(cfg: TrainConfig) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    h, m = cfg.hidden, cfg.intermediate
    weights = {
        "gate": torch.randn(m, h) / h**0.5,
        "up": torch.randn(m, h) / h**0.5,
        "down": torch.randn(h, m) / m**0.5,
    }
    # Log-normal channel gains: a few loud input channels make some weights matter much more than others,
    # which is what output-aware training exploits and round-to-nearest cannot see.
    gains = torch.randn(h).mul(0.75).exp()
    x = torch.randn(cfg.tokens, h) * gains
    heldout = torch.randn(cfg.heldout_tokens, h) * gains
    return weights, x, heldout


def _init_scales(weight: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    if cfg.scale_init == "mse":
        return mse_scales(weight, cfg.group_size)
    return minmax_scales(weight, cfg.group_size)


def _optimizer(quants: dict[str, GumbelQuantizer2Bit], cfg: TrainConfig) -> torch.optim.Optimizer:
    groups: list[dict[str, Any]] = [
        {"params": [q.quant_logits for q in quants.values()], "lr": cfg.logits_lr},
        {"params": [q.scales for q in quants.values()], "lr": cfg.scale_lr},
    ]
    if cfg.optimizer == "lion":
        return Lion(groups)
    return torch.optim.Adam(groups)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """The tensor's data in memory order, without numpy (not a run-time dependency of memtrim)."""
    t = t.detach().to("cpu").contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def _linear(step: int, steps: int, start: float, end: float) -> float:
    return start + (end - start) * step / (steps - 1)


def _mse(x: torch.Tensor, weights: dict[str, torch.Tensor], target: torch.Tensor) -> float:
    with torch.no_grad():
        return float((_block(x, weights["gate"], weights["up"], weights["down"]) - target).square().mean())


def _train_step(
    quants: dict[str, GumbelQuantizer2Bit],
    shards: Sequence[tuple[torch.Tensor, torch.Tensor]],
    n_elements: int,
    temperature: float,
    logit_scale: float,
    world_size: int,
) -> float:
    soft = [quants[name](temperature, logit_scale) for name in LAYERS]
    leaves = [w.detach().requires_grad_() for w in soft]
    loss_sum = torch.zeros((), dtype=torch.float64)
    for x, y in shards:
        # Sum over the shard / global count: the shard gradients then add up to the global-mean gradient.
        loss = (_block(x, *leaves) - y).square().sum() / n_elements
        loss.backward()
        loss_sum += loss.detach().double()
    grads = [leaf.grad for leaf in leaves]
    assert all(g is not None for g in grads)
    if world_size > 1:
        # One call for the three gradients; with two ranks every element is g0 + g1, as in one process.
        flat = torch.cat([g.reshape(-1) for g in grads if g is not None])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        parts = flat.split([leaf.numel() for leaf in leaves])
        grads = [p.view(leaf.shape) for p, leaf in zip(parts, leaves, strict=True)]
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
    torch.autograd.backward(soft, grads)
    return float(loss_sum)


def _world() -> tuple[int, int, bool]:
    """(rank, world size, whether this call initialised the process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if not (dist.is_available() and dist.is_gloo_available()):
            raise RuntimeError("WORLD_SIZE > 1 but torch.distributed with gloo is unavailable in this build")
        dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size(), True
    return 0, 1, False


def run(cfg: TrainConfig, export: str | None = None) -> dict[str, Any]:
    """Run the quantization; every rank returns the same summary."""
    start = time.perf_counter()
    rank, world_size, owns_group = _world()
    threads = torch.get_num_threads()
    finished = False
    try:
        cfg.validate(world_size)
        # The run seeds and sets threads for itself; the caller's RNG state and thread count come back.
        with torch.random.fork_rng(devices=[]):
            summary = _run(cfg, rank, world_size, export)
        finished = True
    finally:
        torch.set_num_threads(threads)
        if owns_group:
            if finished:
                # every rank done with its collectives before any tears gloo down: a rank whose peer
                # closed the connection mid-operation can abort in gloo's threads (seen once in a
                # 2-rank run here: "terminate called without an active exception", SIGABRT)
                dist.barrier()
            dist.destroy_process_group()
    summary["seconds"] = round(time.perf_counter() - start, 3)
    return summary


def _run(cfg: TrainConfig, rank: int, world_size: int, export: str | None) -> dict[str, Any]:
    # Results depend on the thread count (GEMM blocking), so it is part of the configuration.
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    weights, x, heldout = _make_problem(cfg)
    with torch.no_grad():
        target = _block(x, weights["gate"], weights["up"], weights["down"])
        heldout_target = _block(heldout, weights["gate"], weights["up"], weights["down"])
    init_scales = {name: _init_scales(w, cfg) for name, w in weights.items()}
    rtn = {name: rtn_2bit(w, init_scales[name], cfg.group_size) for name, w in weights.items()}
    quants = {
        name: GumbelQuantizer2Bit(
            weights[name],
            init_scales[name],
            group_size=cfg.group_size,
            logits_dtype=getattr(torch, cfg.logits_dtype),
            backward=cfg.backward,
        )
        for name in LAYERS
    }
    optimizer = _optimizer(quants, cfg)

    shard_rows = cfg.tokens // cfg.shards
    all_shards = [
        (x[i * shard_rows : (i + 1) * shard_rows], target[i * shard_rows : (i + 1) * shard_rows])
        for i in range(cfg.shards)
    ]
    mine = all_shards if world_size == 1 else [all_shards[rank]]
    n_elements = target.numel()

    losses = []
    for step in range(cfg.steps):
        temperature = _linear(step, cfg.steps, cfg.t_start, cfg.t_end)
        logit_scale = _linear(step, cfg.steps, cfg.s_start, cfg.s_end)
        optimizer.zero_grad(set_to_none=True)
        losses.append(_train_step(quants, mine, n_elements, temperature, logit_scale, world_size))
        optimizer.step()

    hard = {name: q.hard_weights() for name, q in quants.items()}
    digest = hashlib.sha256()
    for name in LAYERS:
        digest.update(_tensor_bytes(hard[name]))
    if export is not None and rank == 0:
        _export(export, quants, cfg)
    target_power = float(target.square().mean())
    return {
        "hard_mse": _mse(x, hard, target),
        "rtn_mse": _mse(x, rtn, target),
        "target_mean_square": target_power,
        "heldout_hard_mse": _mse(heldout, hard, heldout_target),
        "heldout_rtn_mse": _mse(heldout, rtn, heldout_target),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "hard_weights_sha256": digest.hexdigest(),
        "world_size": world_size,
        "config": asdict(cfg),
    }


def _export(path: str, quants: dict[str, GumbelQuantizer2Bit], cfg: TrainConfig) -> None:
    payload = {
        name: {
            "codes_2bit": pack_2bit(q.hard_codes()),
            "scales": q.scales.detach().clone(),
            "shape": q.weight_shape,
            "group_size": q.group_size,
            "hard_weights": q.hard_weights(),
        }
        for name, q in quants.items()
    }
    torch.save({"layers": payload, "config": asdict(cfg)}, path)
