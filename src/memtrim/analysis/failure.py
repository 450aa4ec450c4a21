"""The moment a region failed (an out-of-memory error, say): what was alive then, and what was asked for.

The allocator's own message says how much the failed request wanted; it is read from the error text
by a registry of small parsers (CPU's DefaultCPUAllocator, CUDA's caching allocator), so a new device's
message is one more rule.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from memtrim.registry import Registry

RequestParser = Callable[[str], "int | None"]

REQUEST_PARSERS: Registry[str, RequestParser] = Registry(
    "failed-request parser", "memtrim.analysis.failure.REQUEST_PARSERS.register(name)"
)
"""Tried in order on the error text; the first that finds a size gives the failed request's bytes."""

_UNITS = {
    "bytes": 1,
    "B": 1,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
}


@REQUEST_PARSERS.register("cpu")
def _cpu(text: str) -> int | None:
    # DefaultCPUAllocator: can't allocate memory: you tried to allocate 4503599627370496 bytes.
    found = re.search(r"you tried to allocate (\d+) bytes", text)
    return int(found.group(1)) if found else None


@REQUEST_PARSERS.register("cuda")
def _cuda(text: str) -> int | None:
    # CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; ...); small requests print "512 bytes"
    found = re.search(r"Tried to allocate (\d+(?:\.\d+)?) ?(bytes|B|KiB|MiB|GiB|TiB|KB|MB|GB)\b", text)
    return round(float(found.group(1)) * _UNITS[found.group(2)]) if found else None


def requested_bytes(error: str | None) -> int | None:
    """The bytes a failed allocation asked for, when the error message says so."""
    if not error:
        return None
    for parse in REQUEST_PARSERS.values():
        found = parse(error)
        if found is not None:
            return found
    return None
