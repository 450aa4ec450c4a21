"""The trace stage: a plain, versioned, JSON-serialisable event log (no tensors held).

It imports nothing else of memtrim; every other stage reads it.
"""

from memtrim.trace.model import (
    PRE_REGION_OP,
    SCHEMA,
    Allocation,
    AllocationLog,
    AllocRow,
    Fact,
    FreeRow,
    OpCall,
    OpLog,
    OpRow,
    Phase,
    Region,
    Site,
    TraceLog,
    dtype_name,
    shape_text,
    site_text,
)
from memtrim.trace.serialize import TraceFormatError, check_writable, dumps, load, loads, save

__all__ = [
    "PRE_REGION_OP",
    "SCHEMA",
    "AllocRow",
    "Allocation",
    "AllocationLog",
    "Fact",
    "FreeRow",
    "OpCall",
    "OpLog",
    "OpRow",
    "Phase",
    "Region",
    "Site",
    "TraceFormatError",
    "TraceLog",
    "check_writable",
    "dtype_name",
    "dumps",
    "load",
    "loads",
    "save",
    "shape_text",
    "site_text",
]
