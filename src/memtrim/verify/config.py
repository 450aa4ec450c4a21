"""What one :func:`memtrim.verify.verify` call was asked to do: a frozen, keyword-built configuration.

Caches (oracle runs shared between cases) live apart from it, in :class:`memtrim.verify.oracle.OracleCache`.

>>> import torch
>>> s = Settings(reference=torch.neg, candidate=torch.neg, mode="exact", device=torch.device("cpu"),
...              oracle_device=torch.device("cpu"))
>>> s.mode, s.grads, s.c
('exact', True, 10.0)
>>> s.mode = "auto"
Traceback (most recent call last):
...
dataclasses.FrozenInstanceError: cannot assign to field 'mode'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from memtrim.verify.budget import C_REORDER

Mode = Literal["auto", "exact", "reference"]
MODES: tuple[Mode, ...] = ("auto", "exact", "reference")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The two callables and how to judge them (see :func:`memtrim.verify.verify` for each field)."""

    reference: Callable[..., Any]
    candidate: Callable[..., Any]
    mode: Mode
    device: torch.device
    oracle_device: torch.device
    grads: bool = True
    second_order: bool = False
    abs_reference: Callable[..., Any] | None = None
    reduction_length: int | None = None
    c: float = C_REORDER
    memory: bool = True
