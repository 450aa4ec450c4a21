"""Run one callable on one set of inputs: forward, gradients, second derivatives; errors and side effects.

The runner of one *case* (both callables, then the verdict) is :mod:`memtrim.verify.judge`.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from memtrim.analysis.analysis import analyze
from memtrim.analysis.footprint import Footprint
from memtrim.capture.api import record
from memtrim.verify.cases import seed_rngs
from memtrim.verify.chunks import chunks
from memtrim.verify.results import CallError, RunResult

_TORCH_DIR = os.path.dirname(torch.__file__)
_VERIFY_DIR = os.path.dirname(__file__)


def _user_frame(exc: BaseException) -> str | None:
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        if not fr.filename.startswith((_TORCH_DIR, _VERIFY_DIR)):
            return f"{os.path.basename(fr.filename)}:{fr.lineno} in {fr.name}"
    return None


def _error(phase: str, exc: BaseException) -> CallError:
    return CallError(phase, type(exc).__name__, str(exc), _user_frame(exc))


def _poison_intact(buf: torch.Tensor) -> bool:
    hidden = buf[..., 0]
    if hidden.is_floating_point() or hidden.is_complex():
        return bool(hidden.isnan().all())
    if hidden.dtype == torch.bool:
        return bool(hidden.all())
    return bool((hidden == 12).all())


@contextlib.contextmanager
def seeded(seed: int | None, leaves: Sequence[Any]) -> Iterator[None]:
    """Seed the RNGs for a run (so callables that draw random numbers draw the same ones) and restore
    the caller's RNG state afterwards."""
    if seed is None:
        yield
        return
    cuda = sorted({x.device.index or 0 for x in leaves if isinstance(x, torch.Tensor) and x.is_cuda})
    with torch.random.fork_rng(devices=cuda):
        seed_rngs(seed, cuda)
        yield


def canonical(tree: Any) -> Any:
    """``tree`` with every dict's keys in sorted order, so two callables that return the same dict in
    another insertion order flatten alike (and get the same upstream gradients)."""
    if isinstance(tree, dict):
        items = sorted(tree.items(), key=lambda kv: (type(kv[0]).__name__, repr(kv[0])))
        return type(tree)((k, canonical(v)) for k, v in items)
    if isinstance(tree, list):
        return [canonical(v) for v in tree]
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(canonical(v) for v in tree)
    return tree


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns as integers (floats and complex); other dtypes as they are."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: the same bits, or both NaN (any payload). So -0.0 and +0.0 differ."""
    eq = bits(a) == bits(b)
    if a.is_complex():
        eq = eq.all(-1)
    if (a.is_floating_point() or a.is_complex()) and not bool(eq.all()):
        eq = eq | (a.isnan() & b.isnan())
    return eq


def _snapshot(x: Any) -> torch.Tensor | None:
    return x.detach().clone() if isinstance(x, torch.Tensor) else None


def _changed(before: torch.Tensor | None, x: Any) -> bool:
    """Whether ``x`` no longer holds the values ``before`` (in its own dtype and device, as the canonical
    inputs are given; widening a float is exact), compared piece by piece so no temporary is
    case-sized."""
    if before is None or not isinstance(x, torch.Tensor) or before.shape != x.shape:
        return before is not None
    after = x.detach()
    for _, index in chunks(after.shape):
        was = before[index].to(device=after.device, dtype=after.dtype)
        if not bool(same_bits(was, after[index]).all()):
            return True
    return False


def _alias_of(o: Any, leaves: list[Any]) -> int | None:
    """The input leaf whose memory ``o`` shares (a view of it, or the input itself)."""
    if not isinstance(o, torch.Tensor) or o.numel() == 0:
        return None
    mine = o.untyped_storage()._cdata
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and x.numel() and x.untyped_storage()._cdata == mine:
            return i
    return None


def run_callable(
    fn: Callable[..., Any],
    leaves: list[Any],
    make_args: Callable[[list[Any]], tuple[Any, ...]],
    diff_index: Sequence[int],
    *,
    grad_outputs: Callable[[list[Any]], list[torch.Tensor | None]] | None,
    directions: Callable[[list[torch.Tensor | None]], list[torch.Tensor | None]] | None = None,
    guards: Sequence[tuple[int, torch.Tensor]] = (),
    forward_context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    seed: int | None = None,
    watch_inputs: bool = True,
    originals: Sequence[Any] | None = None,
) -> RunResult:
    """Call ``fn(*make_args(leaves))``, then backpropagate ``grad_outputs(outputs)`` into the diff leaves.

    ``grad_outputs`` returns one upstream gradient per flat output (None: not differentiated); an output
    that should be differentiated but does not require grad is listed in ``detached``. ``directions``
    (second order) gives one direction per differentiable leaf for a Hessian-vector product.
    ``forward_context`` wraps the call (autocast), ``context`` the call and its backward (the oracle's
    tracer). ``seed`` seeds the RNGs for the run (and restores the caller's RNG state after it).

    Outputs are flattened with dict keys sorted (:func:`canonical`). An input counts as mutated when its
    version counter moved or its bits changed (``.data`` writes move no counter: ``mutated_silently``);
    its value afterwards is kept in ``updates``. ``aliases`` names, per output, the input it shares memory
    with. ``watch_inputs=False`` skips the copies of the inputs that comparing bits needs (memory runs).
    ``originals``, when given, are the values the leaves hold before the call (the canonical inputs the
    leaves were laid out from, one per leaf): the bits are compared with them, and no copy is made.
    """
    with seeded(seed, leaves):
        return _run_callable(
            fn,
            leaves,
            make_args,
            diff_index,
            grad_outputs,
            directions,
            guards,
            forward_context,
            context,
            watch_inputs,
            originals,
        )


def _run_callable(
    fn: Callable[..., Any],
    leaves: list[Any],
    make_args: Callable[[list[Any]], tuple[Any, ...]],
    diff_index: Sequence[int],
    grad_outputs: Callable[[list[Any]], list[torch.Tensor | None]] | None,
    directions: Callable[[list[torch.Tensor | None]], list[torch.Tensor | None]] | None,
    guards: Sequence[tuple[int, torch.Tensor]],
    forward_context: Callable[[], AbstractContextManager[Any]],
    context: Callable[[], AbstractContextManager[Any]],
    watch_inputs: bool,
    originals: Sequence[Any] | None,
) -> RunResult:
    res = RunResult()
    versions = [x._version if isinstance(x, torch.Tensor) else None for x in leaves]
    if not watch_inputs:
        before: list[torch.Tensor | None] = [None] * len(leaves)
    elif originals is not None:
        before = [o if isinstance(x, torch.Tensor) else None for x, o in zip(leaves, originals, strict=True)]
    else:
        before = [_snapshot(x) for x in leaves]
    try:
        with context(), forward_context():
            out = fn(*make_args(leaves))
    except Exception as exc:
        res.error = _error("forward", exc)
        return res
    res.outputs, res.spec = tree_flatten(canonical(out))
    res.out_requires_grad = [isinstance(o, torch.Tensor) and o.requires_grad for o in res.outputs]
    res.aliases = [_alias_of(o, leaves) for o in res.outputs]
    diff_leaves = [leaves[i] for i in diff_index]
    if grad_outputs is not None and diff_leaves:
        ups = grad_outputs(res.outputs)
        pairs = []
        for j, (o, g) in enumerate(zip(res.outputs, ups, strict=False)):
            if g is None:
                continue
            if not (isinstance(o, torch.Tensor) and o.requires_grad):
                res.detached.append(j)
                continue
            pairs.append((o, g))
        res.grads = [None] * len(diff_leaves)
        with context():
            if pairs:
                try:
                    grads = torch.autograd.grad(
                        [o for o, _ in pairs],
                        diff_leaves,
                        [g for _, g in pairs],
                        allow_unused=True,
                        create_graph=directions is not None,
                    )
                    res.grads = list(grads)
                except Exception as exc:
                    res.error = _error("backward", exc)
            if directions is not None and res.error is None:
                _second_order(res, diff_leaves, directions)
    for j in range(len(res.outputs)):
        if isinstance(res.outputs[j], torch.Tensor):
            res.outputs[j] = res.outputs[j].detach()
    if res.grads is not None:
        res.grads = [g.detach() if g is not None else None for g in res.grads]
    moved = {
        i
        for i, (x, v) in enumerate(zip(leaves, versions, strict=True))
        if isinstance(x, torch.Tensor) and x._version != v
    }
    changed = {i for i, (b, x) in enumerate(zip(before, leaves, strict=True)) if _changed(b, x)}
    res.mutated = sorted(moved | changed)
    res.mutated_silently = sorted(changed - moved)
    res.updates = [x.detach() if i in moved | changed else None for i, x in enumerate(leaves)]
    res.poisoned = [i for i, buf in guards if not _poison_intact(buf)]
    return res


def _second_order(
    res: RunResult,
    diff_leaves: list[Any],
    directions: Callable[[list[torch.Tensor | None]], list[torch.Tensor | None]],
) -> None:
    assert res.grads is not None
    dirs = directions(res.grads)
    terms = []
    for k, (g, v) in enumerate(zip(res.grads, dirs, strict=False)):
        if g is None or v is None:
            continue
        if not g.requires_grad:
            res.not_differentiable.append(k)
            continue
        terms.append((g * v).sum())
    res.grads2 = [None] * len(diff_leaves)
    if not terms:
        return
    try:
        res.grads2 = [
            None if h is None else h.detach()
            for h in torch.autograd.grad(
                functools.reduce(operator.add, terms), diff_leaves, allow_unused=True
            )
        ]
    except Exception as exc:
        res.error = _error("second-order backward", exc)


def measure(run: Callable[[], RunResult]) -> Footprint | str:
    """Run ``run`` under memtrim's tracker. Returns the figures, or why there are none."""
    try:
        with record() as log:
            result = run()
        footprint = Footprint.of(analyze(log))
    except Exception as exc:
        return f"memory tracking failed: {type(exc).__name__}: {exc}"
    if result.error is not None:
        return f"not measured: {result.error.describe()}"
    return footprint
