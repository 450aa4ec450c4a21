"""memtrim: find what sets a PyTorch program's peak memory, cut it, and prove the rewrite safe.

``memtrim.track()`` records a region and gives a :class:`Trace`; ``memtrim.load()`` reads a saved one.
The rewrite checks live in subpackages, imported by name: ``from memtrim.verify import verify`` and
``from memtrim.bench import compare``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from memtrim.analysis import Analysis, Category, LineGroup, Peak, analyze
from memtrim.api import Diff, RanksDiff, Trace, diff, diff_ranks, fit, load, track
from memtrim.doctor import Diagnosis
from memtrim.trace import Allocation, OpCall, Phase, Site, TraceFormatError, TraceLog

if TYPE_CHECKING:
    from memtrim.capture.distributed import fake_world
    from memtrim.capture.regions import region
    from memtrim.plan import Plan, load_plan
    from memtrim.plan.apply import applied
    from memtrim.plan.fit import NoPlanFits

# Names whose modules import torch, loaded on first use: ``import memtrim`` (and so ``memtrim show``,
# ``export`` and ``diff`` on saved traces) then costs no ``import torch``, about a second of each run.
_LAZY = {
    "fake_world": "memtrim.capture.distributed",
    "region": "memtrim.capture.regions",
    "Plan": "memtrim.plan",
    "load_plan": "memtrim.plan",
    "applied": "memtrim.plan.apply",
    "NoPlanFits": "memtrim.plan.fit",
}

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memtrim' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext memtrim`` in IPython/Jupyter: adds the ``%%memtrim`` cell magic."""
    from memtrim.jupyter import load_ipython_extension as load

    load(ipython)


__all__ = [
    "Allocation",
    "Analysis",
    "Category",
    "Diagnosis",
    "Diff",
    "LineGroup",
    "NoPlanFits",
    "OpCall",
    "Peak",
    "Phase",
    "Plan",
    "RanksDiff",
    "Site",
    "Trace",
    "TraceFormatError",
    "TraceLog",
    "__version__",
    "analyze",
    "applied",
    "diff",
    "diff_ranks",
    "fake_world",
    "fit",
    "load",
    "load_plan",
    "region",
    "track",
]
