"""Every "apply" and "prove it" hint runs exactly as printed (issue 19 item 8): for each rule with a
planted program here, the finding's ``code`` is executed with its ``binds`` bound to the program's own
objects, and its ``proof`` with the names it uses (``original``, ``rewrite``, ``inputs`` for
``memtrim.verify``; the model, optimizer and loss function for the optimizer-state proof) bound to the
code before and after the fix. The proof must pass (``assert_ok()`` raises otherwise)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from doctor_support import findings, measure
from programs import ScaledDifference
from test_diagnoses import InPlace
from test_doctor_attention import attend, attend_sdpa
from test_doctor_optimizer_state import _loop, _loss, _model

from memtrim.cases.heads import head_results, head_results_broadcast
from memtrim.doctor import DIAGNOSES


@dataclass(frozen=True)
class Planted:
    rule: str
    run: Callable[[], dict[str, Any]]
    """Runs the planted program under memtrim and returns the names its hints use, with ``trace``."""


def _attention() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    inputs = tuple(torch.randn(2, 4, 128, 32, generator=gen, requires_grad=True) for _ in range(3))
    trace = measure(lambda: attend(*inputs).sum().backward()).trace
    small = tuple(torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    return {"trace": trace, "original": attend, "rewrite": attend_sdpa, "inputs": small}


def _optimizer_state() -> dict[str, Any]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trace = measure(_loop(model, optimizer)).trace
    return {"trace": trace, "model": model, "optimizer": optimizer, "loss_fn": _loss}


def _broadcast() -> dict[str, Any]:
    z = torch.randn(64, 12, 64, requires_grad=True)
    W_O = torch.randn(12, 64, 768, requires_grad=True)
    trace = measure(lambda: head_results_broadcast(z, W_O).sum().backward()).trace
    small = (torch.randn(4, 3, 8, requires_grad=True), torch.randn(3, 8, 5, requires_grad=True))
    return {"trace": trace, "original": head_results_broadcast, "rewrite": head_results, "inputs": small}


def _chain() -> dict[str, Any]:
    x, d = torch.randn(256, 1024, requires_grad=True), torch.randn(256, 1024)
    trace = measure(lambda: ScaledDifference.apply(x, d).sum().backward()).trace
    small = (torch.randn(8, 16, requires_grad=True), torch.randn(8, 16))
    return {"trace": trace, "original": ScaledDifference.apply, "rewrite": InPlace.apply, "inputs": small}


def _kept() -> dict[str, Any]:
    hidden = torch.randn(256, 64, requires_grad=True)
    weight = torch.randn(4096, 64, requires_grad=True)
    target = torch.randint(0, 4096, (256,))

    def model(hidden: torch.Tensor, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = hidden @ weight.t()
        return {"logits": logits, "loss": torch.nn.functional.cross_entropy(logits, target[: len(hidden)])}

    def original(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = model(hidden, weight)
        return out["loss"]

    def rewrite(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return model(hidden, weight)["loss"]

    def step() -> None:
        out = model(hidden * 1.0, weight)
        out["loss"].backward()

    trace = measure(step).trace
    small = (torch.randn(16, 8, requires_grad=True), torch.randn(4096, 8, requires_grad=True))
    return {"trace": trace, "original": original, "rewrite": rewrite, "inputs": small}


PLANTED = (
    Planted("eager-attention", _attention),
    Planted("optimizer-state", _optimizer_state),
    Planted("broadcast-then-reduce", _broadcast),
    Planted("out-of-place-chain", _chain),
    Planted("kept-output", _kept),
)
NOT_PLANTED_HERE = {
    # need a process group: their hints are run in the distributed tests' own programs
    "fsdp-reshard-after-forward": "tests/test_doctor_fsdp.py",
    "ddp-gradient-as-bucket-view": "tests/test_doctor_ddp.py",
    "all-gather-saved-for-backward": "tests/test_doctor_gather.py",
    # apply code run as printed on real models, verified by verify_fix
    "checkpoint-candidates": "tests/test_doctor_unseen.py",
    "cache-in-training": "tests/test_plan_levers.py",
    # loss rules: their text is being reworked (branch rules-loss); not pinned here
    "logits-cross-entropy": "tests/test_doctor_models.py",
    "upcast-copy": "tests/test_doctor_programs.py",
    "optimizer-step": "tests/test_doctor_programs.py",
}


def test_every_rule_is_planted_here_or_says_where_its_hints_are_run() -> None:
    assert {p.rule for p in PLANTED} | set(NOT_PLANTED_HERE) == set(DIAGNOSES)


@pytest.mark.parametrize("planted", PLANTED, ids=[p.rule for p in PLANTED])
def test_the_hints_run_as_printed(planted: Planted) -> None:
    names = planted.run()
    found = findings(names.pop("trace"), planted.rule)
    assert found, planted.rule
    for d in found:
        if d.proof:  # first: the apply code changes the program's objects
            exec(d.proof, dict(names))
        if d.code:
            exec(d.code, {name: names[name] for name, _ in d.binds})
        assert d.code or d.proof or d.keeps == "changes-training", d
