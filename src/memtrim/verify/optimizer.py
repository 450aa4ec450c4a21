"""verify_optimizer: prove that an optimizer built with other options (``fused=True``, ``foreach=False``)
updates parameters no less accurately than it does as built.

>>> import torch
>>> from memtrim.verify import verify_optimizer
>>> model = torch.nn.Linear(8, 4)
>>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
>>> report = verify_optimizer(optimizer, fused=True, foreach=False)
>>> report.passed, [name for name, _ in report.groups]
(True, ['AdamW'])
>>> report.assert_ok()

Each side is a function of a parameter and its gradient that builds the optimizer's class for that one
parameter with a group's options (as built, or with ``options`` over them) and steps it twice: the first
step creates its state, the second updates it with half the gradient. The new parameter and every state
tensor are judged by :func:`memtrim.verify.verify` in ``reference`` mode (each element against the step
as built run in float64, within the rounding budget), over verify's seeds, in each floating dtype the
optimizer's parameters have, on their device. Optimizer updates are elementwise, so a ``[64, 48]``
parameter stands for every shape. The optimizer itself is not stepped or changed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from memtrim.fixes.optimizer import check_options
from memtrim.verify.results import VerifyReport

SHAPE = (64, 48)
STEPS = (1.0, 0.5)
"""The gradient's scale at each of the two steps."""


@dataclass(frozen=True)
class OptimizerReport:
    """What :func:`verify_optimizer` found: one :class:`VerifyReport` per parameter group, named by the
    optimizer's class (and the group's index where it has several)."""

    groups: tuple[tuple[str, VerifyReport], ...]

    @property
    def passed(self) -> bool:
        return all(report.passed for _, report in self.groups)

    def __iter__(self) -> Iterator[tuple[str, VerifyReport]]:
        return iter(self.groups)

    def summary(self) -> str:
        return "; ".join(f"{name}: {report.summary()}" for name, report in self.groups)

    def __str__(self) -> str:
        return "\n\n".join(f"{name}\n{report}" for name, report in self.groups)

    def assert_ok(self) -> None:
        """Raise AssertionError naming each group whose step did not hold."""
        failed = [f"{name}: {report.summary()}" for name, report in self.groups if not report.passed]
        if failed:
            raise AssertionError("verify_optimizer FAILED\n" + "\n".join(failed))


def _stepper(kind: type[torch.optim.Optimizer], options: dict[str, Any]) -> Callable[..., tuple[Any, ...]]:
    accepted = inspect.signature(kind.__init__).parameters

    def step(p: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q = p.detach().clone()
        optimizer = kind([q], **{k: v for k, v in options.items() if k in accepted})
        optimizer.param_groups[0].update(options)
        for scale in STEPS:
            q.grad = g.detach() * scale
            optimizer.step()
        state = optimizer.state[q]
        return (q, *(v for k, v in sorted(state.items()) if k != "step" and isinstance(v, torch.Tensor)))

    return step


def _inputs(dtype: torch.dtype, device: torch.device | str, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(SHAPE, generator=gen).to(device=device, dtype=dtype) for _ in range(2))


def verify_optimizer(
    optimizer: torch.optim.Optimizer, *, progress: bool | None = False, **options: Any
) -> OptimizerReport:
    """Check that ``optimizer``'s step with ``options`` set on each of its groups (``fused=True``,
    ``foreach=False``, ...) is no less accurate than its step as built, group by group."""
    from memtrim.verify.api import verify

    kind = check_options(optimizer, options, "verify_optimizer", "to check, e.g. fused=True")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    dtypes = sorted({p.dtype for p in params if torch.is_floating_point(p)}, key=str)
    device = params[0].device if params else torch.device("cpu")
    groups = []
    for n, group in enumerate(optimizer.param_groups):
        built = {k: v for k, v in group.items() if k != "params"}
        report = verify(
            _stepper(kind, built),
            _stepper(kind, {**built, **options}),
            _inputs,
            mode="reference",
            grads=False,
            dtypes=dtypes or (torch.float32,),
            layouts=("contiguous",),
            device=device,
            memory=False,
            progress=progress,
        )
        name = f"{kind.__name__} group {n}" if len(optimizer.param_groups) > 1 else kind.__name__
        groups.append((name, report))
    return OptimizerReport(tuple(groups))


__all__ = ["OptimizerReport", "verify_optimizer"]
