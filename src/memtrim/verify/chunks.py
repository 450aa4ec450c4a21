"""Pieces of a tensor, so that work over every element needs temporaries of a bounded size.

Comparing a candidate with the oracle, or an input with its value before a call, takes several float64
temporaries per element; on a case-sized tensor each is as large as the tensor in float64. Done piece
by piece, each temporary is at most :data:`CHUNK_ELEMENTS` elements, whatever the tensor's size.

A piece is a basic-indexing view (``t[index]``), so it keeps the tensor's strides: an elementwise op
on a piece computes each element exactly as it does on the whole tensor, and the pieces in order are the
tensor's elements in row-major (logical) order, the first at ``offset``.

>>> [(offset, index) for offset, index in chunks((3, 4), elements=8)]
[(0, (slice(0, 2, None),)), (8, (slice(2, 3, None),))]
>>> [offset for offset, _ in chunks((2, 5), elements=3)]
[0, 3, 5, 8]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

CHUNK_ELEMENTS = 1 << 17
"""Elements per piece: 1 MiB per float64 temporary (large enough that the per-piece overhead is noise)."""

Index = tuple[int | slice, ...]


def chunks(shape: Sequence[int], *, elements: int = CHUNK_ELEMENTS) -> Iterator[tuple[int, Index]]:
    """``(offset, index)`` for consecutive pieces of a tensor of ``shape``, each at most ``elements``
    elements (one piece, ``()``, for a scalar or an empty tensor): ``t[index]`` holds the elements
    ``offset, offset + 1, ...`` of ``t`` in row-major order."""
    shape = tuple(int(s) for s in shape)
    if not shape or math.prod(shape) == 0:
        yield 0, ()
        return
    # the first dim whose trailing dims fit in a piece: pieces are runs along it
    d = next(d for d in range(len(shape)) if math.prod(shape[d + 1 :]) <= elements)
    inner = math.prod(shape[d + 1 :])
    step = max(1, elements // inner)
    for lead_flat, lead in enumerate(itertools.product(*(range(s) for s in shape[:d]))):
        base = lead_flat * shape[d] * inner
        for a in range(0, shape[d], step):
            yield base + a * inner, (*lead, slice(a, min(a + step, shape[d])))


__all__ = ["CHUNK_ELEMENTS", "chunks"]
