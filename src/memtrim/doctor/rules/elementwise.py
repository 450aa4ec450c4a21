"""Elementwise waste: a broadcast product that a reduction shrinks (``broadcast-then-reduce``), and
chains of out-of-place results that could be one buffer updated in place (``out-of-place-chain``)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from memtrim.analysis.whatif import Edits
from memtrim.doctor.diagnosis import DIAGNOSES, Diagnosis, finding
from memtrim.doctor.rules.common import (
    attribute_path,
    base_name,
    called_object,
    dims,
    is_float,
    is_view_like,
    lines_text,
    numel,
    where,
    writes_in_place,
)
from memtrim.trace.model import Allocation, Phase, Site

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis

BROADCAST_FACTOR = 4
"""A product at least this many times larger than each operand's storage is a real broadcast, and a
reduction at least this many times smaller than it shrinks it."""
_REDUCTIONS = {"sum": "sum", "mean": "mean"}


# -- broadcast-then-reduce ---------------------------------------------------------------------------
def _embeddings(small: Sequence[int], large: Sequence[int]) -> list[tuple[int, ...]]:
    """Every order-preserving placement of ``small``'s dims among ``large``'s with equal sizes (stops
    counting at two: only a unique placement is used)."""
    found: list[tuple[int, ...]] = []

    def place(i: int, start: int, chosen: tuple[int, ...]) -> None:
        if len(found) > 1:
            return
        if i == len(small):
            found.append(chosen)
            return
        for j in range(start, len(large) - (len(small) - i) + 1):
            if large[j] == small[i]:
                place(i + 1, j + 1, (*chosen, j))

    place(0, 0, ())
    return found


def einsum_equation(
    operands: Sequence[Sequence[int]], product: Sequence[int], reduced: Sequence[int]
) -> tuple[str, tuple[int, ...]] | None:
    """The einsum equation that computes ``reduced`` from ``operands`` without the broadcast
    ``product``, and the product's dims it sums over, from the recorded shapes; None unless every
    operand fits the product in exactly one way and the reduction removes dims in exactly one way.

    >>> einsum_equation([(64, 12, 64), (12, 64, 768)], (64, 12, 64, 768), (64, 12, 768))
    ('abc,bcd->abd', (2,))
    """
    if 1 in product or any(1 in shape for shape in operands) or len(product) > 26:
        return None
    placements = []
    for shape in operands:
        options = _embeddings(shape, product)
        if len(options) != 1:
            return None
        placements.append(options[0])
    if set(range(len(product))) != {d for p in placements for d in p}:
        return None
    kept = _embeddings(reduced, product)
    if len(kept) != 1 or len(reduced) >= len(product):
        return None
    letters = "abcdefghijklmnopqrstuvwxyz"
    inputs = ",".join("".join(letters[d] for d in p) for p in placements)
    output = "".join(letters[d] for d in kept[0])
    summed = tuple(d for d in range(len(product)) if d not in kept[0])
    return f"{inputs}->{output}", summed


def _broadcast_products(analysis: Analysis) -> dict[Site | None, list[tuple[Allocation, Allocation, int]]]:
    """(product, reduced result, reduction op) by line, for every product the trace shows reduced."""
    flow, allocations = analysis.flow, analysis.allocations
    found: dict[Site | None, list[tuple[Allocation, Allocation, int]]] = {}
    muls = [seq for seq, name in enumerate(flow.names) if name == "mul"]  # a few of a long trace's ops
    for seq in muls:
        row, made = flow.ops[seq], flow.outputs[seq]
        if len(made) != 1 or len(row.inputs) < 2:
            continue
        product = allocations[made[0]]
        if product.saved or not is_float(product):
            continue
        size = numel(product)
        if any(numel(allocations[i]) * BROADCAST_FACTOR > size for i in row.inputs):
            continue  # not a broadcast: (x.exp() * 2), x * y of one shape
        consumers = [r for r in flow.readers[product.id] if not is_view_like(flow.ops[r], flow.outputs[r])]
        if len(consumers) != 1 or flow.names[consumers[0]] not in _REDUCTIONS:
            continue
        outs = flow.outputs[consumers[0]]
        if len(outs) != 1 or numel(allocations[outs[0]]) * BROADCAST_FACTOR > size:
            continue
        found.setdefault(product.site, []).append((product, allocations[outs[0]], consumers[0]))
    return found


@DIAGNOSES.register("broadcast-then-reduce")
def broadcast_then_reduce(analysis: Analysis) -> list[Diagnosis]:
    """A broadcast multiply (output larger than each operand) whose only reader is a sum or mean that
    shrinks it: ``(z[..., None] * W).sum(-2)``, in any phase (``no_grad`` code and backward's products
    of the same line included) -> ``torch.einsum`` with the equation from the recorded shapes."""
    flow, allocations = analysis.flow, analysis.allocations
    results = []
    for site, found in _broadcast_products(analysis).items():
        first = next((f for f in found if f[0].phase is not Phase.BACKWARD), found[0])
        product, reduced, reduction = first
        operands = [allocations[i] for i in flow.inputs_of(product)]
        reduce_op = flow.names[reduction]
        eq = einsum_equation([o.shape for o in operands], product.shape, reduced.shape)
        names = ", ".join("xyzuvw"[i] if i < 6 else f"t{i}" for i in range(len(operands)))
        shapes = ", ".join(f"{n} {dims(o.shape)}" for n, o in zip(names.split(", "), operands, strict=True))
        if eq is not None:
            equation, summed = eq
            scale = ""
            if reduce_op == "mean":
                count = 1
                for d in summed:
                    count *= product.shape[d]
                scale = f".div_({count})"
            fix = f"torch.einsum('{equation}', {names}){scale} for {shapes}"
        else:
            fix = f"a contraction over the reduced dims: torch.einsum or matmul of {shapes}"
        blamed = tuple(p for p, _, _ in found)
        diagnosis = finding(
            analysis,
            rule="broadcast-then-reduce",
            site=site,
            problem=(
                f"{dims(product.shape)} {product.dtype} broadcast product, then {reduce_op} to "
                f"{dims(reduced.shape)}: {numel(product) // max(1, numel(reduced))}x larger than its result"
            ),
            fix=fix,
            allocations=blamed,
            edits=Edits.removing(p.id for p in blamed),
            safe_because=(
                f"{product.op} at {where(site)} makes a product {BROADCAST_FACTOR}x or more larger than "
                "each operand",
                f"its only reader is {reduce_op} (views aside), which is {BROADCAST_FACTOR}x or more smaller",
                "autograd saved no product: the contraction keeps only operands and result",
                "the contraction sums in another order: prove it with "
                "memtrim.verify.verify(..., mode='reference')",
            ),
            keeps="reference",
            module=product.module,
        )
        if diagnosis is not None:
            results.append(diagnosis)
    return results


# -- out-of-place-chain ------------------------------------------------------------------------------
_UNARY = frozenset(
    {
        *("neg", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt"),
        *("reciprocal", "sigmoid", "tanh", "relu", "abs", "sin", "cos", "erf", "square"),
        *("clamp", "clamp_min", "clamp_max", "pow", "sign", "floor", "ceil", "round", "trunc"),
    }
)
_COMMUTATIVE = frozenset({"add", "mul"})
_ORDERED = frozenset({"sub", "div"})
_ELEMENTWISE = _UNARY | _COMMUTATIVE | _ORDERED


def _link_op(name: str, inputs: tuple[int, ...], source: int) -> bool:
    """Could the op write its result into ``source`` instead (``source.<op>_(...)``), bit for bit?"""
    if name in _UNARY:
        return inputs[:1] == (source,)
    if name in _COMMUTATIVE:
        return source in inputs  # IEEE + and * commute: s * a == a.mul_(s)
    if name in _ORDERED:
        return inputs[:1] == (source,)  # a - s == a.sub_(s); s - a has no in-place form on a
    return False


def _line_in(site: Site | None, home: Site | None) -> str:
    """``line 20`` in ``home``'s file, else ``other.py:20``."""
    if site is not None and home is not None and site.file == home.file:
        return f"line {site.line}"
    return where(site)


def _custom_backward(a: Allocation) -> bool:
    """Made by the user's own ``autograd.Function.backward`` (its node is named after the Function,
    ``ScaledDifferenceBackward``; built-in nodes end in a number, ``MulBackward0``), at its own line."""
    return a.node is not None and not a.node[-1:].isdigit() and a.call_site is None


def _scalar_operand(name: str, inputs: tuple[int, ...]) -> bool:
    """A binary op handed one tensor: its other operand is a Python number."""
    return name in (_COMMUTATIVE | _ORDERED) and len(inputs) == 1


_NO_ARGUMENTS = frozenset(
    {
        *("neg", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt"),
        *("reciprocal", "sigmoid", "tanh", "relu", "abs", "sin", "cos", "erf", "sign"),
        *("floor", "ceil", "trunc"),
    }
)
"""Unary chain ops whose in-place form takes nothing but the tensor (``t.relu_()``); ``clamp``, ``pow``
and ``round(decimals=)`` take numbers the trace does not hold."""
_VERBS = {"add": "adds to it", "sub": "subtracts from it", "mul": "multiplies it by", "div": "divides it by"}
_OPERANDS = ("u", "v", "w")
_NUMBER_NAMES = ("c", "k", "m")


def _source_line(analysis: Analysis, site: Site | None) -> str | None:
    """The line's text as the trace recorded it (``b = s * a``), or None."""
    table = analysis.log.metadata.get("source_lines")
    lines = table.get(site.file) if site is not None and isinstance(table, dict) else None
    text = lines.get(str(site.line)) if site is not None and isinstance(lines, dict) else None
    return text if isinstance(text, str) and text else None


_LITERAL = re.compile(r"(?<![\w.])(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?![\w.])")


def _spelled(value: float, text: str | None) -> bool:
    """The line spells ``value`` as a literal (``* 3.0``, ``/ 2``, ``+ 1e-8``): the in-place call may too;
    a number held in a name (``/ temperature``) is named in the call instead."""
    return text is not None and any(float(token) == value for token in _LITERAL.findall(text))


def in_place_code(
    analysis: Analysis, chain: Sequence[Allocation], home: Site | None
) -> tuple[str, tuple[str, ...]] | None:
    """The in-place steps of ``chain`` (its first result ``t``, then each op as ``t.<op>_(...)``) as code
    that runs as printed, and what each other name in it is; None where an operand is not in the trace (a
    number ``clamp`` or ``pow`` takes, an ``alpha``, ``t * t``) or the names run out."""
    flow, scalars = analysis.flow, analysis.log.scalars
    calls: list[str] = []
    named: list[str] = []
    tensors, numbers_left = list(_OPERANDS), list(_NUMBER_NAMES)
    quoted: set[Site | None] = set()  # lines whose text is shown already
    for before, made in itertools.pairwise(chain):
        seq = flow.producer[made.id]
        row, name = flow.ops[seq], flow.names[seq]
        numbers = dict(scalars.get(seq, ()))
        overload = row.op.rsplit(".", 1)[-1]
        line = _line_in(row.site, home)
        text = _source_line(analysis, row.site)
        shown = f" ({text})" if text and row.site not in quoted else ""
        quoted.add(row.site)
        if name in _NO_ARGUMENTS and row.inputs == (before.id,) and not numbers:
            calls.append(f"t.{name}_()")
            continue
        if name not in _VERBS or overload not in ("Tensor", "Scalar") or set(numbers) - {"other"}:
            return None  # div(rounding_mode=...), an alpha, or a number of another name
        others = [i for i in row.inputs if i != before.id]
        if "other" in numbers and not others:  # t * 3.0
            value: float | int = numbers["other"]
            if not is_float(before) and float(value).is_integer():
                value = int(value)  # the recorder keeps floats: an integer tensor takes an int in place
            if _spelled(float(value), text):
                calls.append(f"t.{name}_({value!r})")
                continue
            if not numbers_left:
                return None
            number = numbers_left.pop(0)
            calls.append(f"t.{name}_({number})")
            named.append(f"{number} the number {line} {_VERBS[name]} ({value!r} in this run){shown}")
            continue
        if len(others) != 1 or "other" in numbers or not tensors:
            return None  # t * t, or an operand the trace does not hold
        operand = tensors.pop(0)
        other = analysis.allocations[others[0]]
        calls.append(f"t.{name}_({operand})")
        named.append(f"{operand} the {dims(other.shape)} {other.dtype} tensor {line} {_VERBS[name]}{shown}")
    return "; ".join(calls), tuple(named)


_INPLACE_MODULE_OPS = frozenset(
    {
        "relu",
        "relu6",
        "leaky_relu",
        "elu",
        "celu",
        "selu",
        "hardtanh",
        "silu",
        "hardswish",
        "mish",
        "threshold",
    }
)
"""Ops of the activation modules that take ``inplace=`` (``nn.ReLU``, ``nn.SiLU``, ...), each the whole
forward of such a module."""


def type_hint(names: Sequence[str]) -> str:
    """``ReLU``: the module class an activation op's module usually is."""
    classes = {"relu": "ReLU", "relu6": "ReLU6", "leaky_relu": "LeakyReLU", "elu": "ELU",
               "celu": "CELU", "selu": "SELU", "hardtanh": "Hardtanh", "silu": "SiLU",
               "hardswish": "Hardswish", "mish": "Mish", "threshold": "Threshold"}  # fmt: skip
    return "/".join(dict.fromkeys(classes[n] for n in names if n in classes)) or "ReLU"


def _inplace_modules(analysis: Analysis, steps: list[int]) -> list[str] | None:
    """``named_modules()`` names of the modules whose forward is exactly the chain ops ``steps`` (op
    numbers), each an activation module's op (a module reused elsewhere, for a tensor that must be kept,
    is not: all of its forward ops must be steps); None where the chain is not only such modules."""
    flow = analysis.flow
    modules: dict[str, None] = {}
    for seq in steps:
        row = flow.ops[seq]
        if flow.names[seq] not in _INPLACE_MODULE_OPS or not row.module or attribute_path(row.module) is None:
            return None
        modules[row.module] = None
    chosen = set(steps)
    for seq, row in enumerate(flow.ops):
        if row.phase is Phase.FORWARD and row.module in modules and seq not in chosen:
            return None
    return [attribute_path(m) or "" for m in modules]


@DIAGNOSES.register("out-of-place-chain")
def out_of_place_chain(analysis: Analysis) -> list[Diagnosis]:
    """Consecutive same-shape elementwise results, each the only thing its input is used for from then
    on, none saved for backward, none from before the region (a leaf or an input), none read later
    through a view — in a custom ``backward`` or in ordinary code -> one buffer updated in place, the
    same ops in the same order (bit for bit). Optimizer internals are left to ``optimizer-step``."""
    flow, allocations = analysis.flow, analysis.allocations
    ops = flow.ops
    following: dict[int, int] = {}  # allocation id -> the next result of its chain
    taken: set[int] = set()  # results already the next of an earlier buffer (a * b of two chain ends)
    for a in allocations:
        if a.preexisting or a.saved or a.facts or a.free_tick is None or a.phase is Phase.OPTIMIZER:
            continue
        if a.phase is Phase.BACKWARD and not _custom_backward(a):
            continue  # made by autograd for a built-in node: torch's code, not the user's
        last = flow.last_read(a)
        if last is None or ops[last].phase is not a.phase:
            continue
        row = ops[last]
        name = flow.names[last]
        made = flow.outputs[last]
        if name not in _ELEMENTWISE or writes_in_place(row.op) or len(made) != 1 or made[0] in taken:
            continue
        result = allocations[made[0]]
        if result.shape != a.shape or result.dtype != a.dtype or not _link_op(name, row.inputs, a.id):
            continue
        if a.phase is Phase.BACKWARD and (not _custom_backward(result) or result.node != a.node):
            continue  # one custom backward's own buffers only
        following[a.id] = result.id
        taken.add(result.id)
    heads = set(following) - set(following.values())
    for head in list(heads):
        made_by = flow.made_by(allocations[head])
        if allocations[head].phase is Phase.FORWARD and (made_by is None or not made_by.inputs):
            # a factory's result under grad mode may be a leaf that requires grad: start at the next
            heads.discard(head)
            heads.add(following.pop(head))
    by_lines: dict[tuple[Site | None, ...], list[list[int]]] = {}
    for head in sorted(heads):
        chain = [head]
        while chain[-1] in following:
            chain.append(following[chain[-1]])
        by_lines.setdefault(tuple(allocations[i].site for i in chain), []).append(chain)

    results = []
    for lines, chains in by_lines.items():
        removed: list[Allocation] = []
        free_at: dict[int, float | None] = {}
        for chain in chains:
            first, last_result = allocations[chain[0]], allocations[chain[-1]]
            removed += [allocations[i] for i in chain[1:]]
            ends = (first.free_tick, last_result.free_tick)
            free_at[first.id] = None if None in ends else max(t for t in ends if t is not None)
        example = chains[0]
        first = allocations[example[0]]
        steps = [ops[flow.producer[i]] for i in example[1:]]
        names = [base_name(r.op) for r in steps]
        rewrite = ", ".join(
            f"{_line_in(r.site, first.site)} t.{n}_(...)" for r, n in zip(steps, names, strict=True)
        )
        scalars = [_scalar_operand(n, r.inputs) for r, n in zip(steps, names, strict=True)]
        note = None
        if any(a and b for a, b in itertools.pairwise(scalars)):
            note = (
                "keep consecutive scalar steps as separate in-place ops: folding two into one "
                "(t.mul_(a / b) for t * a / b) changes bf16 and fp16 rounding"
            )
        where_text = f" in {first.node}.backward" if first.phase is Phase.BACKWARD and first.node else ""
        fix = f"t = the {base_name(first.op)} at {where(first.site)}, then in place, in the same order: "
        fix += rewrite
        runnable = in_place_code(analysis, [allocations[i] for i in example], first.site)
        if runnable is not None:
            # the same steps as code: t stays the first op's result, each later line becomes its call
            end = allocations[example[-1]]
            fix = (
                f"{runnable[0]}, t the result of the {base_name(first.op)} at {where(first.site)} (that line "
                f"as it is; t is then the result of the {base_name(end.op)} at "
                f"{_line_in(end.site, first.site)})" + "".join(f", {clause}" for clause in runnable[1])
            )
        code: str | None = None
        binds: tuple[tuple[str, str], ...] = ()
        in_modules = _inplace_modules(analysis, [flow.producer[i] for chain in chains for i in chain[1:]])
        if in_modules:
            lead = next(r.module for r in steps if r.module)
            fix = (
                f"set inplace=True on the {len(in_modules)} activation modules that make them "
                f"({', '.join(in_modules[:3])}{', ...' if len(in_modules) > 3 else ''}): "
                f"nn.{type_hint(names)}(inplace=True) where the model is built"
            )
            code = (
                f"for name in {in_modules!r}:\n"
                "    module = model.get_submodule(name)\n"
                "    assert hasattr(module, 'inplace'), f'{name} takes no inplace='\n"
                "    module.inplace = True"
            )
            binds = (("model", called_object(analysis, lead)),)
        diagnosis = finding(
            analysis,
            rule="out-of-place-chain",
            site=first.site,
            problem=(
                f"{len(example)} {dims(first.shape)} {first.dtype} results made one from another"
                f"{where_text} (lines {lines_text(lines)}), each input unused afterwards"
            ),
            fix=fix,
            code=code,
            binds=binds,
            allocations=tuple(removed),
            edits=Edits(remove=frozenset(a.id for a in removed), free_at=free_at),
            safe_because=(
                "each result's last reader is the next op of the chain, which is elementwise and keeps "
                "its shape and dtype",
                "no result before the last is saved for backward, from before the region, or read later "
                "(through a view either)",
                "the in-place ops are the same ops on the same operands in the same order (IEEE + and * "
                "commute): bit for bit equal, prove it with memtrim.verify.verify(..., mode='exact')",
            ),
            keeps="exact",
            module=first.module,
            sites=lines,
            note=note,
        )
        if diagnosis is not None:
            results.append(diagnosis)
    return results
