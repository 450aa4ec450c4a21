"""The reference's rounding error, bounded op by op while it runs in float64: the tracer behind the budget.

The oracle of a case is the reference run in float64 on the case's rounded inputs. While it runs, a
``TorchDispatchMode`` (:class:`Tracer`) keeps, next to every floating-point value it computes, two
*shadow* numbers per element:

* **S**, the magnitude: a bound on ``|value|`` that does not depend on how sums and products are
  ordered or associated — the sum of absolute products (``|a| @ |b|`` for ``a @ b``, ``sum(|x|)`` for
  ``x.sum()``); after an elementwise addition or subtraction, and after a nonlinear op, ``|value|``
  itself, so a difference that cancels (``x - mean(x)``) keeps a tight budget downstream.
* **E**, the error: a first-order bound on how far an implementation of the same computation in the case's
  precision can be from the exact value, given that (a) every op's result is rounded to the storage dtype
  (unit roundoff ``u``, and ``eta`` absolutely where it underflows into the subnormals), the way an
  unfused rewrite that stores each step would round it; (b) a reduction
  of ``N`` terms accumulates in its opmath dtype (``u_acc``) in any order, erring by at most
  ``min(c*sqrt(N), N) * u_acc * S`` (Higham and Mary's probabilistic bound, and the worst case below
  ``N = c**2``); (c) a transcendental function errs by its documented ulps (:data:`FUNCTION_ULPS`); (d)
  incoming errors propagate through the op's derivative: ``|f'(x)| * E(x)`` for an elementwise ``f``,
  ``E(a) @ S(b) + S(a) @ E(b)`` for a product, and so on.

E excludes the rounding of the value itself: a consumer adds ``u * S + eta`` for each input that was
rounded (the *rounded* flag, a third shadow), and the budget of a final output adds ``u_out * |value|``
(plus its ``eta``).

The shadows live in tensors shaped like each storage (float64, float64, bool) and are found through the
storage, so every view of a tensor sees its own slice, and an in-place op writes the shadows of the
elements it writes. Inputs and constants have no shadow: they are exact.

Each aten op is handled by its rule in :data:`MAGNITUDE_RULES` (see :mod:`memtrim.verify.magnitude_rules`).
Composite ops (softmax, layer norm, variance, cross-entropy, GELU, their backward ops) are traced through
PyTorch's own decompositions, so their budget is the sum of their steps'. An op without a rule that returns
floating-point tensors stops the trace with :class:`NotTraceable`; the report then says the budget could not
be derived and only the k-times rule holds.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memtrim.registry import Registry
from memtrim.verify.budget import C_REORDER, Rounding
from memtrim.verify.chunks import chunks

aten = torch.ops.aten


class NotTraceable(Exception):
    """The reference uses an op without a magnitude rule, so its budget cannot be derived by tracing."""

    def __init__(self, op: str, why: str = "no magnitude rule") -> None:
        super().__init__(f"{op} ({why})")
        self.op = op


NotMultilinear = NotTraceable
"""The former name of :class:`NotTraceable` (the tracer then knew only multilinear ops)."""

Rule = Callable[["Tracer", Any, tuple[Any, ...], dict[str, Any]], Any]
MAGNITUDE_RULES: Registry[Any, Rule] = Registry(
    "magnitude rule", "memtrim.verify.register_magnitude_rule(aten.op)"
)
"""``aten`` op packet -> ``rule(tracer, func, args, kwargs)``: runs the op and sets its outputs' shadows."""

ABS_RULES = MAGNITUDE_RULES
"""The former name of :data:`MAGNITUDE_RULES`."""


def register_magnitude_rule(*packets: Any) -> Callable[[Rule], Rule]:
    """Decorator: ``rule(tracer, func, args, kwargs)`` runs ``func`` and sets the shadows of its outputs
    (:meth:`Tracer.set`) for each op packet in ``packets``. An op registered twice is refused
    (:class:`memtrim.registry.DuplicateRegistration`)."""
    return MAGNITUDE_RULES.register(*packets)


register_abs_rule = register_magnitude_rule
"""The former name of :func:`register_magnitude_rule`."""


@dataclass
class _Shadow:
    """The shadows of one storage, one entry per element of the dtype that first wrote it."""

    s: torch.Tensor
    e: torch.Tensor
    q: torch.Tensor
    itemsize: int


Number = float | torch.Tensor


class Tracer:
    """What rules work with: the case's unit roundoffs and the shadows of every traced tensor.

    ``u`` is the storage dtype's unit roundoff, ``u_acc`` the accumulator's, ``c`` the reordering
    constant. Use :attr:`mode` as a context manager around the reference (forward and backward).
    """

    def __init__(self, rounding: Rounding, c: float = C_REORDER) -> None:
        self.u = rounding.u
        self.u_acc = rounding.u_acc
        self.eta = rounding.eta
        self.c = c
        self.rng_used = False
        self._shadows: weakref.WeakKeyDictionary[Any, _Shadow] = weakref.WeakKeyDictionary()
        self.mode = _TracingMode(self)

    # -- reading shadows ---------------------------------------------------------------------------
    def _shadow(self, t: torch.Tensor) -> _Shadow | None:
        sh = self._shadows.get(t.untyped_storage())
        if sh is not None and sh.itemsize != t.element_size():
            raise NotTraceable("a dtype view", "the same bytes read as another dtype")
        return sh

    def _view(self, flat: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.as_strided(flat, t.shape, t.stride(), t.storage_offset())

    def value(self, x: Any) -> Any:
        """``x`` as float64 (tensors) or float (numbers), for derivatives."""
        if isinstance(x, torch.Tensor):
            return x.to(torch.float64) if x.dtype != torch.float64 else x
        return float(x)

    def s(self, x: Any) -> Any:
        """The magnitude S of ``x``: its shadow, or ``|x|`` for an input, a constant or a number."""
        if isinstance(x, torch.Tensor):
            sh = self._shadow(x) if _is_float(x) else None
            return self._view(sh.s, x) if sh is not None else self.value(x).abs()
        return abs(float(x)) if isinstance(x, (int, float)) else x

    def e(self, x: Any) -> Any:
        """The error bound of ``x`` as stored: its propagated error plus its own rounding (``u * S + eta``).
        ``0.0`` (a number) for an exact input, constant or number."""
        if not isinstance(x, torch.Tensor):
            return 0.0
        sh = self._shadow(x) if _is_float(x) else None
        if sh is None:
            return 0.0
        e, q = self._view(sh.e, x), self._view(sh.q, x)
        # e + u*S + eta where rounded, e elsewhere; computed in place in one new tensor (the same
        # roundings: addition commutes exactly), skipping the selections that change nothing.
        total = torch.mul(self._view(sh.s, x), self.u).add_(e).add_(self.eta)
        if not bool(q.all()):
            torch.where(q, total, e, out=total)
        # An infinite value (an attention mask's -inf) is exact: rounding keeps it, and inf - m is
        # -inf. Without this its error, u * inf, would reach finite results as inf * 0 = NaN.
        if _has_inf(x):
            total.masked_fill_(torch.isinf(x), 0.0)
        return total

    def channels(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(S, E before its own rounding, rounded) of ``x``, for ops that move values without arithmetic."""
        sh = self._shadow(x) if _is_float(x) else None
        if sh is None:
            zeros = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
            return self.value(x).abs(), zeros, torch.zeros(x.shape, dtype=torch.bool, device=x.device)
        return self._view(sh.s, x), self._view(sh.e, x), self._view(sh.q, x)

    def final(self, x: torch.Tensor, *, copy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, E before the final rounding) of a result, as float64 copies.

        ``copy=False`` (the oracle, once the run is over and nothing writes to the shadows again) returns
        views of the shadows where ``x`` covers its whole storage, so the oracle holds no second copy of
        them, and a broadcast zero for the E of an untraced value; a view of part of a storage is still
        copied, so a small result does not keep a large shadow alive.
        """
        sh = self._shadow(x) if _is_float(x) else None
        if sh is None:
            s = self.value(x).abs()
            if not copy:
                return s, torch.zeros((), dtype=torch.float64, device=x.device).expand(x.shape)
            return s.clone(), torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        s, e = self._view(sh.s, x), self._view(sh.e, x)
        if copy or x.numel() < sh.s.numel():
            return s.clone(), e.clone()
        return s, e

    def clear(self) -> None:
        """Drop every shadow (the run is over). Results of :meth:`final` with ``copy=False`` stay valid:
        they hold their own shadows. The tracer and its mode reference each other, so without this the
        shadows of the run would live until Python's cycle collector found them."""
        self._shadows = weakref.WeakKeyDictionary()

    # -- writing shadows ---------------------------------------------------------------------------
    def set(self, out: torch.Tensor, *, s: Any, e: Any, rounded: Any = True, owned: bool = False) -> None:
        """Set the shadows of ``out``'s elements: magnitude ``s``, error ``e`` before ``out``'s own
        rounding, and whether ``out`` was rounded to the storage dtype (True for every computed value;
        a tensor for ops that only move values).

        ``owned=True``: ``s`` and ``e`` are new tensors the caller neither keeps nor writes again, so where
        ``out`` gets its first shadows and each is laid out as ``out`` over the whole storage, the tracer
        keeps them as the shadows instead of copying them (the same values, one case-sized float64 tensor
        fewer each)."""
        if not _is_float(out) or out.numel() == 0:
            return
        if torch._debug_has_internal_overlap(out) == 1:  # an expanded view: one slot, several elements
            raise NotTraceable("a write through an expanded view", "its elements share memory")
        storage = out.untyped_storage()
        sh = self._shadows.get(storage)
        if sh is None:
            flat = torch.empty(0, dtype=out.dtype, device=out.device).set_(storage)
            if out.numel() == flat.numel() and _dense(out):  # out writes every element
                kept = [_adoptable(v, out, flat.numel()) if owned else None for v in (s, e)]
                if kept[0] is not None and kept[1] is not None and kept[0].data_ptr() == kept[1].data_ptr():
                    kept[1] = None  # one tensor for both: copy the second
                s0, e0 = (
                    k if k is not None else torch.empty(flat.shape, dtype=torch.float64, device=out.device)
                    for k in kept
                )
                q0 = torch.empty(flat.shape, dtype=torch.bool, device=out.device)
                s = None if kept[0] is not None else s
                e = None if kept[1] is not None else e
            else:  # the elements out does not write: exact values, as an input's
                s0 = flat.to(torch.float64).abs()
                e0 = torch.zeros(flat.shape, dtype=torch.float64, device=out.device)
                q0 = torch.zeros(flat.shape, dtype=torch.bool, device=out.device)
            sh = _Shadow(s0, e0, q0, out.element_size())
            self._shadows[storage] = sh
        elif sh.itemsize != out.element_size():
            raise NotTraceable("a dtype view", "the same bytes written as another dtype")
        for flat, value in ((sh.s, s), (sh.e, e), (sh.q, rounded)):
            if value is None:  # adopted: already the shadow
                continue
            view = self._view(flat, out)
            if isinstance(value, torch.Tensor):
                view.copy_(value)
            else:
                view.fill_(value)

    def exact(self, out: torch.Tensor) -> None:
        """``out`` holds exact constants (a fill, random draws, an integer cast)."""
        if self._shadows.get(out.untyped_storage()) is not None:
            self.set(out, s=self.value(out).abs(), e=0.0, rounded=False)

    # -- helpers for rules -------------------------------------------------------------------------
    def accumulation(self, n: Number) -> Number:
        """``min(c*sqrt(N), N) * u_acc``: the error per unit of S of summing ``N`` terms in any order."""
        if isinstance(n, torch.Tensor):
            n = n.to(torch.float64)
            return torch.where(n >= 2, torch.minimum(self.c * n.sqrt(), n), 0.0) * self.u_acc
        return (min(self.c * math.sqrt(n), n) if n >= 2 else 0.0) * self.u_acc

    def redispatch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` (a decomposition) with this tracer on, so each of its steps is traced."""
        with self.mode:
            return fn(*args, **kwargs)


def _has_inf(x: torch.Tensor) -> bool:
    """Whether ``x`` holds an infinity: its largest and smallest elements (two passes, no temporary),
    or where a NaN hides them, piece by piece (``isinf`` makes a temporary the size of x)."""
    if x.numel() == 0:
        return False
    top, bottom = float(x.amax()), float(x.amin())
    if not (math.isnan(top) or math.isnan(bottom)):
        return math.isinf(top) or math.isinf(bottom)
    return any(bool(torch.isinf(x[index]).any()) for _, index in chunks(x.shape))


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _adoptable(v: Any, out: torch.Tensor, n: int) -> torch.Tensor | None:
    """``v``'s storage as a flat shadow of ``n`` float64 elements where ``v`` (a new tensor) is laid out
    exactly as ``out`` over its whole storage (``out`` dense, from offset 0); None where it is not."""
    if not (
        isinstance(v, torch.Tensor)
        and v.dtype == torch.float64
        and v.device == out.device
        and v._base is None
        and not v.requires_grad
        and v.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
        and out.storage_offset() == 0
        and v.storage_offset() == 0
        and v.shape == out.shape
        and v.stride() == out.stride()
        and v.untyped_storage().nbytes() == n * 8
    ):
        return None
    return torch.empty(0, dtype=torch.float64, device=v.device).set_(v.untyped_storage())


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements are distinct and leave no gap: taken by increasing stride, each dim's
    stride is the number of elements the dims before it span."""
    span = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1):
        if stride != span:
            return False
        span *= size
    return True


class _TracingMode(TorchDispatchMode):
    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func._overloadname == "out" or "out" in kwargs:
            raise NotTraceable(str(func), "out= variant")
        if any(isinstance(t, torch.Tensor) and t.is_complex() for t in tree_flatten((args, kwargs))[0]):
            raise NotTraceable(str(func), "complex values")
        rule = MAGNITUDE_RULES.get(func.overloadpacket)
        if rule is not None:
            return rule(self.tracer, func, args, kwargs)
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            return self.tracer.redispatch(func.decompose, *args, **kwargs)
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_complex():
                raise NotTraceable(str(func), "complex values")
            if _is_float(t) or isinstance(t, float):
                raise NotTraceable(str(func))
        return out  # integer or boolean results (comparisons, indices) carry no rounding error


__all__ = [
    "ABS_RULES",
    "MAGNITUDE_RULES",
    "NotMultilinear",
    "NotTraceable",
    "Tracer",
    "register_abs_rule",
    "register_magnitude_rule",
]
