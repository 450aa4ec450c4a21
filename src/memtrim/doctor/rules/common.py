"""Helpers the diagnosis rules share: sizes from recorded dtypes and shapes, module names, op kinds."""

from __future__ import annotations

import keyword
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from memtrim.analysis.flow import base_name, writes_in_place, writes_out
from memtrim.trace.model import Allocation, OpRow, Site, shorten_path
from memtrim.trace.notes import COMPILED_KEY

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis

ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
FLOATS = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
HALF = ("float16", "bfloat16")


def numel(a: Allocation) -> int:
    """Elements in the storage (from its bytes, so a storage later resized counts as it is)."""
    size = ITEMSIZE.get(a.dtype)
    return a.bytes // size if size else math.prod(a.shape)


def is_float(a: Allocation) -> bool:
    return a.dtype in FLOATS


def dims(shape: Sequence[int]) -> str:
    """``[1024, 50257]``: a shape as a person writes it in code."""
    return "[" + ", ".join(map(str, shape)) + "]"


def where(site: Site | None) -> str:
    """``loss_utils.py:40``: a line as the fix texts name it."""
    if site is None:
        return "(no user frame)"
    return f"{shorten_path(site.file, 1)}:{site.line}"


def lines_text(sites: Iterable[Site | None]) -> str:
    """``prog.py:14, 15, 16`` (one file) or ``a.py:3, b.py:9``."""
    out: list[str] = []
    last_file: str | None = None
    for site in dict.fromkeys(sites):
        if site is None:
            continue
        if site.file == last_file:
            out.append(str(site.line))
        else:
            out.append(where(site))
            last_file = site.file
    return ", ".join(dict.fromkeys(out))


def attribute_path(module: str | None) -> str | None:
    """The ``named_modules()`` name of a recorded module path (``GPT2LMHeadModel.lm_head`` ->
    ``lm_head``; the outermost module's class name leads a recorded path), or None where a part of
    the path is a class name rather than an attribute (a child of a container the model iterates, in
    traces whose paths do not name container indices)."""
    if not module:
        return None
    parts = module.split(".")[1:]
    if any(part[:1].isupper() for part in parts):
        return None
    return ".".join(parts)


def module_expression(module: str | None, attribute: str = "") -> str | None:
    """``model.lm_head.weight`` for module ``GPT2LMHeadModel.lm_head`` and attribute ``weight``: Python
    that runs as printed. A path with a part that is not an identifier (``layers.0``, a ``ModuleList``
    index or a ``ModuleDict`` key) is ``model.get_submodule('layers.0')``, which resolves any
    ``named_modules()`` name (``model.layers[0]`` would not, for a ``ModuleDict`` key ``"0"``)."""
    path = attribute_path(module)
    if path is None:
        return None
    parts = path.split(".") if path else []
    if all(part.isidentifier() and not keyword.iskeyword(part) for part in parts):
        text = ".".join(["model", *parts])
    else:
        text = f"model.get_submodule({path!r})"
    return f"{text}.{attribute}" if attribute else text


def describe(a: Allocation) -> str:
    """``a [1024, 50257] float32 buffer``."""
    return f"{dims(a.shape)} {a.dtype}"


def is_view_like(row: OpRow, outputs: tuple[int, ...]) -> bool:
    """An op that made no storage and wrote none: a view, a reshape that aliases, a metadata query
    (not an in-place op, nor an ``out=`` one, which read their inputs into a tensor the program holds)."""
    return not outputs and not writes_in_place(row.op) and not writes_out(row.op)


__all__ = [
    "FLOATS",
    "HALF",
    "ITEMSIZE",
    "attribute_path",
    "base_name",
    "describe",
    "dims",
    "is_float",
    "is_view_like",
    "lines_text",
    "module_expression",
    "numel",
    "where",
    "writes_in_place",
    "writes_out",
]


_ORDINALS = {2: "second", 3: "third", 4: "fourth"}


def called_object(analysis: Analysis, module: str) -> str:
    """What ``model`` stands for in a fix applied to a recorded module path's outermost module:
    ``your T5ForConditionalGeneration (the object whose modules the program ran)``. A second object of
    one class is ``Name#2`` in paths; a compiled program's paths lead with the module torch.compile
    wrapped."""
    lead = module.partition(".")[0]
    name, _, number = lead.partition("#")
    which = f"the {_ORDINALS.get(int(number), number + 'th')} " if number.isdigit() else "your "
    text = f"{which}{name} (the object whose modules the program ran)"
    if COMPILED_KEY in analysis.log.metadata:
        text += "; for a torch.compile'd model, the module it compiled (compiled._orig_mod)"
    return text
