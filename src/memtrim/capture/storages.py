"""Which storages hold a tensor's memory, for the tensors whose answer is not "its untyped_storage()".

The recorder's hot path handles plain dense tensors itself; everything else comes here:

- meta tensors hold no memory (their storage has no data);
- a wrapper subclass (``_make_wrapper_subclass``: nested jagged tensors, DTensor, user wrappers) has a
  storage of its own that holds no data: its memory is its inner tensors', found through
  ``__tensor_flatten__`` where the subclass has it, and otherwise as the tensors it holds in its
  attributes (``self.elem``);
- sparse tensors have no storage of their own: their index and value tensors do;
- a strided nested tensor has one buffer, and its sizes, strides and offsets in three small tensors
  of its own (``t.shape`` raises: it has no sizes);
- fake tensors (``track(fake=True)``) stand for the memory of the real program.
"""

from __future__ import annotations

from typing import Any

import torch

_Tensor = torch.Tensor
_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}
_NESTED_METADATA = ("_nested_tensor_size", "_nested_tensor_strides", "_nested_tensor_storage_offsets")
_fake_type: type | None = None


def _is_fake(t: torch.Tensor) -> bool:
    global _fake_type
    if _fake_type is None:
        from torch._subclasses.fake_tensor import FakeTensor

        _fake_type = FakeTensor
    return isinstance(t, _fake_type)


def holds_data(storage: Any) -> bool:
    """False for a storage that stands for no memory: a meta storage or a wrapper subclass's (and an
    empty one, which is never recorded)."""
    try:
        return storage.data_ptr() != 0
    except RuntimeError:  # "an invalid python storage": a wrapper subclass's placeholder
        return False


def parts(t: torch.Tensor, depth: int = 0) -> list[tuple[torch.Tensor, Any]]:
    """The (tensor, untyped storage) pairs that hold ``t``'s memory; empty for a tensor that holds
    none (meta, or a wrapper subclass whose inner tensors cannot be listed)."""
    if depth > 8:  # subclasses nested deeper than any real one: give up rather than recurse forever
        return []
    layout = t.layout
    if layout in _SPARSE_PARTS:
        found = []
        for name in _SPARSE_PARTS[layout]:
            try:
                part = getattr(t, name)()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            found += parts(part, depth + 1)
        return found
    if _is_fake(t):
        return [] if t.device.type == "meta" else [(t, t.untyped_storage())]
    if type(t) is not _Tensor and hasattr(t, "__tensor_flatten__"):
        try:
            names, _ = t.__tensor_flatten__()
        except Exception:
            return []
        found = []
        for name in names:
            inner = getattr(t, name, None)
            if isinstance(inner, _Tensor):
                found += parts(inner, depth + 1)
        return found
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return []
    if not holds_data(storage):
        if type(t) is _Tensor:  # meta
            return []
        # a wrapper without __tensor_flatten__: the tensors it holds as attributes (``self.elem``)
        found = []
        for inner in vars(t).values():
            if isinstance(inner, _Tensor):
                found += parts(inner, depth + 1)
        return found
    found = [(t, storage)]
    if t.is_nested:  # a strided nested tensor: its buffer, and the tensors of its sizes and strides
        for name in _NESTED_METADATA:
            try:
                part = getattr(t, name)()
                found.append((part, part.untyped_storage()))
            except (RuntimeError, NotImplementedError, TypeError, AttributeError):
                continue
    return found


def row_shape(t: torch.Tensor, storage: Any) -> Any:
    """The shape to record: ``t.shape``, or for a strided nested tensor (which has no sizes) the shape
    of its flat buffer."""
    try:
        return t.shape
    except RuntimeError:
        return (storage.nbytes() // max(t.element_size(), 1),)


def is_plain(t: Any) -> bool:
    """A dense tensor with real data whose storage is its memory (the recorder's fast path)."""
    return type(t) is _Tensor and not t.is_meta and not t.is_nested
