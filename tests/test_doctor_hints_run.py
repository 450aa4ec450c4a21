"""Every hint a finding prints runs as printed, on the planted program the rule fires on (issue 19
item 8): the "write" text where it is code (taken out of the printed fix by its rule's pattern), the
"apply" code with its ``binds``, and the "prove it" code with the names its first line declares
(``# with NAME, ...: what they are``). Each hint is executed in a namespace holding only the names it says it
needs, bound to the planted program's own objects (a write line also gets the modules it names by
dotted path: apply and proof code import what they use); a "prove
it" hint's ``rewrite`` is the printed write code where there is one, and its verdict must pass.
``test_a_broken_hint_fails_here`` shows that each check fails on a hint that does not run as printed."""

from __future__ import annotations

import ast
import builtins
import copy
import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from doctor_support import findings, measure
from programs import ScaledDifference
from test_doctor_attention import CAUSAL, _tiny, attend
from test_doctor_models import TOKENS as GPT2_TOKENS
from test_doctor_models import doctor_gpt2
from test_doctor_optimizer_state import X, _loop, _loss, _model
from test_doctor_programs import CachingAttention, Tower

import memtrim
from memtrim.cases.heads import head_results_broadcast
from memtrim.doctor import DIAGNOSES, Diagnosis
from memtrim.doctor.diagnosis import PROOF

MODULES: dict[str, Any] = {"memtrim": memtrim, "torch": torch}
"""What a printed line may name without binding it: the modules it spells out by dotted path."""

WRITE_CODE = {
    "logits-cross-entropy": r"(loss = memtrim\.fixes\.\w+\(.*?\)), (?:hidden|labels) |"
    r"(memtrim\.fixes\.chunked_loss\(model, chunk_size=\d+\)): ",
    "broadcast-then-reduce": r"(torch\.einsum\(.*?\)(?:\.div_\(\d+\))?) for ",
    "eager-attention": r"(out = torch\.nn\.functional\.scaled_dot_product_attention\(.*?\)) in place of ",
    "optimizer-state": r"(torch\.optim\.Adafactor\(.*?\)\)) in place of ",
    "checkpoint-candidates": r"(memtrim\.fixes\.checkpoint_modules\(model, \[.*?\]\))",
    "optimizer-step": r"(optimizer\.zero_grad\(set_to_none=True\)) \(the default\)",
    "out-of-place-chain": r"((?:t\.\w+_\([^()]*\)(?:; )?)+), t the ",
}
"""Where the code of a rule's write text ends and its explanation (what each name is) begins."""
LOOKS_LIKE_CODE = re.compile(r"^(\w+ = )?[\w.]+\(")


def declared(code: str) -> list[str]:
    """The names a proof's first line says it needs: ``# with a, b, c: what they are`` -> a, b, c."""
    first = code.splitlines()[0]
    assert first.startswith("# with ") and ":" in first, (
        f"the proof does not say what it needs bound:\n{code}"
    )
    return [name.strip() for name in first[len("# with ") :].split(":", 1)[0].split(",")]


def free_names(code: str) -> set[str]:
    """Names the code reads and does not assign itself."""
    tree = ast.parse(code)
    stored = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    stored |= {
        a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return loaded - stored - set(dir(builtins))


def write_code(d: Diagnosis) -> str | None:
    """The code of the write text as printed, or None where the text is prose. Every name it reads is
    one the text goes on to say (or the apply code's binds say), or a module it spells out."""
    if not LOOKS_LIKE_CODE.match(d.fix):
        return None
    pattern = WRITE_CODE.get(d.rule)
    assert pattern is not None, f"{d.rule}: a write text that looks like code, with no pattern here: {d.fix}"
    found = re.match(pattern, d.fix)
    assert found, f"{d.rule}: {d.fix}"
    group = next(i for i in range(1, len(found.groups()) + 1) if found.group(i) is not None)
    code, rest = found.group(group), d.fix[found.end(group) :]
    explained = rest + "".join(f" {name} " for name, _ in d.binds)
    for name in free_names(code) - set(MODULES):
        assert re.search(rf"\b{name}\b", explained), f"{d.rule}: {name!r} is not said in {d.fix!r}"
    return code


def run(
    code: str, objects: dict[str, Any], names: list[str] | set[str], *, modules: bool = False
) -> dict[str, Any]:
    """Execute ``code`` with only ``names`` bound (from ``objects``); with ``modules``, also the modules
    a write line names by dotted path (apply and proof code import what they use themselves)."""
    scope = {**(MODULES if modules else {}), **{n: objects[n] for n in names}}
    exec(code, scope)
    return scope


def as_function(
    code: str, params: tuple[str, ...], fixed: Callable[..., dict[str, Any]]
) -> Callable[..., Any]:
    """The printed write code as a function of ``params``: what it assigns (or its value), with the
    other names it reads from ``fixed(*args)``."""
    statement = code if re.match(r"^\w+ = ", code) else f"result = {code}"
    target = statement.split(" = ", 1)[0]

    def function(*args: Any) -> Any:
        bound = {**fixed(*args), **dict(zip(params, args, strict=True))}
        return run(statement, bound, free_names(statement) - set(MODULES), modules=True)[target]

    return function


ProofNames = Callable[[Diagnosis, str | None], dict[str, Any]]


@dataclass(frozen=True)
class Planted:
    rule: str
    run: Callable[[], dict[str, Any]]
    """Runs the planted program under memtrim; returns the trace and the objects its hints name."""
    proof: ProofNames
    """The names a finding's proof uses (given the finding and its printed write code)."""
    name: str = ""


def _attention() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    inputs = tuple(torch.randn(2, 4, 128, 32, generator=gen, requires_grad=True) for _ in range(3))
    return {"trace": measure(lambda: attend(*inputs).sum().backward()).trace}


def _attention_proof(d: Diagnosis, write: str | None) -> dict[str, Any]:
    assert write is not None
    small = tuple(torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))

    def known(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
        seq = q.shape[-2]  # mask: True where the program keeps a score; scale: the one it divides by
        return {"mask": CAUSAL[:seq, :seq], "scale": 1 / math.sqrt(q.shape[-1])}

    return {"original": attend, "rewrite": as_function(write, ("q", "k", "v"), known), "inputs": small}


def _broadcast() -> dict[str, Any]:
    z = torch.randn(64, 12, 64, requires_grad=True)
    W_O = torch.randn(12, 64, 768, requires_grad=True)
    return {"trace": measure(lambda: head_results_broadcast(z, W_O).sum().backward()).trace}


def _broadcast_proof(d: Diagnosis, write: str | None) -> dict[str, Any]:
    assert write is not None and "x [64, 12, 64], y [12, 64, 768]" in d.fix  # x is z, y is W_O
    small = (torch.randn(4, 3, 8, requires_grad=True), torch.randn(3, 8, 5, requires_grad=True))
    rewrite = as_function(write, ("x", "y"), lambda x, y: {})
    return {"original": head_results_broadcast, "rewrite": rewrite, "inputs": small}


TOKENS, WIDTH, VOCAB = 256, 64, 4096


def _logits() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, WIDTH, generator=gen, requires_grad=True)
    weight = torch.randn(VOCAB, WIDTH, generator=gen, requires_grad=True)
    target = torch.randint(0, VOCAB, (TOKENS,), generator=gen)

    def step() -> None:
        logits = (hidden * 1.0) @ weight.t()
        F.cross_entropy(logits, target).backward()

    trace = measure(step).trace
    return {"trace": trace, "hidden": hidden, "weight": weight, "target": target}


def _logits_proof(d: Diagnosis, write: str | None) -> dict[str, Any]:
    assert write is not None and "target the [256] labels" in d.fix
    target = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(1))

    def original(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy((hidden * 1.0) @ weight.t(), target)

    rewrite = as_function(write, ("hidden", "weight"), lambda h, w: {"target": target})
    small = (torch.randn(16, 8, requires_grad=True), torch.randn(512, 8, requires_grad=True))
    return {"original": original, "rewrite": rewrite, "inputs": small}


def _kept() -> dict[str, Any]:
    hidden = torch.randn(256, 64, requires_grad=True)
    weight = torch.randn(4096, 64, requires_grad=True)
    target = torch.randint(0, 4096, (256,))

    def step() -> None:
        logits = (hidden * 1.0) @ weight.t()
        out = {"logits": logits, "loss": F.cross_entropy(logits, target)}
        out["loss"].backward()

    return {"trace": measure(step).trace}


def _kept_proof(d: Diagnosis, write: str | None) -> dict[str, Any]:
    target = torch.randint(0, 512, (16,))

    def model(hidden: torch.Tensor, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = hidden @ weight.t()
        return {"logits": logits, "loss": F.cross_entropy(logits, target)}

    def original(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = model(hidden, weight)
        return out["loss"]

    def rewrite(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return model(hidden, weight)["loss"]  # "loss = model(...).loss": only what is needed is kept

    small = (torch.randn(16, 8, requires_grad=True), torch.randn(512, 8, requires_grad=True))
    return {"original": original, "rewrite": rewrite, "inputs": small}


def _chain() -> dict[str, Any]:
    x, d = torch.randn(256, 1024, requires_grad=True), torch.randn(256, 1024)
    return {"trace": measure(lambda: ScaledDifference.apply(x, d).sum().backward()).trace}


def _chain_proof(d: Diagnosis, write: str | None) -> dict[str, Any]:
    assert write is not None
    assert "u the [256, 1024] float32 tensor line 20 multiplies it by (b = s * a)" in d.fix

    class Printed(ScaledDifference):
        """ScaledDifference's backward with the printed steps in place of lines 20 and 21."""

        @staticmethod
        def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
            s, saved_d = ctx.saved_tensors  # type: ignore[attr-defined]
            t = g - saved_d  # the sub's line as it is
            exec(write, {"t": t, "u": s})  # u: what line 20 multiplies it by, as the text says
            return t, None

    small = (torch.randn(8, 16, requires_grad=True), torch.randn(8, 16))
    return {"original": ScaledDifference.apply, "rewrite": Printed.apply, "inputs": small}


def _optimizer() -> dict[str, Any]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # foreach: optimizer-step fires too
    trace = measure(_loop(model, optimizer)).trace
    return {"trace": trace, "model": model, "optimizer": optimizer, "loss_fn": _loss}


def _optimizer_proof(d: Diagnosis, write: str | None) -> dict[str, Any]:
    # a fresh model and optimizer as the program built them (the apply code changes the program's own)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model": model, "optimizer": optimizer, "batch": X, "loss_fn": lambda m, x: m(x).square().mean()}


def _zeroed() -> dict[str, Any]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # for-loop step: no step temporaries

    def loop() -> None:
        for _ in range(2):
            optimizer.zero_grad(set_to_none=False)  # kept zeroed through the next forward
            _loss(model).backward()
            optimizer.step()

    return {"trace": measure(loop).trace, "model": model, "optimizer": optimizer}


def _zeroed_proof(d: Diagnosis, write: str | None) -> dict[str, Any]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return {"model": model, "optimizer": optimizer, "batch": X, "loss_fn": lambda m, x: m(x).square().mean()}


def _caching() -> dict[str, Any]:
    torch.manual_seed(0)
    attention, x = CachingAttention(), torch.randn(8, 512, 64)
    return {"trace": measure(lambda: attention(x).square().mean().backward()).trace}


def _caching_proof(d: Diagnosis, write: str | None) -> dict[str, Any]:
    torch.manual_seed(0)
    attention = CachingAttention(width=16)
    return {
        "original": lambda x: attention(x),
        "rewrite": lambda x: attention(x, use_cache=False),  # the printed fix: use_cache=False
        "inputs": (torch.randn(2, 8, 16, requires_grad=True),),
    }


def _gpt2_cache() -> dict[str, Any]:
    torch.manual_seed(0)
    model = doctor_gpt2(vocab=256, width=128, layers=1)
    batch = _transformers_batch(256, GPT2_TOKENS)

    def step() -> None:
        out = model(**batch)  # the output, and the cache it holds, kept through backward
        out.loss.backward()

    return {"trace": measure(step).trace, "model": model}


def _tower() -> dict[str, Any]:
    torch.manual_seed(0)
    tower, x = Tower(), torch.randn(2048, 128)
    trace = measure(lambda: tower(x).square().mean().backward()).trace
    return {"trace": trace, "model": tower}


def _tower_proof(d: Diagnosis, write: str | None) -> dict[str, Any]:
    torch.manual_seed(0)
    tower = Tower(width=16, depth=2)
    return {"model": tower, "batch": torch.randn(8, 16), "loss_fn": lambda m, x: m(x).square().mean()}


def _upcast() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, WIDTH, generator=gen).bfloat16().requires_grad_()
    weight = torch.randn(VOCAB, WIDTH, generator=gen).bfloat16().requires_grad_()
    target = torch.randint(0, VOCAB, (TOKENS,), generator=gen)

    def step() -> None:
        logits = (hidden * 1) @ weight.t()
        loss = F.cross_entropy(logits.float(), target)
        del logits
        loss.backward()

    return {"trace": measure(step).trace}


def _upcast_proof(d: Diagnosis, write: str | None) -> dict[str, Any]:
    raise AssertionError("staying in bfloat16 changes the results: the finding must carry no proof")


def _transformers_batch(vocab: int, tokens: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, tokens), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _hf_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def _llama() -> dict[str, Any]:
    model = _tiny("llama")
    batch = _transformers_batch(256, 256)
    return {"trace": measure(lambda: _hf_loss(model, batch).backward()).trace, "model": model}


def _gpt2() -> dict[str, Any]:
    torch.manual_seed(0)
    model = doctor_gpt2(layers=1)
    batch = _transformers_batch(16384, GPT2_TOKENS)
    return {"trace": measure(lambda: _hf_loss(model, batch).backward()).trace, "model": model}


def _transformers_proof(build: Callable[[], torch.nn.Module], vocab: int) -> ProofNames:
    def proof(d: Diagnosis, write: str | None) -> dict[str, Any]:
        # a fresh model of the same config (the program's own is changed by the apply code after)
        return {"model": build(), "batch": _transformers_batch(vocab, 8), "loss_fn": _hf_loss}

    return proof


PLANTED = (
    Planted("eager-attention", _attention, _attention_proof),
    Planted("broadcast-then-reduce", _broadcast, _broadcast_proof),
    Planted("logits-cross-entropy", _logits, _logits_proof),
    Planted("kept-output", _kept, _kept_proof),
    Planted("out-of-place-chain", _chain, _chain_proof),
    Planted("optimizer-state", _optimizer, _optimizer_proof),
    Planted("optimizer-step", _optimizer, _optimizer_proof),
    Planted("optimizer-step", _zeroed, _zeroed_proof, "zeroed"),
    Planted("cache-in-training", _caching, _caching_proof),
    Planted(
        "cache-in-training",
        _gpt2_cache,
        _transformers_proof(lambda: doctor_gpt2(vocab=256, width=128, layers=1), 256),
        "transformers",
    ),
    Planted("checkpoint-candidates", _tower, _tower_proof),
    Planted("upcast-copy", _upcast, _upcast_proof),
    Planted("eager-attention", _llama, _transformers_proof(lambda: _tiny("llama"), 256), "transformers"),
    Planted(
        "logits-cross-entropy",
        _gpt2,
        _transformers_proof(lambda: doctor_gpt2(layers=1), 16384),
        "transformers",
    ),
)


NOT_PLANTED_HERE = {
    # need a process group: the fsdp and ddp write code runs as printed on two gloo ranks
    # (tests/distributed_programs.py printed_call, asserted in tests/test_distributed_ranks.py); the
    # all-gather's checkpoint(fn, ...) wraps code the user writes (fn), applied there by hand
    "fsdp-reshard-after-forward": "tests/test_doctor_fsdp.py",
    "ddp-gradient-as-bucket-view": "tests/test_doctor_ddp.py",
    "all-gather-saved-for-backward": "tests/test_doctor_gather.py",
}


def test_every_rule_is_planted_here_or_says_where_it_is_run() -> None:
    assert {p.rule for p in PLANTED} | set(NOT_PLANTED_HERE) == set(DIAGNOSES)


@pytest.mark.parametrize(
    "planted", PLANTED, ids=[f"{p.rule}-{p.name}" if p.name else p.rule for p in PLANTED]
)
def test_each_hint_runs_as_printed_on_its_planted_program(planted: Planted) -> None:
    objects = planted.run()
    found = findings(objects.pop("trace"), planted.rule)
    assert found, planted.rule
    for d in found:
        write = write_code(d)
        if d.proof:
            names = planted.proof(d, write)
            run(d.proof, names, declared(d.proof))  # verify(...).assert_ok() raises on a failed verdict
        if write is not None and free_names(write) - set(MODULES) == {"model"}:
            # code that builds or changes something (the proofs ran the others' write code), on a copy
            live = {**objects, "model": copy.deepcopy(objects["model"])}
            made = run(f"made = {write}", live, free_names(write) - set(MODULES), modules=True)["made"]
            if isinstance(made, torch.optim.Optimizer):
                _loss(live["model"]).backward()
                made.step()
        if d.code:  # last: it changes the program's own objects
            run(d.code, objects, [n for n, _ in d.binds])
        assert d.proof or d.keeps == "changes-training", d  # every fix that keeps results says how
        if planted.name == "transformers":  # apply code on the model, proved with verify_fix
            assert d.code and d.proof and "verify_fix(model, fix, batch" in d.proof, d


def test_a_broken_hint_fails_here() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 8, generator=gen), torch.randn(3, 8, 5, generator=gen)
    objects = {"original": head_results_broadcast, "inputs": (x, y)}
    # a name the proof does not declare is not bound: it raises instead of passing by accident
    undeclared = "# with original, inputs: the code\nfrom memtrim.verify import verify\n"
    undeclared += "verify(original, rewrite, inputs)"
    with pytest.raises(NameError):
        run(undeclared, {**objects, "rewrite": head_results_broadcast}, declared(undeclared))
    with pytest.raises(NameError):  # a proof that uses a module it does not import
        run("# with x: a tensor\ntorch.equal(x, x)", {"x": x}, ["x"])
    with pytest.raises(AssertionError, match="does not say what it needs"):
        declared("from memtrim.verify import verify\nverify(original, rewrite, inputs)")
    # a rewrite that is not the original's result fails the printed proof's verdict
    proof = PROOF["reference"]
    wrong = {**objects, "rewrite": lambda z, w: head_results_broadcast(z, w) * 1.01}
    with pytest.raises(AssertionError):
        run(proof, wrong, declared(proof))
    # a placeholder inside a printed call, and a name the text never says, fail the write check
    base = Diagnosis("logits-cross-entropy", None, "", "", (), 0, 0)
    placeholder = (
        "loss = memtrim.fixes.chunked_linear_cross_entropy(hidden, the [4096, 64] weight, target), hidden h"
    )
    with pytest.raises(SyntaxError):
        write_code(dataclasses.replace(base, fix=placeholder))
    unsaid = "loss = memtrim.fixes.chunked_linear_cross_entropy(hidden, weight, target), hidden h, target t"
    with pytest.raises(AssertionError, match="'weight' is not said"):
        write_code(dataclasses.replace(base, fix=unsaid))
