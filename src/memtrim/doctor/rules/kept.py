"""Forward results held through backward for nothing: a model output the caller keeps though backward
never reads it (``kept-output``: a ``ModelOutput``'s ``.logits``), and a key/value cache built while
training (``cache-in-training``: ``use_cache`` defaults on in ``transformers``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memtrim.analysis.whatif import Edits
from memtrim.doctor.diagnosis import DIAGNOSES, Diagnosis, finding
from memtrim.doctor.rules.common import base_name, describe, where
from memtrim.trace.model import Allocation, Phase, Site

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis

_CACHE_COPIES = frozenset({"cat", "copy_", "index_copy", "index_copy_", "slice_scatter", "_to_copy", "clone"})


def _names_a_cache(site: Site | None) -> bool:
    """A line in code that says it keeps a cache (``transformers/cache_utils.py``, ``update_cache``).
    The recorder does not record which Python object holds a tensor, so the cache is known by name."""
    if site is None:
        return False
    file = site.file.replace("\\", "/").rsplit("/", 1)[-1].lower()
    return "cache" in file or "cache" in site.function.lower()


def _held_through_backward(analysis: Analysis, upcoming: list[int]) -> list[tuple[Allocation, int]]:
    """Forward results made from other tensors, not saved, alive when the next backward starts and
    never read from then on; with that backward's first op."""
    flow, ops = analysis.flow, analysis.flow.ops
    found = []
    for a in analysis.allocations:
        if a.preexisting or a.saved or a.facts or a.phase is not Phase.FORWARD:
            continue
        producer = flow.producer[a.id]
        if producer < 0 or not ops[producer].inputs:
            continue  # a factory's result (a parameter being built, a buffer): not a computed output
        start = upcoming[producer]
        if start >= len(ops) or (a.free_tick is not None and a.free_tick < ops[start].tick):
            continue
        last = flow.last_read(a)
        if last is not None and last >= start:
            continue  # read in backward or after: it is needed
        found.append((a, start))
    return found


@DIAGNOSES.register("kept-output")
def kept_output(analysis: Analysis) -> list[Diagnosis]:
    """A forward result (not a factory's, not saved by autograd) still alive when backward starts and
    never read again -> keep only what you need of the output, or ``del`` it before ``backward()``.
    The what-if frees it just before backward starts."""
    ops = analysis.flow.ops
    upcoming = analysis.flow.next_in(Phase.BACKWARD)
    groups: dict[Site | None, list[tuple[Allocation, int]]] = {}
    for a, start in _held_through_backward(analysis, upcoming):
        if not _names_a_cache(a.site):
            groups.setdefault(a.site, []).append((a, start))
    results = []
    for site, held in groups.items():
        a = held[0][0]
        free_at = {b.id: ops[start].tick - 0.5 for b, start in held}
        diagnosis = finding(
            analysis,
            rule="kept-output",
            site=site,
            problem=(
                f"{describe(a)} result of {base_name(a.op)} still held when backward runs, though nothing "
                "reads it after the forward"
            ),
            fix="keep only what you need of the forward's result (loss = model(...).loss), or del it "
            "before loss.backward()",
            allocations=tuple(b for b, _ in held),
            edits=Edits(free_at=free_at),
            safe_because=(
                "made in forward from other tensors (not a parameter or buffer being built)",
                "autograd did not save it: backward does not need it",
                "no op reads it from the start of backward to the end of the trace",
            ),
            keeps="exact",
            module=a.module,
            note="if you read it after backward (a metric), compute that before backward, or keep a "
            "smaller summary of it",
        )
        if diagnosis is not None:
            results.append(diagnosis)
    return results


def cache_copies(analysis: Analysis) -> tuple[list[Allocation], Edits]:
    """The cache copies :func:`cache_in_training` blames and the what-if of ``use_cache=False``: the
    cache no longer holds them, so each is freed after its last read (a copy autograd saved, after the
    backward that consumed it). What the attention reads instead (the projection's view, or its own
    contiguous copy of it) depends on strides the trace does not keep; it is counted as the copy."""
    flow, allocations, ops = analysis.flow, analysis.allocations, analysis.flow.ops
    upcoming = flow.next_in(Phase.BACKWARD)
    free_at: dict[int, float | None] = {}
    blamed: list[Allocation] = []
    for seq, row in enumerate(ops):
        if row.phase is not Phase.FORWARD or not _names_a_cache(row.site):
            continue
        if flow.names[seq] not in _CACHE_COPIES or len(flow.outputs[seq]) != 1:
            continue
        copy = allocations[flow.outputs[seq][0]]
        sources = [allocations[i] for i in row.inputs if allocations[i].bytes > 0]
        start = upcoming[seq]
        if len(sources) != 1 or sources[0].bytes < copy.bytes or start >= len(ops):
            continue  # a real past (generation), or not a copy of one tensor
        last = flow.last_read(copy)
        if copy.free_tick is not None and copy.free_tick < ops[start].tick:
            continue  # not held into backward
        if last is not None and copy.free_tick is not None and copy.free_tick <= ops[last].tick + 1:
            continue  # freed as soon as it was last read: the cache does not hold it
        free_at[copy.id] = (ops[last].tick if last is not None else copy.alloc_tick) + 0.5
        blamed.append(copy)
    return blamed, Edits(free_at=free_at)


@DIAGNOSES.register("cache-in-training")
def cache_in_training(analysis: Analysis) -> list[Diagnosis]:
    """Copies into a key/value cache (a ``cat`` onto an empty cache at a line that names a cache) made
    under grad mode and still alive when backward starts -> ``use_cache=False`` for training. The
    what-if frees each copy after its last read (:func:`cache_copies`)."""
    blamed, edits = cache_copies(analysis)
    if not blamed:
        return []
    first = blamed[0]
    hf = first.site is not None and _in_transformers(first.site.file)
    diagnosis = finding(
        analysis,
        rule="cache-in-training",
        site=first.site,
        problem=(
            f"{len(blamed)} key/value cache copies ({describe(first)} and the like) are built in "
            "training and held through backward"
        ),
        fix="pass use_cache=False to the model's forward in training (or set model.config.use_cache = False)",
        allocations=tuple(blamed),
        edits=edits,
        safe_because=(
            f"each is a copy of one tensor onto an empty cache at {where(first.site)} (no past keys): "
            "attention computes the same values without it" + (" to rounding" if hf else ""),
            "made under grad mode and held past its last read, into backward",
        ),
        # transformers builds its attention mask differently once a cache exists, and the attention
        # kernel it picks then rounds differently (GPT-2's tied wte gradient differs in the last bit)
        keeps="reference" if hf else "exact",
        module=first.module,
        sites=tuple(dict.fromkeys(a.site for a in blamed if a.site is not None)),
        note="the cache is known by its line's name (file or function naming a cache): the recorder does "
        "not record which object holds a tensor",
        # a transformers model reads use_cache from its config when the call does not pass it
        code=_CONFIG_OFF if hf else None,
        binds=(("model", "the transformers model the step calls"),) if hf else (),
    )
    return [diagnosis] if diagnosis is not None else []


_CONFIG_OFF = "model.config.use_cache = False  # or model(..., use_cache=False) in the training step"


def _in_transformers(file: str) -> bool:
    return "/transformers/" in file.replace("\\", "/")
