"""Rules for ops that move values without arithmetic (views, copies, gathers, padding, fills), exact
constants and random draws: the shadows go where the values go."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memtrim.verify.magnitude_rules.common import Args, Kwargs, aten, flat, select3, storages, sub
from memtrim.verify.magnitudes import NotTraceable, Tracer, register_magnitude_rule

# -- moves: the shadows go where the values go ------------------------------------------------------
_VIEWS = (
    aten.view,
    aten._unsafe_view,
    aten._reshape_alias,
    aten.unsqueeze,
    aten.squeeze,
    aten.permute,
    aten.transpose,
    aten.t,
    aten.expand,
    aten.select,
    aten.slice,
    aten.as_strided,
    aten.alias,
    aten.detach,
    aten.unbind,
    aten.split,
    aten.split_with_sizes,
    aten.unsafe_split,
    aten.unsafe_split_with_sizes,
    aten.chunk,
    aten.diagonal,
    aten.unfold,
    aten.narrow,
    aten.lift_fresh,
    aten.unsqueeze_,
    aten.squeeze_,
    aten.t_,
    aten.transpose_,
    aten.view_as,
)
_COPIES = (
    aten.clone,
    aten._to_copy,
    aten.lift_fresh_copy,
    aten.repeat,
    aten.flip,
    aten.roll,
    aten.index_select,
    aten.gather,
    aten.index,
    aten._unsafe_index,
    aten.take,
    aten.embedding,
    aten.cat,
    aten.stack,
    aten.tril,
    aten.triu,
    aten.masked_select,
    aten.repeat_interleave,
    aten.select_backward,
    aten.slice_backward,
    aten.diagonal_backward,
    aten.unfold_backward,
    aten.as_strided_scatter,
    aten.slice_scatter,
    aten.select_scatter,
    aten.diagonal_scatter,
    aten.expand_copy,
    aten.permute_copy,
    aten.view_copy,
    aten.alias_copy,
    aten.narrow_copy,
)


_VALUE_COPIES = {
    aten.clone,
    aten._to_copy,
    aten.lift_fresh_copy,
    aten.repeat,
    aten.flip,
    aten.roll,
    aten.tril,
    aten.triu,
    aten.expand_copy,
    aten.permute_copy,
    aten.view_copy,
    aten.alias_copy,
    aten.narrow_copy,
}


@register_magnitude_rule(*_VIEWS, *_COPIES)
def _moves(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    # A view shares its input's storage, and so its shadows; a copy gets the same op applied to them.
    out = func(*args, **kwargs)
    outs = flat(out)
    known = storages(args, kwargs)
    fresh = [
        i
        for i, o in enumerate(outs)
        if isinstance(o, torch.Tensor) and o.is_floating_point() and o.untyped_storage()._cdata not in known
    ]
    if fresh:
        kw = {k: v for k, v in kwargs.items() if k != "dtype"}  # shadows keep float64
        every = func.overloadpacket in _VALUE_COPIES  # no index arguments: integer inputs are values too

        def channel(c: int) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda t: tr.channels(t)[c].to(torch.float64)

        chans = [flat(func(*sub(args, channel(c), every), **kw)) for c in range(3)]
        for i in fresh:
            tr.set(outs[i], s=chans[0][i], e=chans[1][i], rounded=chans[2][i] > 0.5, owned=True)
    return out


@register_magnitude_rule(aten.copy_)
def _copy(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    dst, src = args[0], args[1]
    s, e, q = tr.channels(src)
    out = func(*args, **kwargs)
    if dst.is_floating_point():
        narrower = src.is_floating_point() and torch.finfo(dst.dtype).eps > torch.finfo(src.dtype).eps
        tr.set(dst, s=s.expand(dst.shape), e=e.expand(dst.shape), rounded=(q | narrower).expand(dst.shape))
    return out


@register_magnitude_rule(aten.constant_pad_nd)
def _pad(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    x, pad = args[0], args[1]
    value = args[2] if len(args) > 2 else kwargs.get("value", 0.0)
    out = func(*args, **kwargs)
    s, e, q = tr.channels(x)
    tr.set(
        out, s=func(s, pad, abs(float(value))), e=func(e, pad, 0.0), rounded=func(q, pad, False), owned=True
    )
    return out


@register_magnitude_rule(aten.where)
def _where(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    out = func(*args, **kwargs)
    if len(args) == 3:
        s, e, q = select3(tr, args[0], args[1], args[2], out)
        tr.set(out, s=s, e=e, rounded=q, owned=True)
    return out


@register_magnitude_rule(aten.masked_fill, aten.masked_fill_)
def _masked_fill(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    x, mask, value = args[0], args[1], args[2]
    s, e, q = select3(tr, mask, value, x, x)  # before an in-place fill overwrites x
    out = func(*args, **kwargs)
    tr.set(out, s=s, e=e, rounded=q, owned=True)
    return out


@register_magnitude_rule(aten.fill_, aten.fill)
def _fill(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    value = args[1]
    out = func(*args, **kwargs)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        s, e, q = tr.channels(value)
        tr.set(out, s=s.expand(out.shape), e=e.expand(out.shape), rounded=q.expand(out.shape))
    else:
        tr.exact(out)
    return out


@register_magnitude_rule(aten.zero_)
def _zero(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    out = func(*args, **kwargs)
    tr.exact(out)
    return out


@register_magnitude_rule(aten.index_put, aten.index_put_, aten._unsafe_index_put, aten._index_put_impl_)
def _index_put(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    x, indices, values = args[0], args[1], args[2]
    accumulate = bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False))
    put = aten.index_put.default
    (sx, ex, qx), (sv, ev, qv) = tr.channels(x), tr.channels(values)
    if accumulate:
        zeros = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        s = put(sx, indices, sv, True)
        n = put(torch.ones_like(sx), indices, torch.ones_like(sv), True)
        e = put(zeros + tr.e(x), indices, torch.zeros_like(sv) + tr.e(values), True)
        e, q = e + tr.accumulation(n) * s, torch.ones_like(qx)
    else:
        s, e, q = put(sx, indices, sv), put(ex, indices, ev), put(qx, indices, qv)
    out = func(*args, **kwargs)
    tr.set(out, s=s, e=e, rounded=q, owned=True)
    return out


@register_magnitude_rule(aten.scatter)
def _scatter(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    x, dim, index, src = args[0], args[1], args[2], args[3]
    if kwargs.get("reduce") is not None or len(args) > 4:
        raise NotTraceable(str(func), "scatter with a reduction")
    out = func(*args, **kwargs)
    sx, ex, qx = tr.channels(x)
    if isinstance(src, torch.Tensor):
        ss, es, qs = tr.channels(src)
        s, e = aten.scatter.src(sx, dim, index, ss), aten.scatter.src(ex, dim, index, es)
        q = aten.scatter.src(qx.double(), dim, index, qs.double()) > 0.5
    else:
        s, e = aten.scatter.value(sx, dim, index, abs(float(src))), aten.scatter.value(ex, dim, index, 0.0)
        q = aten.scatter.value(qx.double(), dim, index, 0.0) > 0.5
    tr.set(out, s=s, e=e, rounded=q, owned=True)
    return out


# -- exact values: constants and random draws -----------------------------------------------------
_CREATE = (
    aten.zeros,
    aten.zeros_like,
    aten.new_zeros,
    aten.ones,
    aten.ones_like,
    aten.new_ones,
    aten.full,
    aten.full_like,
    aten.new_full,
    aten.empty,
    aten.empty_like,
    aten.new_empty,
    aten.new_empty_strided,
    aten.empty_strided,
    aten.empty_permuted,
    aten.arange,
    aten.linspace,
    aten.eye,
    aten.scalar_tensor,
    aten.sign,
    aten.sgn,
    aten.floor,
    aten.ceil,
    aten.round,
    aten.trunc,
    aten.one_hot,
)
_RANDOM = (
    aten.rand,
    aten.randn,
    aten.rand_like,
    aten.randn_like,
    aten.randint,
    aten.randint_like,
    aten.randperm,
    aten.bernoulli,
    aten.normal,
    aten.multinomial,
    aten.bernoulli_,
    aten.uniform_,
    aten.normal_,
    aten.random_,
    aten.exponential_,
    aten.geometric_,
    aten.cauchy_,
    aten.log_normal_,
)


@register_magnitude_rule(*_CREATE)
def _constant(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    # Exact: a new storage needs no shadow; a rounded function of a value (sign, floor) has a zero
    # derivative, so no error reaches it to first order.
    return func(*args, **kwargs)


@register_magnitude_rule(*_RANDOM)
def _random(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    tr.rng_used = True
    out = func(*args, **kwargs)
    for o in flat(out):
        if isinstance(o, torch.Tensor):
            tr.exact(o)
    return out


@register_magnitude_rule(aten.native_dropout)
def _dropout(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    tr.rng_used = True
    x, p = args[0], float(args[1])
    train = args[2] if len(args) > 2 else kwargs.get("train", True)
    out, mask = func(*args, **kwargs)
    scale = (1.0 / (1.0 - p) if p < 1 else 0.0) if train is not False else 1.0
    keep = mask.to(torch.float64) * scale
    tr.set(out, s=tr.s(x) * keep, e=tr.e(x) * keep, owned=True)
    return out, mask


@register_magnitude_rule(aten.native_dropout_backward)
def _dropout_backward(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    grad, mask, scale = args[0], args[1], float(args[2])
    out = func(*args, **kwargs)
    keep = mask.to(torch.float64) * scale
    tr.set(out, s=tr.s(grad) * keep, e=tr.e(grad) * keep, owned=True)
    return out
