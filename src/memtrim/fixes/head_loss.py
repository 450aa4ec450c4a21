"""``chunked_head_loss(model.lm_head)``: ``F.cross_entropy(model(x).logits.view(-1, V), y)`` computed by
:func:`~memtrim.fixes.cross_entropy.chunked_linear_cross_entropy`, without the ``[tokens, vocab]`` logits
and without changing the training code.

The patch replaces the ``nn.Linear`` instance's ``forward`` (not the class's). Where a training forward
runs (grad enabled, no autocast, an input or the weight requiring grad) it returns
:class:`DeferredLogits`: a tensor with the logits' shape, dtype, device and strides that holds only the
layer's input. What a loss does to logits on the way (``.view``/``.reshape``/``.flatten`` keeping the
vocabulary as the last dim, indexing that leaves the last dim whole such as ``logits[:, :-1, :]``,
``.contiguous()``, ``.float()``) is done to the input instead, and ``F.cross_entropy`` of 2-D deferred
logits and 1-D integer targets is the chunked loss of the input and the layer's weight and bias (with
``ignore_index``, ``reduction``, ``label_smoothing``; the fp32 loss after ``.float()``).

Anything else a program does with the logits (``argmax`` for an accuracy, printing them, another loss)
makes them for real, once, with the same ``F.linear`` call the layer would have made and then the ops
recorded on the way: the program computes what it computed before and holds the logits from then on
(the memory is not saved, the result is unchanged). The input must not be changed in place meanwhile,
nor the weight (an optimizer step) before the logits are made: that raises, naming this fix.
``handle.remove()`` restores the layer.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from memtrim.fixes.cross_entropy import chunked_linear_cross_entropy, is_fake

_CROSS_ENTROPY = inspect.signature(F.cross_entropy)

_METADATA_METHODS = frozenset(
    {
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.ndimension,
        torch.Tensor.numel,
        torch.Tensor.nelement,
        torch.Tensor.element_size,
        torch.Tensor.stride,
        torch.Tensor.storage_offset,
        torch.Tensor.is_contiguous,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.get_device,
        torch.Tensor.__len__,
    }
)
_METADATA_PROPERTIES = frozenset(
    {
        "shape",
        "dtype",
        "device",
        "ndim",
        "layout",
        "requires_grad",
        "is_cuda",
        "is_cpu",
        "is_meta",
        "is_sparse",
        "is_quantized",
        "is_nested",
        "itemsize",
        "nbytes",
    }
)
_RESHAPES = frozenset(
    {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten, torch.flatten}
)


@dataclass
class _Head:
    """One deferred call of the layer: its input and parameters as the call saw them."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    chunk_size: int | None
    grad_enabled: bool
    versions: tuple[int, int]
    logits: torch.Tensor | None = field(default=None, repr=False)

    def check_unchanged(self, doing: str) -> None:
        if (self.hidden._version, self.weight._version) != self.versions:
            raise RuntimeError(
                f"memtrim.fixes.chunked_head_loss: {doing} needs the logits of an lm_head call whose "
                "input or weight has been changed in place since (an optimizer step?); compute the loss "
                "and anything else from the logits before changing them, or handle.remove() the fix"
            )

    def materialise(self) -> torch.Tensor:
        if self.logits is None:
            self.check_unchanged("this use of the logits")
            with torch.set_grad_enabled(self.grad_enabled):
                self.logits = F.linear(self.hidden, self.weight, self.bias)
        return self.logits


class DeferredLogits(torch.Tensor):
    """Logits not made yet (see :mod:`memtrim.fixes.head_loss`): metadata only, no storage."""

    _head: _Head
    _hidden: torch.Tensor
    """The layer's input, reshaped and indexed as the logits have been."""
    _ops: tuple[tuple[Any, tuple[Any, ...], dict[str, Any]], ...]
    """The ops done to the logits since the layer, replayed on the real logits if they are made."""
    _upcast: bool

    @staticmethod
    def __new__(
        cls,
        head: _Head,
        hidden: torch.Tensor,
        ops: tuple[tuple[Any, tuple[Any, ...], dict[str, Any]], ...],
        upcast: bool,
        like: torch.Tensor,
    ) -> DeferredLogits:
        made = torch.Tensor._make_wrapper_subclass(
            cls,
            like.shape,
            strides=like.stride(),
            storage_offset=like.storage_offset(),
            dtype=like.dtype,
            device=hidden.device,
            requires_grad=head.grad_enabled and (hidden.requires_grad or head.weight.requires_grad),
        )
        made._head, made._hidden, made._ops, made._upcast = head, hidden, ops, upcast
        return made

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return repr(self.materialise())

    def materialise(self) -> torch.Tensor:
        """The real logits: the layer's ``F.linear`` (made once per call), then the ops done since."""
        out = self._head.materialise()
        for func, args, kwargs in self._ops:
            out = func(out, *args, **kwargs)
        return out

    def _meta(self) -> torch.Tensor:
        root = self._head.hidden
        with _disable_current_modes():
            meta = torch.empty_strided(
                (*root.shape[:-1], self._head.weight.shape[0]),
                _contiguous_strides((*root.shape[:-1], self._head.weight.shape[0])),
                dtype=self._head.weight.dtype,
                device="meta",
            )
            for func, args, kwargs in self._ops:
                meta = func(meta, *args, **kwargs)
        return meta

    def _then(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> DeferredLogits | None:
        """``func(self, *args)`` still deferred, or None where only the real logits can say."""
        vocab = self._head.weight.shape[0]
        if func in _RESHAPES or func is torch.Tensor.contiguous:
            like = _on_meta(self._meta(), func, args, kwargs)
            if like.dim() < 2 or like.shape[-1] != vocab:
                return None
            hidden = self._hidden.reshape(*like.shape[:-1], self._hidden.shape[-1])
        elif func is torch.Tensor.__getitem__ and len(args) == 1 and _leaves_last_dim(args[0], self.dim()):
            like = _on_meta(self._meta(), func, args, kwargs)
            if like.dim() < 2:
                return None
            hidden = self._hidden[args[0]]
        elif _is_float32_cast(func, args, kwargs, self.dtype):
            like = _on_meta(self._meta(), func, args, kwargs)
            hidden = self._hidden
        else:
            return None
        upcast = self._upcast or like.dtype != self.dtype
        return DeferredLogits(self._head, hidden, (*self._ops, (func, args, kwargs)), upcast, like)

    def _cross_entropy(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
        bound = _CROSS_ENTROPY.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        target = a["target"]
        if (
            a["input"] is not self
            or self.dim() != 2
            or not isinstance(target, torch.Tensor)
            or isinstance(target, DeferredLogits)
            or target.dtype.is_floating_point
            or target.dtype == torch.bool
            or target.dim() != 1
            or a["weight"] is not None
            or a["size_average"] is not None
            or a["reduce"] is not None
        ):
            return None
        head = self._head
        head.check_unchanged("the loss")
        loss = chunked_linear_cross_entropy(
            self._hidden,
            head.weight,
            target,
            bias=head.bias,
            chunk_size=head.chunk_size,
            ignore_index=a["ignore_index"],
            reduction=a["reduction"],
            label_smoothing=a["label_smoothing"],
            upcast=self._upcast,
        )
        return loss.to(self.dtype) if loss.dtype != self.dtype else loss

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA_METHODS or _is_metadata_property(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        first = args[0] if args else None
        if isinstance(first, DeferredLogits):
            if func is F.cross_entropy:
                loss = first._cross_entropy(args, kwargs)
                if loss is not None:
                    return loss
            else:
                deferred = first._then(func, args[1:], kwargs)
                if deferred is not None:
                    return deferred
        real_args, real_kwargs = tree_map(_real, (args, kwargs))
        return func(*real_args, **real_kwargs)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        raise RuntimeError(
            f"memtrim.fixes.chunked_head_loss: {func} reached deferred logits below torch's Python layer "
            "(torch.compile, or a C++ extension?); handle.remove() the fix for this program"
        )


def _real(x: Any) -> Any:
    return x.materialise() if isinstance(x, DeferredLogits) else x


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _on_meta(meta: torch.Tensor, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    # the op on a storage-less copy: the shape, strides and any error the real logits would give
    with _disable_current_modes():
        return func(meta, *args, **kwargs)


def _is_metadata_property(func: Any) -> bool:
    owner = getattr(func, "__self__", None)
    return (
        getattr(func, "__name__", "") == "__get__" and getattr(owner, "__name__", "") in _METADATA_PROPERTIES
    )


def _leaves_last_dim(key: Any, ndim: int) -> bool:
    """An index of leading dims only: slices, ints and ``...``, the last dim untouched or ``:``."""
    entries = key if isinstance(key, tuple) else (key,)
    if not all(e is Ellipsis or (isinstance(e, slice | int) and not isinstance(e, bool)) for e in entries):
        return False
    if sum(e is Ellipsis for e in entries) > 1:
        return False
    last = entries[-1] if entries else Ellipsis
    touches_last = Ellipsis in entries or len(entries) == ndim
    return not touches_last or last is Ellipsis or last == slice(None)


def _is_float32_cast(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype) -> bool:
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if func is torch.Tensor.float:
        return not args and not kwargs
    if func is torch.Tensor.to:
        return (args == (torch.float32,) and not kwargs) or (not args and kwargs == {"dtype": torch.float32})
    return False


@dataclass
class ChunkedHeadLossHandle:
    """What :func:`chunked_head_loss` returns: ``remove()`` restores the layer's own forward."""

    layer: nn.Linear
    had_instance_forward: bool
    previous: Any

    def remove(self) -> None:
        if self.had_instance_forward:
            self.layer.forward = self.previous  # type: ignore[method-assign]
        elif "forward" in self.layer.__dict__:
            del self.layer.forward


def chunked_head_loss(layer: nn.Linear, *, chunk_size: int | None = None) -> ChunkedHeadLossHandle:
    """Patch ``layer`` (a model's output ``nn.Linear``: ``model.lm_head``) so that ``F.cross_entropy`` of
    its output is the chunked loss, without the ``[tokens, vocab]`` logits; undo with ``handle.remove()``.

    The loss and every gradient equal the unpatched program's to rounding (no less accurate: the
    chunked loss's log-softmax is the unfused one's, per chunk). ``chunk_size`` as in
    :func:`~memtrim.fixes.chunked_linear_cross_entropy` (None: picked from the weight's size).
    """
    if type(layer).forward is not nn.Linear.forward:
        raise TypeError(
            f"chunked_head_loss patches an nn.Linear (model.lm_head), not {type(layer).__name__}, whose "
            "forward is its own; call memtrim.fixes.chunked_linear_cross_entropy(hidden, weight, target) "
            "in the training step instead"
        )
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)):
        raise TypeError(f"chunk_size must be an int or None, not {type(chunk_size).__name__}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1 (tokens per tile), got {chunk_size}")
    original = layer.forward
    had_instance_forward = "forward" in layer.__dict__

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        weight, bias = layer.weight, layer.bias
        training = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        if (
            not training
            or isinstance(hidden, DeferredLogits)
            or (type(hidden) is not torch.Tensor and not is_fake(hidden))
            or hidden.dim() < 2
            or hidden.dtype != weight.dtype
            or torch.is_autocast_enabled(hidden.device.type)
        ):
            return original(hidden)
        head = _Head(hidden, weight, bias, chunk_size, True, (hidden._version, weight._version))
        with _disable_current_modes():
            like = torch.empty((*hidden.shape[:-1], weight.shape[0]), dtype=weight.dtype, device="meta")
        return DeferredLogits(head, hidden, (), False, like)

    layer.forward = forward  # type: ignore[method-assign,assignment]
    return ChunkedHeadLossHandle(layer, had_instance_forward, original)
