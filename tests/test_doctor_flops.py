"""The doctor's matmul FLOP formula is torch.utils.flop_counter's (written out so that diagnosing a saved
trace imports no torch), for every op it counts and any shape."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import flop_registry

from memtrim.doctor.rules.checkpoint import _registry_flops

sizes = st.integers(1, 4096)


@settings(max_examples=60, deadline=None)
@given(sizes, sizes, sizes, sizes)
def test_the_formula_is_torchs_for_each_matmul_op(batch: int, m: int, n: int, k: int) -> None:
    aten = torch.ops.aten
    assert _registry_flops("mm", 1, m, n, k) == flop_registry[aten.mm]((m, k), (k, n))
    assert _registry_flops("addmm", 1, m, n, k) == flop_registry[aten.addmm]((m, n), (m, k), (k, n))
    assert _registry_flops("bmm", batch, m, n, k) == flop_registry[aten.bmm]((batch, m, k), (batch, k, n))
    assert _registry_flops("baddbmm", batch, m, n, k) == flop_registry[aten.baddbmm](
        (batch, m, n), (batch, m, k), (batch, k, n)
    )
