"""The error budget's S and n, derived by tracing the reference through a registry of multilinear ops.

S (the sum of absolute products behind each element) is the reference evaluated on absolute values with
every subtraction turned into an addition: ``|x| @ |W|`` for ``x @ W``, ``|a| + |b|`` for ``a - b``. n (how
many products each element sums) is the same trace with all inputs and coefficients set to one. Both come
from running the reference under :class:`_AbsMode`, a ``TorchDispatchMode`` that swaps each aten op for
its rule in :data:`ABS_RULES`; an op without a rule (``exp``, ``softmax``, ``div`` by a computed tensor,
``.item()``) stops the trace with :class:`NotMultilinear`, and the report then says the budget could not be
derived and only the k-times rule holds.

Gradients: the gradient of a multilinear function is itself multilinear in (inputs, upstream gradient),
a signed sum of products of input entries and upstream-gradient entries. Autograd builds each backward
formula from the same family of ops (``mm`` of transposes, ``expand`` for ``sum``, ``mul`` by the saved
operand, ``neg`` for ``sub``) and every one of those ops runs through this mode too: operands become their
absolute values and sign flips (``neg``, ``sub``, negative scalars) become plain copies and additions.
With nonnegative operands nothing cancels, so running the backward of the abs-valued trace with
``|upstream grad|`` yields, for each gradient element, exactly the sum of the absolute values of its
products: S for the gradient. The same holds for second derivatives, which are multilinear in (inputs,
upstream gradient, direction).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from memtrim.registry import Registry

aten = torch.ops.aten


class NotMultilinear(Exception):
    """The reference uses an op outside :data:`ABS_RULES`, so S cannot be derived by tracing."""

    def __init__(self, op: str, why: str = "not linear or multilinear") -> None:
        super().__init__(f"{op} ({why})")
        self.op = op


class _Ctx:
    """What the rules need: the mode (``abs`` or ``count``) and which tensors the trace produced."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.traced: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.leafish: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    def mark(self, t: torch.Tensor, *, leaf: bool = False) -> None:
        self.traced[t] = True
        if leaf:
            self.leafish[t] = True

    def operand(self, x: Any) -> Any:
        """A tensor or number operand: its absolute value, or in count mode its count (constants: 1)."""
        if isinstance(x, torch.Tensor):
            if not (x.is_floating_point() or x.is_complex()):
                return x
            if x in self.traced:  # already |value| (or a count): produced by the trace from |inputs|
                return x
            return x.abs() if self.mode == "abs" else torch.ones_like(x)
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return self.coef(x)
        return x

    def coef(self, x: Any) -> Any:
        """A scalar coefficient: |x| for S, 1 for n (scaling adds no products)."""
        if isinstance(x, torch.Tensor):
            return x.abs() if self.mode == "abs" else torch.ones_like(x)
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return abs(x) if self.mode == "abs" else 1
        return x

    def operands(self, tree: Any) -> Any:
        return tree_map(lambda x: self.operand(x) if isinstance(x, torch.Tensor) else x, tree)


Rule = Callable[[_Ctx, Any, tuple[Any, ...], dict[str, Any]], Any]
ABS_RULES: Registry[Any, Rule] = Registry("magnitude rule", "memtrim.verify.register_abs_rule(aten.op)")
"""``aten`` op packet -> rule evaluating the op on absolute values (or counts); see register_abs_rule."""


def register_abs_rule(*packets: Any) -> Callable[[Rule], Rule]:
    """Decorator: ``rule(ctx, func, args, kwargs)`` evaluates ``func`` on absolute values for ``packets``.

    An op registered twice is refused (:class:`memtrim.registry.DuplicateRegistration`).
    """
    return ABS_RULES.register(*packets)


_VIEWS = (
    aten.view,
    aten._unsafe_view,
    aten.reshape,
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
    aten.chunk,
    aten.diagonal,
    aten.unfold,
    aten.narrow,
    aten.movedim,
    aten.flatten,
    aten.unflatten,
)
_MOVES = (
    aten.clone,
    aten._to_copy,
    aten.copy_,
    aten.lift_fresh,
    aten.lift_fresh_copy,
    aten.contiguous,
    aten.repeat,
    aten.flip,
    aten.roll,
    aten.index_select,
    aten.gather,
    aten.index,
    aten.take,
    aten.embedding,
    aten.unsqueeze_,
    aten.squeeze_,
    aten.t_,
    aten.transpose_,
    aten.is_same_size,
)
_CREATE = (
    aten.zeros,
    aten.zeros_like,
    aten.new_zeros,
    aten.empty,
    aten.empty_like,
    aten.new_empty,
    aten.new_empty_strided,
    aten.empty_strided,
    aten.zero_,
)


@register_abs_rule(*_VIEWS, *_MOVES)
def _structural(ctx: _Ctx, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Views, copies and selections move values without combining them: S and n move with them.
    return func(*args, **kwargs)


@register_abs_rule(*_CREATE)
def _zeros(ctx: _Ctx, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return func(*args, **kwargs)


@register_abs_rule(aten.ones, aten.ones_like, aten.new_ones, aten.full, aten.full_like, aten.new_full)
def _constants(ctx: _Ctx, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return ctx.operand(func(*args, **kwargs))


@register_abs_rule(aten.fill_)
def _fill(ctx: _Ctx, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return func(args[0], ctx.coef(args[1]))


@register_abs_rule(
    aten.sum,
    aten.cumsum,
    aten.cat,
    aten.stack,
    aten.mm,
    aten.bmm,
    aten.mv,
    aten.dot,
    aten.matmul,
    aten.einsum,
    aten.addmm,
    aten.addbmm,
    aten.baddbmm,
    aten.addmv,
    aten.addr,
    aten.outer,
    aten.linear,
    aten.index_put,
    aten.index_add,
    aten.scatter_add,
    aten.embedding_dense_backward,
    aten.select_backward,
    aten.slice_backward,
    aten.diagonal_backward,
    aten.unfold_backward,
    aten.as_strided_scatter,
    aten.slice_scatter,
    aten.select_scatter,
    aten.diagonal_scatter,
    aten.tensordot,
    aten.trace,
)
def _multilinear(ctx: _Ctx, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Sums and products of their tensor operands; numbers in positional slots are dims or sizes here.
    kw = {k: ctx.coef(v) if k in ("alpha", "beta") else v for k, v in kwargs.items()}
    return func(*ctx.operands(args), **ctx.operands(kw))


@register_abs_rule(aten.mul)
def _mul(ctx: _Ctx, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return func(ctx.operand(args[0]), ctx.operand(args[1]))


@register_abs_rule(aten.add, aten.sub, aten.rsub)
def _add(ctx: _Ctx, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # a - alpha*b and b - alpha*a become sums of absolute values: subtraction as addition.
    alpha = ctx.coef(kwargs.get("alpha", args[2] if len(args) > 2 else 1))
    a, b = ctx.operand(args[0]), ctx.operand(args[1])
    if func.overloadpacket is aten.rsub:
        a, b = b, a
    if isinstance(a, torch.Tensor):
        return torch.add(a, b, alpha=alpha)
    return torch.add(b * alpha, a)


@register_abs_rule(aten.neg, aten.positive)
def _neg(ctx: _Ctx, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = ctx.operand(args[0])
    return x.clone() if x is args[0] else x


@register_abs_rule(aten.div)
def _div(ctx: _Ctx, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Dividing by an input or a constant is one rounding, like multiplying by its reciprocal. Dividing
    # by a computed tensor is not: a cancelled denominator would make |a| / |b| too small.
    a, b = args[0], args[1]
    if kwargs.get("rounding_mode") is not None:
        raise NotMultilinear(str(func), "division with rounding")
    if isinstance(b, torch.Tensor) and b in ctx.traced and b not in ctx.leafish:
        raise NotMultilinear(str(func), "division by a computed tensor")
    if ctx.mode == "count":
        return ctx.operand(a).clone()
    return ctx.operand(a) / ctx.operand(b)


@register_abs_rule(aten.mean)
def _mean(ctx: _Ctx, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = ctx.operand(args[0])
    if ctx.mode == "abs":
        return func(x, *args[1:], **kwargs)
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    return x.sum() if dims is None else x.sum(dims, keepdim=keepdim)


@register_abs_rule(aten.constant_pad_nd)
def _pad(ctx: _Ctx, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    fill = ctx.coef(value) if value else 0
    return func(ctx.operand(args[0]), args[1], fill)


_INPLACE = {
    aten.add_: aten.add,
    aten.sub_: aten.sub,
    aten.mul_: aten.mul,
    aten.div_: aten.div,
    aten.neg_: aten.neg,
    aten.addmm_: aten.addmm,
    aten.baddbmm_: aten.baddbmm,
    aten.cumsum_: aten.cumsum,
    aten.index_put_: aten.index_put,
    aten.index_add_: aten.index_add,
    aten.scatter_add_: aten.scatter_add,
}


def _inplace(ctx: _Ctx, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    functional = _INPLACE[func.overloadpacket]
    overload = getattr(functional, func._overloadname, functional.default)
    result = ABS_RULES[functional](ctx, overload, args, kwargs)
    args[0].copy_(result)
    return args[0]


ABS_RULES.register(*_INPLACE)(_inplace)


class _AbsMode(TorchDispatchMode):
    def __init__(self, ctx: _Ctx) -> None:
        super().__init__()
        self.ctx = ctx

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        rule = ABS_RULES.get(func.overloadpacket)
        if rule is None:
            raise NotMultilinear(str(func))
        out = rule(self.ctx, func, args, kwargs)
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        from_trace = any(t in self.ctx.traced for t in ins) or rule is _zeros or rule is _constants
        from_leaf = rule is _structural and any(t in self.ctx.leafish for t in ins)
        if from_trace or rule is not _structural:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.ctx.mark(t, leaf=from_leaf)
        return out


def abs_mode(mode: str) -> tuple[_AbsMode, _Ctx]:
    """A fresh tracing mode: ``"abs"`` evaluates S, ``"count"`` evaluates n."""
    if mode not in ("abs", "count"):
        raise ValueError(f"mode must be 'abs' or 'count', not {mode!r}")
    ctx = _Ctx(mode)
    return _AbsMode(ctx), ctx
