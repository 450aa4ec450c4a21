"""What the trainer-callback tests share: a tiny token dataset, and torch.profiler (the ground truth,
tests/groundtruth.py) opened and closed from two callback hooks around the region memtrim records."""

from __future__ import annotations

import contextlib

import torch
from groundtruth import ProfiledMemory, profiler_memory
from models import TOKENS, VOCAB


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``n`` fixed sequences of random token ids, labels = inputs (causal LM)."""

    def __init__(self, n: int = 16) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


class Profile:
    """torch.profiler's CPU allocations between :meth:`open` and :meth:`close`, called from two hooks."""

    def __init__(self) -> None:
        self.truth: ProfiledMemory | None = None
        self._stack: contextlib.ExitStack | None = None

    def open(self) -> None:
        self._stack = contextlib.ExitStack()
        self.truth = self._stack.enter_context(profiler_memory())

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None
