"""Activation checkpointing: repeated blocks (``transformer.h.0``, ``transformer.h.1``, ...) whose
saved activations fill the peak (``checkpoint-candidates``).

The what-if checkpoints every block of the group: what each block saved for backward and only it reads
is freed after its last forward read; when backward reaches the block, its forward runs again (one
block's recompute transient: the most its own allocations held at once in forward) and the saved
activations come back, to be freed as backward consumed them before.

Side effects decide what the recompute keeps. A block that writes a buffer in place in its forward
(BatchNorm in training mode counts ``num_batches_tracked`` and moves its running statistics) would do it
twice under plain ``torch.utils.checkpoint``; ``memtrim.fixes.checkpoint_modules`` copies those buffers
before each recompute and writes them back after, so the finding names it alone and the what-if adds the
copies. Dropout's random numbers are replayed by checkpoint's RNG state (``preserve_rng_state``).
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memtrim.analysis.flow import writes_in_place
from memtrim.analysis.roles import Role
from memtrim.analysis.whatif import Added, Edits
from memtrim.doctor.diagnosis import DIAGNOSES, Diagnosis, finding
from memtrim.doctor.rules.common import attribute_path, called_object, numel
from memtrim.trace.model import Allocation, Phase, Site
from memtrim.units import format_bytes

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis
    from memtrim.analysis.flow import Flow

DOMINATES = 0.25
"""A group is a candidate when the activations its blocks alone saved are this share of the peak."""
_INDEXED = re.compile(r"^(?P<container>.+)\.(?P<index>\d+)$")


@dataclass
class _Block:
    """One module instance (``transformer.h.3``) and what its forward runs made."""

    path: str
    runs: list[tuple[int, int]] = field(default_factory=list)
    """(first op, last op) of each stretch of forward ops inside it."""
    backward: list[int] = field(default_factory=list)
    """The backward ops run for its nodes, ascending."""


def _instance(module: str) -> tuple[str, str] | None:
    """(container path, instance path) of the innermost indexed module on ``module``'s path."""
    parts = module.split(".")
    for end in range(len(parts), 1, -1):
        if parts[end - 1].isdigit():
            instance = ".".join(parts[:end])
            match = _INDEXED.match(instance)
            if match:
                return match["container"], instance
    return None


def _levels(module: str) -> list[tuple[str, str]]:
    """(container, instance) of every indexed module on ``module``'s path, innermost first."""
    levels = []
    found = _instance(module)
    while found is not None:
        levels.append(found)
        found = _instance(found[0])
    return levels


class _Blocks:
    """Which indexed module on a path is the block to checkpoint: the outermost one that is a repeated
    block (one with modules inside it, and a sibling in its container with the same modules inside),
    else the outermost indexed one. ``nn.Sequential(encoder, head)`` runs its encoder's layers as
    ``0.layers.0``, ``0.layers.1``: the blocks are those layers, not the encoder, which the head does
    not repeat."""

    def __init__(self, paths: set[str]) -> None:
        inside: dict[str, set[str]] = {}
        for path in paths:
            for _, instance in _levels(path):
                found = inside.setdefault(instance, set())
                if path != instance:
                    found.add(path[len(instance) + 1 :])
        self._repeated: set[str] = set()
        by_container: dict[tuple[str, frozenset[str]], list[str]] = {}
        for instance, modules in inside.items():
            found_instance = _instance(instance)
            if modules and found_instance is not None:
                by_container.setdefault((found_instance[0], frozenset(modules)), []).append(instance)
        for siblings in by_container.values():
            if len(siblings) > 1:
                self._repeated.update(siblings)
        self._known: dict[str, tuple[str, str] | None] = {}

    def of(self, module: str | None) -> tuple[str, str] | None:
        """(container, block) for an op that ran in ``module``."""
        if module is None:
            return None
        if module in self._known:
            return self._known[module]
        levels = _levels(module)
        repeated = [level for level in levels if level[1] in self._repeated]
        found = repeated[-1] if repeated else (levels[-1] if levels else None)
        self._known[module] = found
        return found


def _groups(flow: Flow) -> dict[str, dict[str, _Block]]:
    """Indexed blocks by container, with their forward runs and the backward ops run for them (a
    backward op carries the module of the forward op that made its node), from the module paths."""
    groups: dict[str, dict[str, _Block]] = {}
    blocks = _Blocks({row.module for row in flow.ops if row.module})
    current: _Block | None = None
    # runs of consecutive ops of one module and phase, taken whole (a long trace has far fewer runs
    # than ops): (module, phase) -> its first and last op number
    first = 0
    for (module, phase), run in itertools.groupby((row.module, row.phase) for row in flow.ops):
        last = first + sum(1 for _ in run) - 1
        start, first = first, last + 1
        found = blocks.of(module) if phase in (Phase.FORWARD, Phase.BACKWARD) else None
        if found is None:
            current = None
            continue
        container, instance = found
        members = groups.get(container)
        if members is None:
            members = groups[container] = {}
        block = members.get(instance)
        if block is None:
            block = members[instance] = _Block(instance)
        if phase is Phase.BACKWARD:
            block.backward.extend(range(start, last + 1))
            current = None
            continue
        if current is block:
            block.runs[-1] = (block.runs[-1][0], last)
        else:
            block.runs.append((start, last))
            current = block
    return groups


_FLOP_OPS = frozenset({"convolution", "mm", "addmm", "bmm", "baddbmm"})
"""The ops ``_matmul_flops`` counts: ``matmul_flops`` asks it about these alone (a block's run is
mostly other ops)."""


def _matmul_flops(flow: Flow, allocations: list[Allocation], seq: int) -> int:
    """FLOPs of a matmul-family op (torch.utils.flop_counter's formulas), from its recorded output
    shape and its operands' storage sizes: the contraction length is the smallest one the operands
    allow (a slice's storage is larger than the slice)."""
    row = flow.ops[seq]
    name = flow.names[seq]
    outs = flow.outputs[seq]
    if name == "convolution" and len(outs) == 1 and len(row.inputs) >= 2:
        return _convolution_flops(allocations[outs[0]].shape, allocations[row.inputs[1]].shape)
    if name not in ("mm", "addmm", "bmm", "baddbmm") or len(outs) != 1:
        return 0
    out = allocations[outs[0]].shape
    if len(out) not in (2, 3):
        return 0
    batch = out[0] if len(out) == 3 else 1
    m, n = out[-2], out[-1]
    operands = [allocations[i] for i in row.inputs if numel(allocations[i]) not in (n, m * n * batch)]
    lengths = []
    for a, rows in zip(operands[-2:], (batch * m, batch * n), strict=False):
        if rows and numel(a) % rows == 0:
            lengths.append(numel(a) // rows)
    if not lengths:
        return 0
    return _registry_flops(name, batch, m, n, min(lengths))


def matmul_flops(analysis: Analysis, seqs: Iterable[int]) -> int:
    """FLOPs of the matmuls and convolutions among ops ``seqs`` (what running them again costs)."""
    flow, allocations, names = analysis.flow, analysis.allocations, analysis.flow.names
    return sum(_matmul_flops(flow, allocations, s) for s in seqs if names[s] in _FLOP_OPS)


def _convolution_flops(out: tuple[int, ...], weight: tuple[int, ...]) -> int:
    """torch.utils.flop_counter's ``conv_flop_count`` for a (not transposed) convolution: every output
    element is a dot product over the weight's ``in_channels / groups x kernel`` elements."""
    if len(out) < 3 or len(weight) != len(out) or weight[0] != out[1]:
        return 0
    return 2 * math.prod(out) * math.prod(weight[1:])


def _registry_flops(name: str, batch: int, m: int, n: int, k: int) -> int:
    """torch.utils.flop_counter's formula for ``mm``, ``addmm``, ``bmm`` and ``baddbmm`` (a
    multiply and an add per term of each dot product; the added term is not counted), written out
    here so that diagnosing a saved trace needs no torch (tests/test_doctor_flops.py holds it to
    torch's registry)."""
    del name  # the same formula for all four
    return 2 * batch * m * n * k


def _buffer_updates(analysis: Analysis, first: int, last: int) -> tuple[list[str], int]:
    """The modules among ops ``first..last`` that write a buffer in place, and the bytes of the buffers
    those modules read (what ``checkpoint_modules`` copies to restore them after a recompute)."""
    flow, allocations = analysis.flow, analysis.allocations
    writers: dict[str, None] = {}
    for seq in range(first, last + 1):
        row = flow.ops[seq]
        if (
            row.inputs
            and writes_in_place(row.op)
            and analysis.role(allocations[row.inputs[0]]) is Role.BUFFER
        ):
            writers[row.module or ""] = None
    if not writers:
        return [], 0
    read = {
        i
        for seq in range(first, last + 1)
        if (flow.ops[seq].module or "") in writers
        for i in flow.ops[seq].inputs
        if analysis.role(allocations[i]) is Role.BUFFER
    }
    return list(writers), sum(allocations[i].bytes for i in read)


def _recompute_peak(analysis: Analysis, made: list[int], first: int, last: int) -> int:
    """The most a block's own allocations held at once during its forward run (ops first..last)."""
    ops, allocations = analysis.flow.ops, analysis.allocations
    end = ops[last].tick
    events = []
    for ident in made:
        a = allocations[ident]
        events.append((a.alloc_tick, a.bytes))
        if a.free_tick is not None and a.free_tick <= end + 0.5:
            events.append((a.free_tick, -a.bytes))
    live = best = 0
    for _, delta in sorted(events):
        live += delta
        best = max(best, live)
    return best


@dataclass(frozen=True)
class BlockRecompute:
    """What checkpointing one block (``transformer.h.3``) does to the recorded timeline."""

    container: str
    """The module path of the blocks' container, as recorded (``GPT2LMHeadModel.transformer.h``)."""
    block: str
    """The block's recorded module path."""
    attribute: str
    """The block's attribute path from the model (``transformer.h.3``): the pattern that checkpoints it."""
    free_at: dict[int, float | None]
    added: tuple[Added, ...]
    changed: tuple[Allocation, ...]
    """The saved activations it frees after forward and makes again in backward."""
    flops: int
    """Recompute cost: the matmul and convolution FLOPs of one more forward of the block."""
    transient: int
    """The most the block's own allocations held at once in its forward run (with the copies of the
    buffers it updates, which checkpoint_modules keeps during the recompute)."""
    updates: tuple[str, ...] = ()
    """Recorded module paths inside it that write a buffer in place (BatchNorm in training mode)."""

    @property
    def edits(self) -> Edits:
        return Edits(free_at=self.free_at, add=self.added)


def block_recomputes(analysis: Analysis) -> dict[str, list[BlockRecompute]]:
    """Per container of two or more repeated blocks, what checkpointing each block would do: the edits
    of any subset of them, merged, are the what-if of checkpointing that subset."""
    flow, allocations, ops = analysis.flow, analysis.allocations, analysis.flow.ops
    found: dict[str, list[BlockRecompute]] = {}
    for container, blocks in _groups(flow).items():
        if len(blocks) < 2 or attribute_path(container + ".0") is None:
            continue
        for block in blocks.values():
            attribute = attribute_path(block.path)
            if attribute is None:
                continue
            free_at: dict[int, float | None] = {}
            added: list[Added] = []
            changed: list[Allocation] = []
            flops = transient = 0
            updating: dict[str, None] = {}
            for first, last in block.runs:
                # the first backward op of the block after this run: where its recompute happens
                after = bisect.bisect_right(block.backward, last)
                if after == len(block.backward):
                    continue
                start = block.backward[after]
                run_made = [i for s in range(first, last + 1) for i in flow.outputs[s]]
                internal = []
                for ident in run_made:
                    a = allocations[ident]
                    if not a.saved or a.free_tick is None or a.free_tick < ops[start].tick:
                        continue
                    forward_reads = [r for r in flow.readers[ident] if ops[r].phase is Phase.FORWARD]
                    if any(not (first <= r <= last) for r in forward_reads):
                        continue  # read by what follows the block (its output): kept, as checkpoint keeps it
                    internal.append(a)
                if not internal:
                    continue
                writers, restored = _buffer_updates(analysis, first, last)
                updating.update(dict.fromkeys(writers))
                peak_run = _recompute_peak(analysis, run_made, first, last) + restored
                transient = max(transient, peak_run)
                saved_bytes = sum(a.bytes for a in internal)
                t = ops[start].tick
                added.append(Added(max(0, peak_run - saved_bytes), t - 0.6, t - 0.4))
                for a in internal:
                    reads = [r for r in flow.readers[a.id] if first <= r <= last]
                    free_at[a.id] = (ops[reads[-1]].tick if reads else a.alloc_tick) + 0.5
                    added.append(Added(a.bytes, t - 0.6, a.free_tick))
                    changed.append(a)
                flops += matmul_flops(analysis, range(first, last + 1))
            if changed:
                found.setdefault(container, []).append(
                    BlockRecompute(
                        container,
                        block.path,
                        attribute,
                        free_at,
                        tuple(added),
                        tuple(changed),
                        flops,
                        transient,
                        tuple(updating),
                    )
                )
    return found


@DIAGNOSES.register("checkpoint-candidates")
def checkpoint_candidates(analysis: Analysis) -> list[Diagnosis]:
    """Repeated indexed blocks whose own saved activations are a large share of the peak ->
    ``memtrim.fixes.checkpoint_modules(model, ["<container>.*"])`` (``torch.utils.checkpoint``
    around each block)."""
    results = []
    alive = analysis.alive_ids_at_peak
    for container, recomputes in block_recomputes(analysis).items():
        pattern_base = attribute_path(container + ".0")
        assert pattern_base is not None  # block_recomputes keeps only containers with one
        blocks = {r.block for r in recomputes}
        free_at: dict[int, float | None] = {}
        added: list[Added] = []
        changed: list[Allocation] = []
        for r in recomputes:
            free_at.update(r.free_at)
            added += r.added
            changed += r.changed
        at_peak = sum(a.bytes for a in changed if a.id in alive)
        flops = sum(r.flops for r in recomputes)
        transients = [r.transient for r in recomputes]
        if not changed or at_peak < DOMINATES * analysis.peak.bytes:
            continue
        pattern = f"{pattern_base.rsplit('.', 1)[0]}.*"
        site: Site | None = changed[0].site
        blocks_text = f"{container.split('.', 1)[-1]}.*"
        updating = [m for r in recomputes for m in r.updates]
        if updating:
            named = list(dict.fromkeys(attribute_path(m) or m for m in updating))
            side = (
                f"the blocks write buffers in place in their forward ({', '.join(named[:3])}"
                f"{', ...' if len(named) > 3 else ''}: BatchNorm's running statistics in training mode); a "
                "recompute would write them again, so plain torch.utils.checkpoint changes them: "
                "checkpoint_modules copies them before each recompute and puts them back after"
            )
            plain = ""
        else:
            side = "nothing the blocks do writes a buffer in place; dropout's RNG state is replayed"
            plain = (
                " (torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) around each block's"
                " forward)"
            )
        diagnosis = finding(
            analysis,
            rule="checkpoint-candidates",
            site=site,
            problem=(
                f"activations saved inside the {len(blocks)} {blocks_text} blocks are "
                f"{format_bytes(at_peak)} of the peak"
            ),
            fix=f'memtrim.fixes.checkpoint_modules(model, ["{pattern}"]){plain}',
            code=(
                "import memtrim.fixes\n"
                f'handle = memtrim.fixes.checkpoint_modules(model, ["{pattern}"])  # handle.undo() restores'
            ),
            binds=(("model", called_object(analysis, container)),),
            allocations=tuple(changed),
            edits=Edits(free_at=free_at, add=tuple(added)),
            safe_because=(
                "only activations a block saved and only that block reads are dropped; block outputs stay",
                side,
                "checkpoint re-runs the same ops in the same order: results and gradients bit for bit equal",
            ),
            keeps="exact",
            module=container,
            cost=(
                f"recompute: {flops / 1e9:.3g} GFLOP of matmuls and convolutions "
                "(one more forward of every block)"
                if flops
                else "recompute: one more forward of every block"
            ),
            note=f"the what-if adds one block's recompute transient ({format_bytes(max(transients))} at "
            "most) when backward reaches it",
        )
        if diagnosis is not None:
            results.append(diagnosis)
    return results
