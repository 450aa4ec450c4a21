"""Rules for selections (1-Lipschitz, exact) and for sums and products: magnitudes by the same op on
magnitudes, errors by the product rule, plus the accumulation allowance of every reduction."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memtrim.verify.magnitude_rules.common import Args, Kwargs, aten, plus, product, prop, select3, sub
from memtrim.verify.magnitudes import Tracer, register_magnitude_rule


# -- selections: 1-Lipschitz and exact ----------------------------------------------------------------
@register_magnitude_rule(aten.neg, aten.positive, aten.abs, aten.relu, aten.clamp, aten.clamp_min)
def _lipschitz(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    # |f(x + d) - f(x)| <= |d| and f(x) is exact: the shadows of x carry over. Clamp bounds that are
    # tensors add their own errors where they are selected (bounded by the larger of the two).
    x = args[0]
    s, e, q = tr.channels(x)
    bounds = [b for b in (*args[1:], *kwargs.values()) if isinstance(b, torch.Tensor)]
    out = func(*args, **kwargs)
    total: Any = torch.where(q, e + tr.u * s, e)
    for b in bounds:
        total = torch.maximum(total, tr.e(b) + torch.zeros_like(total))
        s = torch.maximum(s, tr.s(b))
    tr.set(out, s=s, e=total, rounded=False, owned=True)
    return out


@register_magnitude_rule(aten.clamp_max, aten.hardtanh)
def _clamp_max(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    return _lipschitz(tr, func, args, kwargs)


@register_magnitude_rule(aten.maximum, aten.minimum, aten.fmax, aten.fmin)
def _pick(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    a, b = args[0], args[1]
    out = func(*args, **kwargs)
    tr.set(out, s=torch.maximum(tr.s(a), tr.s(b)), e=_max_e(tr.e(a), tr.e(b), out), rounded=False, owned=True)
    return out


def _max_e(ea: Any, eb: Any, like: torch.Tensor) -> torch.Tensor:
    z = torch.zeros(like.shape, dtype=torch.float64, device=like.device)
    return torch.maximum(z + ea, z + eb)


@register_magnitude_rule(aten.threshold_backward)
def _threshold_backward(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    grad, x, threshold = args[0], args[1], args[2]
    out = func(*args, **kwargs)
    s, e, q = select3(tr, x > threshold, grad, 0.0, out)
    tr.set(out, s=s, e=e, rounded=q, owned=True)
    return out


@register_magnitude_rule(aten.amax, aten.amin, aten.max, aten.min)
def _extreme(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    # |max(x + d) - max(x)| <= max |d|: the largest error over the reduced elements.
    if len(args) >= 2 and isinstance(args[1], torch.Tensor):  # the binary max(a, b) overload
        return _pick(tr, func, args, kwargs)
    x = args[0]
    out = func(*args, **kwargs)
    s, total = tr.s(x), tr.e(x) + torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    values = out[0] if isinstance(out, tuple) else out
    # an infinite element (a mask's -inf) is the extreme only where the result is infinite too, and
    # then |result| is its magnitude: its S must not reach finite results
    s = torch.where(torch.isinf(x), 0.0, s)
    dims = args[1] if len(args) > 1 else kwargs.get("dim", None)
    keep = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    if x.dim() == 0:
        picked_s, picked_e = s, total
    elif dims is None or dims == [] or dims == ():
        picked_s, picked_e = s.amax(), total.amax()
    else:
        picked_s, picked_e = s.amax(dims, keepdim=keep), total.amax(dims, keepdim=keep)
    tr.set(values, s=torch.maximum(picked_s, tr.value(values).abs()), e=picked_e, rounded=False, owned=True)
    return out


@register_magnitude_rule(aten.sort, aten.topk)
def _sort(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    x = args[0]
    values, indices = func(*args, **kwargs)
    if x.dim() == 0:
        s, e, q = tr.channels(x)
        tr.set(values, s=s, e=e, rounded=q)
        return values, indices
    if func.overloadpacket is aten.topk:
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    else:
        dim = kwargs.get("dim", args[1] if len(args) > 1 and isinstance(args[1], int) else -1)
    s, e, q = tr.channels(x)
    tr.set(
        values, s=s.gather(dim, indices), e=e.gather(dim, indices), rounded=q.gather(dim, indices), owned=True
    )
    return values, indices


# -- sums and products ---------------------------------------------------------------------------------
def _alpha(args: Args, kwargs: Kwargs, at: int) -> float:
    value: Any = kwargs.get("alpha", args[at] if len(args) > at else 1)
    return abs(float(value))


@register_magnitude_rule(aten.add, aten.sub, aten.rsub)
def _add(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    # a - alpha*b (and b - alpha*a): errors add; one rounding, of the value. The magnitude is the
    # value's own: an elementwise difference that cancels (x - mean(x)) is small, and so is the error of
    # what is built on it; a rewrite that expands it (E[x^2] - E[x]^2) must then stay that accurate.
    a, b = args[0], args[1]
    alpha = _alpha(args, kwargs, 2)
    out = func(*args, **kwargs)
    if func.overloadpacket is aten.rsub:
        a, b = b, a
    # e(a) + alpha*e(b), each step rounded as written, with as few case-sized temporaries alive as
    # can be (e() returns a new tensor, or the number 0.0)
    ea, eb = tr.e(a), tr.e(b)
    eb = eb.mul_(alpha) if isinstance(eb, torch.Tensor) else alpha * eb
    if isinstance(ea, torch.Tensor) and isinstance(eb, torch.Tensor) and ea.shape == out.shape:
        e = ea.add_(eb)
    else:
        e = ea + eb
    del ea, eb
    tr.set(out, s=tr.value(out).abs(), e=e, owned=True)
    return out


@register_magnitude_rule(aten.mul)
def _mul(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    a, b = args[0], args[1]
    out = func(*args, **kwargs)
    sa, sb = tr.s(a), tr.s(b)
    tr.set(out, s=sa * sb, e=plus(prop(sb, tr.e(a)), prop(sa, tr.e(b))), owned=True)
    return out


@register_magnitude_rule(aten.div)
def _div(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    a, b = args[0], args[1]
    out = func(*args, **kwargs)
    if kwargs.get("rounding_mode") is not None or (len(args) > 2 and args[2] is not None):
        return out  # floor/trunc division: piecewise constant, exact to first order
    bv = tr.value(b)
    inv = 1.0 / bv.abs() if isinstance(bv, torch.Tensor) else 1.0 / abs(bv)
    sa = tr.s(a)
    e = plus(prop(inv, tr.e(a)), prop(sa * inv * inv, tr.e(b)))
    tr.set(out, s=sa * inv, e=e, owned=True)
    return out


@register_magnitude_rule(aten.addcmul)
def _addcmul(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    x, t1, t2 = args[0], args[1], args[2]
    v = abs(float(kwargs.get("value", args[3] if len(args) > 3 else 1) or 0))
    out = func(*args, **kwargs)
    s1, s2 = tr.s(t1), tr.s(t2)
    e = tr.e(x) + v * (prop(s2, tr.e(t1)) + prop(s1, tr.e(t2)))
    tr.set(out, s=tr.s(x) + v * s1 * s2, e=e, owned=True)
    return out


@register_magnitude_rule(aten.addcdiv)
def _addcdiv(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    x, t1, t2 = args[0], args[1], args[2]
    v = abs(float(kwargs.get("value", args[3] if len(args) > 3 else 1) or 0))
    out = func(*args, **kwargs)
    inv = 1.0 / tr.value(t2).abs()
    s1 = tr.s(t1)
    e = tr.e(x) + v * (prop(inv, tr.e(t1)) + prop(s1 * inv * inv, tr.e(t2)))
    tr.set(out, s=tr.s(x) + v * s1 * inv, e=e, owned=True)
    return out


def _reduced(x: torch.Tensor, out: torch.Tensor) -> int:
    return x.numel() // out.numel() if out.numel() else 0


@register_magnitude_rule(aten.sum, aten.mean, aten.nansum)
def _sum(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    x = args[0]
    out = func(*args, **kwargs)
    if not out.is_floating_point():
        return out
    kw = {k: v for k, v in kwargs.items() if k != "dtype"}
    s = func(tr.s(x), *args[1:], **kw)
    e = tr.e(x)
    e = func(e, *args[1:], **kw) if isinstance(e, torch.Tensor) else 0.0
    tr.set(out, s=s, e=plus(tr.accumulation(_reduced(x, out)) * s, e), owned=True)
    return out


@register_magnitude_rule(aten.cumsum)
def _cumsum(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    x, dim = args[0], args[1]
    out = func(*args, **kwargs)
    s = torch.cumsum(tr.s(x), dim)
    e = tr.e(x)
    e = torch.cumsum(e, dim) if isinstance(e, torch.Tensor) else 0.0
    n = torch.cumsum(torch.ones_like(s), dim)
    tr.set(out, s=s, e=plus(tr.accumulation(n) * s, e), owned=True)
    return out


@register_magnitude_rule(aten.mm, aten.bmm, aten.mv, aten.dot, aten.vdot)
def _product(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    a, b = args[0], args[1]
    out = func(*args, **kwargs)
    sa, sb = tr.s(a), tr.s(b)
    s = func(sa, sb)
    e = plus(product(tr.e(a), sb, func), product(sa, tr.e(b), func))
    tr.set(out, s=s, e=plus(tr.accumulation(a.shape[-1]) * s, e), owned=True)
    return out


@register_magnitude_rule(aten.addmm, aten.baddbmm, aten.addmv, aten.addbmm, aten.addr)
def _add_product(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    # beta*c + alpha*(a @ b): the product's rule, plus c's magnitude and error.
    c, a, b = args[0], args[1], args[2]
    beta = abs(float(kwargs.get("beta", 1)))
    alpha = abs(float(kwargs.get("alpha", 1)))
    out = func(*args, **kwargs)
    ops: dict[Any, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        aten.addmm: aten.mm.default,
        aten.baddbmm: aten.bmm.default,
        aten.addmv: aten.mv.default,
        aten.addbmm: lambda x, y: aten.bmm.default(x, y).sum(0),
        aten.addr: lambda x, y: x[:, None] * y[None, :],
    }
    op = ops[func.overloadpacket]
    sa, sb = tr.s(a), tr.s(b)
    terms = a.shape[0] if func.overloadpacket is aten.addbmm else 1
    k = (a.shape[-1] if func.overloadpacket is not aten.addr else 1) * terms
    s = alpha * op(sa, sb)
    e = alpha * (product(tr.e(a), sb, op) + product(sa, tr.e(b), op))
    if beta:
        # The unfused form (a @ b) + c stores the product first: one more rounding, of the product.
        e = e + tr.u * s + beta * tr.e(c)
        s = s + beta * tr.s(c)
        k += 1
    tr.set(out, s=s, e=plus(tr.accumulation(k) * s, e), owned=True)
    return out


@register_magnitude_rule(aten.index_add, aten.scatter_add, aten.embedding_dense_backward)
def _scatter_sum(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    # Sums whose length differs per element: count the terms by running the op on ones.
    out = func(*args, **kwargs)

    def run(channel: Callable[[torch.Tensor], torch.Tensor], alpha: float) -> torch.Tensor:
        kw = {**kwargs, "alpha": alpha} if "alpha" in kwargs else kwargs
        result: torch.Tensor = func(*sub(args, channel), **kw)
        return result

    alpha = abs(float(kwargs.get("alpha", 1)))
    s = run(lambda t: tr.s(t), alpha)
    e = run(lambda t: torch.zeros(t.shape, dtype=torch.float64, device=t.device) + tr.e(t), alpha)
    n = run(lambda t: torch.ones(t.shape, dtype=torch.float64, device=t.device), 1.0)
    tr.set(out, s=s, e=plus(tr.accumulation(n) * s, e), owned=True)
    return out
