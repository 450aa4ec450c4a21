"""What the rule modules share: argument types and small helpers on shadows."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

if TYPE_CHECKING:
    from memtrim.verify.magnitudes import Tracer

aten = torch.ops.aten
Args = tuple[Any, ...]
Kwargs = dict[str, Any]


def flat(out: Any) -> list[Any]:
    return tree_flatten(out)[0]


def storages(args: Args, kwargs: Kwargs) -> set[int]:
    return {t.untyped_storage()._cdata for t in flat((args, kwargs)) if isinstance(t, torch.Tensor)}


def sub(tree: Any, fn: Callable[[torch.Tensor], Any], every: bool = False) -> Any:
    """``tree`` with every floating-point tensor (``every``: every tensor) replaced by ``fn(tensor)``."""
    return tree_map(
        lambda x: fn(x) if isinstance(x, torch.Tensor) and (every or x.is_floating_point()) else x, tree
    )


def prop(d: Any, e: Any) -> Any:
    """``|d| * e`` where ``e`` may be the number 0 (an exact input) and ``d`` infinite."""
    if isinstance(e, float):
        return 0.0 if e == 0.0 else d * e
    if not isinstance(d, torch.Tensor):
        return e * abs(d) if d != 0 else torch.zeros_like(e)
    zero = (e == 0) | (d == 0)
    ad = d.abs()
    # |d| * e in |d|'s new tensor where it has the result's shape and dtype (the same products)
    if ad.shape == zero.shape and ad.dtype == torch.result_type(ad, e):
        return ad.mul_(e).masked_fill_(zero, 0.0)
    return (ad * e).masked_fill_(zero, 0.0)


def plus(a: Any, b: Any) -> Any:
    """``a + b``, written into ``a`` where ``a`` is a new tensor of the caller's (one it neither keeps nor
    reads again) with the sum's shape and dtype: the same sums, one case-sized temporary fewer."""
    if (
        isinstance(a, torch.Tensor)
        and not a.requires_grad
        and a.shape == torch.broadcast_shapes(a.shape, b.shape if isinstance(b, torch.Tensor) else ())
        and a.dtype == torch.result_type(a, b)
    ):
        return a.add_(b)
    return a + b


def product(a: Any, b: Any, op: Callable[..., torch.Tensor]) -> Any:
    """``op(a, b)`` where either may be the number 0."""
    if isinstance(a, float) or isinstance(b, float):
        return 0.0
    return op(a, b)


def select3(tr: Tracer, cond: torch.Tensor, a: Any, b: Any, like: torch.Tensor) -> tuple[Any, Any, Any]:
    """The shadows of ``where(cond, a, b)``; ``a``/``b`` may be numbers (exact constants)."""

    def ch(x: Any) -> tuple[Any, Any, Any]:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return tr.channels(x)
        value = tr.value(x)
        return (value.abs() if isinstance(value, torch.Tensor) else abs(value)), 0.0, False

    (sa, ea, qa), (sb, eb, qb) = ch(a), ch(b)
    z = torch.zeros((), dtype=torch.float64, device=like.device)
    f = torch.zeros((), dtype=torch.bool, device=like.device)
    return (
        torch.where(cond, z + sa, z + sb),
        torch.where(cond, z + ea, z + eb),
        torch.where(cond, f | qa, f | qb),
    )
