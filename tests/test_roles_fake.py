"""``track(fake=True)`` attributes every allocation as a real run of the same program does: the same
op, phase, role, category, file, line, autograd node and module path, and the same bytes and ticks."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import CORPUS, TinyModel, new_optimizer, train_step
from programs import ScaledDifference
from torch.utils.checkpoint import checkpoint

import memtrim

FIELDS = (
    "op", "phase", "file", "line", "function", "node", "module", "call_site", "bytes", "dtype", "shape",
    "device", "alloc_tick", "free_tick", "free_phase", "saved", "preexisting", "facts",
)  # fmt: skip


def attribution(trace: memtrim.Trace) -> list[tuple[Any, ...]]:
    return [
        (trace.role(a), trace.category(a), *(getattr(a, name) for name in FIELDS)) for a in trace.allocations
    ]


def assert_fake_matches_real(make: Callable[[], Callable[[], object]]) -> memtrim.Trace:
    """``make()`` builds the program's state from scratch (seeded) and returns its region's body."""
    traces = []
    for fake in (False, True):
        torch.manual_seed(0)
        body = make()
        with memtrim.track(fake=fake) as trace:
            body()
        traces.append(trace)
    real, fake_trace = traces
    assert attribution(fake_trace) == attribution(real)
    assert fake_trace.peak_bytes == real.peak_bytes
    return real


def line_of(fn: object, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)  # type: ignore[arg-type]
    return start + next(i for i, line in enumerate(lines) if text in line)


def _exp_program() -> Callable[[], None]:
    x = torch.randn(1000, requires_grad=True)

    def body() -> None:
        y = x.exp()
        y.sum().backward()

    return body


def test_the_issues_minimal_program() -> None:
    # fake used to call the exp "kept" and point the backward multiply at the .backward() line
    real = assert_fake_matches_real(_exp_program)
    exp = next(a for a in real.allocations if a.op == "aten.exp.default")
    mul = next(a for a in real.allocations if a.op == "aten.mul.Tensor")
    assert real.role(exp) == "activation" and real.category(exp) == "saved"
    assert mul.node == "ExpBackward0" and mul.line == exp.line == line_of(_exp_program, "y = x.exp()")


class _SavesInputAndIntermediate(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, a: torch.Tensor) -> torch.Tensor:
        b = a.exp()
        ctx.save_for_backward(a, b)
        return (b * a.sin()).view(-1)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> torch.Tensor:
        a, b = ctx.saved_tensors  # type: ignore[attr-defined]
        return g.view_as(a) * b * 2


def test_custom_functions() -> None:
    def make() -> Callable[[], None]:
        x, d = torch.randn(64, 128, requires_grad=True), torch.randn(64, 128)

        def body() -> None:
            h = ScaledDifference.apply(x, d)
            _SavesInputAndIntermediate.apply(h.neg()).sum().backward()

        return body

    real = assert_fake_matches_real(make)
    assert any(a.node == "ScaledDifferenceBackward" and a.function == "backward" for a in real.allocations)
    assert any(a.saved for a in real.allocations)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.register_buffer("scale", torch.full((64,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.proj(x))
        return (self.norm(h) * self.scale).softmax(-1)


def test_built_in_backward_nodes_with_an_optimizer_step() -> None:
    def make() -> Callable[[], None]:
        model = torch.nn.Sequential(_Block(), torch.nn.Linear(64, 8))
        optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
        x, target = torch.randn(16, 32), torch.randint(0, 8, (16,))

        def body() -> None:
            torch.nn.functional.cross_entropy(model(x), target).backward()
            optimizer.step()

        return body

    real = assert_fake_matches_real(make)
    roles = {real.role(a) for a in real.allocations}
    assert {"parameter", "gradient", "optimizer_state", "activation", "buffer"} <= roles


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing(reentrant: bool) -> None:
    def make() -> Callable[[], None]:
        layer = torch.nn.Linear(64, 64)
        x = torch.randn(8, 64, requires_grad=True)

        def block(t: torch.Tensor) -> torch.Tensor:
            return layer(t).tanh().exp()

        def body() -> None:
            checkpoint(block, x, use_reentrant=reentrant).sum().backward()

        return body

    assert_fake_matches_real(make)


@pytest.mark.parametrize("tiny", CORPUS, ids=[m.name for m in CORPUS])
def test_tiny_transformers_built_before_the_region(tiny: TinyModel) -> None:
    def make() -> Callable[[], None]:
        model, batch = tiny.build(), tiny.batch()
        optimizer = new_optimizer(model)
        return lambda: train_step(model, optimizer, batch)

    assert_fake_matches_real(make)


# ViT's initialisation (trunc_normal_) reads values, which fake tensors do not have: it cannot be
# built under fake mode, only used there.
@pytest.mark.parametrize("tiny", [m for m in CORPUS if m.name != "vit"], ids=lambda m: m.name)
def test_tiny_transformers_built_inside_the_region(tiny: TinyModel) -> None:
    def make() -> Callable[[], None]:
        def body() -> None:
            model, batch = tiny.build(), tiny.batch()
            train_step(model, new_optimizer(model), batch)

        return body

    assert_fake_matches_real(make)
