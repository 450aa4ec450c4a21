"""Cancellation probes: where the exact result (or gradient) is zero, the candidate must give exactly zero.

Seed 001's FP16 case: positive and negative contributions to a weight gradient cancel exactly; a rewrite
that rounds partial sums to fp16 before they cancel (chunking, a different order) leaves a residue. The
float64 oracle says where the exact value is zero; the candidate must match it there bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from memtrim.verify.cases import CancellationProbe, leaf_names
from memtrim.verify.results import Failure, ProbeResult, RunResult
from memtrim.verify.run import run_callable


def run_probe(
    reference: Callable[..., Any],
    candidate: Callable[..., Any],
    probe: CancellationProbe,
    device: torch.device,
    oracle_device: torch.device,
    grads: bool,
) -> tuple[ProbeResult, list[Failure]]:
    leaves, spec = tree_flatten(tuple(probe.inputs))
    diff = [i for i, x in enumerate(leaves) if grads and isinstance(x, torch.Tensor) and x.requires_grad]

    def fresh(dev: torch.device, dtype: torch.dtype | None = None) -> list[Any]:
        out = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                t = x.detach().to(dev)
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                out.append(t.requires_grad_(x.requires_grad))
            else:
                out.append(x)
        return out

    def ups(outs: list[Any], dev: torch.device, dtype: torch.dtype | None) -> list[torch.Tensor | None]:
        given = list(probe.grad_outputs) if probe.grad_outputs is not None else None
        res: list[torch.Tensor | None] = []
        k = 0
        for o in outs:
            if not (isinstance(o, torch.Tensor) and o.requires_grad):
                res.append(None)
                continue
            g = given[k] if given is not None and k < len(given) else torch.ones_like(o)
            k += 1
            res.append(g.detach().to(device=dev, dtype=dtype or o.dtype))
        return res

    def run(fn: Callable[..., Any], dev: torch.device, dtype: torch.dtype | None) -> RunResult:
        return run_callable(
            fn,
            fresh(dev, dtype),
            lambda ls: tuple(tree_unflatten(ls, spec)),
            diff,
            grad_outputs=(lambda outs: ups(outs, dev, dtype)) if diff else None,
            seed=0,
        )

    oracle = run(reference, oracle_device, torch.float64)
    orig = run(reference, device, None)
    cand = run(candidate, device, None)
    fails: list[Failure] = []
    for who, r in (("the reference in float64", oracle), ("the reference", orig), ("the candidate", cand)):
        if r.error is not None:
            msg = f"{who} raised {r.error.describe()} on cancellation probe {probe.name!r}"
            fails.append(Failure(probe.name, "probe", "exception", msg))
            return ProbeResult(probe.name, False, 0, msg), fails
    zeros, bad, orig_bad = 0, [], 0
    names = leaf_names(oracle.spec, "output") + [f"grad of input leaf {i}" for i in diff]
    for name, z, c, o in zip(names, _all(oracle), _all(cand), _all(orig), strict=False):
        if z is None or c is None:
            continue
        mask = (z == 0).to(c.device)
        zeros += int(mask.sum())
        resid = c.detach()[mask]
        if bool((resid != 0).any()):
            bad.append(
                f"{name}: {int((resid != 0).sum())} of {int(mask.sum())} exact zeros are not zero "
                f"(largest residue {float(resid.abs().max()):.3g})"
            )
        if o is not None and bool((o.detach()[mask] != 0).any()):
            orig_bad += 1
    if zeros == 0:
        msg = (
            f"cancellation probe {probe.name!r} has no element whose exact value is zero; a probe needs "
            "inputs whose exact result or gradient cancels to zero"
        )
        fails.append(Failure(probe.name, "probe", "probe", msg))
        return ProbeResult(probe.name, False, 0, msg), fails
    if bad:
        msg = (
            f"candidate leaves a residue where the exact value is zero: {'; '.join(bad)} (it rounds partial "
            "sums before they cancel)"
        )
        fails.append(Failure(probe.name, "probe", "probe", msg))
        return ProbeResult(probe.name, False, zeros, msg, orig_bad == 0), fails
    return ProbeResult(probe.name, True, zeros, f"{zeros} exact zeros kept", orig_bad == 0), fails


def _all(r: RunResult) -> list[torch.Tensor | None]:
    outs = [o if isinstance(o, torch.Tensor) else None for o in r.outputs]
    return outs + list(r.grads or [])
