"""The elementwise ops a model runs between its lm_head and the loss, restated as the chunked loss's
arguments: ``softcap * tanh(logit_scale * z / softcap)`` (``memtrim.fixes.chunked_linear_cross_entropy``'s
``logit_scale=`` and ``softcap=``), an optional bias added to the matmul's output, and scalar scales of
the hidden states before the matmul (T5's ``hidden * d_model**-0.5``: a scale of the logits).

Only what that form reproduces is recognised, so that a printed fix never changes the loss: multiplying
or dividing by a Python number (the recorder keeps their values, ``TraceLog.scalars``), negation, one
``tanh``, a scalar added to every logit where no ``tanh`` follows (the softmax does not change), a
``[vocab]`` bias added right after a matmul that has none, and dtype copies (the chunked loss computes
the chain in fp32 for fp16/bf16 inputs, as an upcast before it does). Any other op (a second tensor of
the logits' shape, ``sin``, a scalar the trace does not hold) ends the walk: the logits then come from
that op, not from a matmul, and the rule is silent.

The scales are multiplied as exact fractions of the recorded floats (``/ 30`` then ``* 30`` is a
``logit_scale`` of exactly 1) and rounded once at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

from memtrim.doctor.rules.common import is_float, is_view_like, numel
from memtrim.trace.model import Allocation, Phase

if TYPE_CHECKING:
    from memtrim.analysis.flow import Flow

COPIES = frozenset({"_to_copy", "clone", "contiguous", "to", "_unsafe_view"})
STEPS = frozenset({"mul", "div", "add", "sub", "rsub", "neg", "tanh"})
"""Elementwise ops the walk passes through (what each does is checked when the chain is folded)."""
Scalars = dict[int, tuple[tuple[str, float], ...]]


@dataclass(frozen=True)
class LogitChain:
    """What the ops between the matmul and the loss amount to, in the chunked loss's terms."""

    logit_scale: float = 1.0
    softcap: float | None = None
    bias: Allocation | None = None
    """A ``[vocab]`` tensor added to the matmul's output (the fix's ``bias=``)."""
    steps: tuple[str, ...] = ()
    """The ops in forward order, as code reads: ``/ 30.0``, ``tanh``, ``* 30.0``, ``float32 copy``."""
    hidden_steps: tuple[str, ...] = ()
    """The scales of the hidden states before the matmul, folded into ``logit_scale``."""
    shifted: bool = False
    """A number was added to every logit (left out: the softmax does not change)."""

    @property
    def arguments(self) -> str:
        """``, logit_scale=1.25, softcap=30.0``: the keyword arguments the fix passes (none for ``1``)."""
        text = f", logit_scale={self.logit_scale!r}" if self.logit_scale != 1.0 else ""
        return text + (f", softcap={self.softcap!r}" if self.softcap is not None else "")

    @property
    def arithmetic(self) -> tuple[str, ...]:
        """The steps that are not copies (``/ 30.0``, ``tanh``, ``* 30.0``)."""
        return tuple(s for s in self.steps if not s.endswith("copy"))


@dataclass(frozen=True)
class Slice:
    """``logits[:, :-1]`` copied before the loss (a plain-code label shift): one ``aten.slice`` of a
    dimension other than the vocabulary's, its numbers as the recorder kept them."""

    dim: int
    start: int
    end: int
    step: int
    full: tuple[int, ...]
    """The shape of the view that was sliced (the logits, ``[..., vocab]``)."""
    shape: tuple[int, ...]
    """The copy's shape: ``full`` with ``dim`` cut."""

    @property
    def index(self) -> str:
        """``[:, :-1]``: the same slice as Python indexing, for any tensor with the same leading dims."""
        start = "" if self.start == 0 else str(self.start)
        end = "" if self.end >= self.full[self.dim] else str(self.end)
        step = "" if self.step == 1 else f":{self.step}"
        return "[" + ", ".join([":"] * self.dim + [f"{start}:{end}{step}"]) + "]"


def _sliced(
    flow: Flow, allocations: Sequence[Allocation], scalars: Scalars, seq: int, made: Allocation
) -> tuple[Allocation, Slice] | None:
    """The buffer a copy op ``seq`` read through one ``slice`` of a non-last dimension, and the slice;
    None unless the recorded numbers reproduce the copy's shape exactly (the view the copy read is not
    in the trace: only a slice whose arithmetic lands on that shape is taken for it)."""
    sources = [allocations[i] for i in flow.ops[seq].inputs]
    if len(sources) != 1 or numel(sources[0]) <= numel(made) or len(made.shape) < 2:
        return None
    source = sources[0]
    slices = [r for r in flow.readers[source.id] if r < seq and flow.names[r] == "slice"]
    if len(slices) != 1 or not only_feeds(flow, source, {seq, *slices}):
        return None
    numbers = dict(scalars.get(slices[0], ()))
    dim = int(numbers.get("dim", 0))
    start, end, step = numbers.get("start", 0.0), numbers.get("end"), numbers.get("step", 1.0)
    if end is None or not 0 <= dim < len(made.shape) - 1 or step < 1 or made.shape[dim] == 0:
        return None
    rest = numel(made) // made.shape[dim]
    if numel(source) % rest:
        return None
    full = (*made.shape[:dim], numel(source) // rest, *made.shape[dim + 1 :])
    taken = range(full[dim])[slice(int(start), int(min(end, full[dim])), int(step))]
    if len(taken) != made.shape[dim]:
        return None
    # as the program spelled it where that is as short (``:-1``), else the bounds it resolved to
    stop = int(end) if -full[dim] <= end < 0 else taken.stop
    return source, Slice(dim, taken.start, stop, int(step), full, made.shape)


def walk_back(
    flow: Flow, allocations: Sequence[Allocation], x: Allocation, scalars: Scalars | None = None
) -> tuple[list[Allocation], list[int], Slice | None]:
    """``x``, then what it was made from through copies and :data:`STEPS` of the same element count,
    back to the first buffer that none of them made; those ops' numbers (latest first); and, with the
    trace's ``scalars``, one copy of a slice of the logits on the way (:class:`Slice`)."""
    chain: list[Allocation] = [x]
    seqs: list[int] = []
    cut: Slice | None = None
    while True:
        seq = flow.producer[chain[-1].id]
        if seq < 0 or flow.names[seq] not in COPIES | STEPS:
            return chain, seqs, cut
        size = numel(chain[-1])
        sources = [allocations[i] for i in flow.ops[seq].inputs if numel(allocations[i]) == size]
        if not sources and cut is None and scalars is not None and flow.names[seq] in COPIES:
            found = _sliced(flow, allocations, scalars, seq, chain[-1])
            if found is not None:
                sources, cut = [found[0]], found[1]
        if len(sources) != 1 or sources[0].preexisting or not is_float(sources[0]):
            return chain, seqs, cut
        chain.append(sources[0])
        seqs.append(seq)


def _number(scalars: Scalars, seq: int, inputs: int, allowed: frozenset[str]) -> dict[str, float] | None:
    """The recorded Python numbers of a one-tensor arithmetic op (``other`` at least), or None when the
    op had another tensor operand or a number the trace does not hold."""
    numbers = dict(scalars.get(seq, ()))
    if inputs != 1 or "other" not in numbers or not set(numbers) <= allowed:
        return None
    return numbers


_PLAIN = frozenset({"other"})
_WITH_ALPHA = frozenset({"other", "alpha"})


def fold(
    flow: Flow,
    allocations: Sequence[Allocation],
    scalars: Scalars,
    chain: list[Allocation],
    seqs: list[int],
    matmul_has_bias: bool,
    pre: Fraction = Fraction(1),
    hidden_steps: Sequence[str] = (),
) -> LogitChain | None:
    """The :class:`LogitChain` of the ops ``seqs`` (as :func:`walk_back` found them: latest first, the
    logits ``chain[-1]`` made by a matmul), or None when one of them is not of the reproducible form.
    ``pre``: the scale of the hidden states before the matmul (:func:`hidden_scales`), their steps
    ``hidden_steps``."""
    before = pre  # the scale inside the tanh (all of it without one)
    after = Fraction(1)  # the scale of the tanh's output
    tanh = shifted = False
    bias: Allocation | None = None
    steps: list[str] = []
    members = {a.id for a in chain}
    for k, seq in enumerate(reversed(seqs)):
        name, row = flow.names[seq], flow.ops[seq]
        made = chain[len(seqs) - 1 - k]  # what this op made
        if name in COPIES:
            steps.append(f"{made.dtype} copy" if made.dtype != chain[len(seqs) - k].dtype else "copy")
            continue
        factor = Fraction(1)
        if name == "tanh":
            if tanh or shifted:
                return None  # two tanhs, or a shift inside one: not softcap * tanh(scale * z / softcap)
            tanh = True
            steps.append("tanh")
            continue
        if name == "neg":
            factor, text = Fraction(-1), "-"
        elif name in ("mul", "div"):
            numbers = _number(scalars, seq, len(row.inputs), _PLAIN)
            if numbers is None or numbers["other"] == 0:
                return None
            value = Fraction(numbers["other"])
            factor, text = (
                (value, f"* {numbers['other']!r}")
                if name == "mul"
                else (1 / value, f"/ {numbers['other']!r}")
            )
        elif name in ("add", "sub") and len(row.inputs) == 2:
            others = [allocations[i] for i in row.inputs if i not in members]
            if (
                name != "add"
                or k != 0  # right after the matmul: a bias a later scale would scale is not the fix's
                or matmul_has_bias
                or scalars.get(seq)  # alpha
                or len(others) != 1
                or others[0].shape != (made.shape[-1],)
                or others[0].dtype != made.dtype
            ):
                return None
            bias = others[0]
            steps.append("+ bias")
            continue
        elif name in ("add", "sub", "rsub"):
            numbers = _number(scalars, seq, len(row.inputs), _WITH_ALPHA)
            if numbers is None:
                return None
            shifted = True  # the same number added to every logit: the softmax is unchanged
            if name == "rsub":  # other - alpha * z
                factor, text = -Fraction(numbers.get("alpha", 1.0)), f"{numbers['other']!r} -"
            else:
                sign = "+" if name == "add" else "-"
                factor, text = Fraction(1), f"{sign} {numbers['other']!r}"
                if numbers.get("alpha", 1.0) != 1.0:
                    return None  # add(z, c, alpha=a) is z + a * c: still a shift, but rare enough to skip
        else:
            return None
        if factor == 0:
            return None
        steps.append(text)
        if tanh:
            after *= factor
        else:
            before *= factor
    if tanh:
        # after * tanh(before * z) == |after| * tanh(sign(after) * before * z): softcap |after|, and
        # logit_scale / softcap == sign(after) * before
        cap = float(abs(after))
        return LogitChain(float(before * after), cap, bias, tuple(steps), tuple(hidden_steps), shifted)
    return LogitChain(float(before), None, bias, tuple(steps), tuple(hidden_steps), shifted)


def hidden_scales(
    flow: Flow, allocations: Sequence[Allocation], scalars: Scalars, hidden: Allocation, matmul: int
) -> tuple[Allocation, list[Allocation], Fraction, list[str]]:
    """The hidden states before scalar scales that only feed the matmul (T5's ``decoded *
    d_model**-0.5``): the unscaled tensor, the scaled copies between (latest first), their product and
    their steps in forward order. Stops at anything else (then the matmul's own operand is ``hidden``)."""
    scaled: list[Allocation] = []
    scale = Fraction(1)
    steps: list[str] = []
    reader = matmul
    while True:
        seq = flow.producer[hidden.id]
        if seq < 0 or flow.names[seq] not in ("mul", "div") or not only_feeds(flow, hidden, {reader}):
            break
        numbers = _number(scalars, seq, len(flow.ops[seq].inputs), _PLAIN)
        source = allocations[flow.ops[seq].inputs[0]]
        if numbers is None or numbers["other"] == 0 or numel(source) != numel(hidden) or not is_float(source):
            break
        value = Fraction(numbers["other"])
        scale *= value if flow.names[seq] == "mul" else 1 / value
        sign = "*" if flow.names[seq] == "mul" else "/"
        steps.insert(0, f"{sign} {numbers['other']!r}")
        scaled.append(hidden)
        hidden, reader = source, seq
    return hidden, scaled, scale, steps


def only_feeds(flow: Flow, a: Allocation, allowed: set[int]) -> bool:
    """Nothing but the ops ``allowed`` (and views) read ``a`` outside backward. In backward it may be
    read by anything: a buffer is read there because a forward op that was handed it saved it, and
    those are the allowed ones (the tanh's output, read by its ``tanh_backward``)."""
    ops = flow.ops
    return all(
        seq in allowed or ops[seq].phase is Phase.BACKWARD or is_view_like(ops[seq], flow.outputs[seq])
        for seq in flow.readers[a.id]
    )
