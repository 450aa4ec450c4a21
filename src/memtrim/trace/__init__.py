"""The trace stage: a versioned, JSON-serialisable event log (no tensors held)."""

from memtrim.trace.model import SCHEMA, Allocation, OpCall, OpLog, Site, Trace
from memtrim.trace.serialize import TraceFormatError, load, save

__all__ = ["SCHEMA", "Allocation", "OpCall", "OpLog", "Site", "Trace", "TraceFormatError", "load", "save"]
