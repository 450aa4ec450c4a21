"""How to cut the peak: a registry of small rules, each reading the trace and proposing a rewrite.

Every diagnosis carries the peak the same trace would have had without the allocations it blames
(a what-if on the recorded timeline), so advice comes with the bytes it is worth. Add a rule with
``@diagnosis``; it receives the trace and returns findings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from memtrim.analysis.timeline import find_peak, largest_temporaries
from memtrim.analysis.whatif import peak_without
from memtrim.trace.model import Allocation, Site, Trace

_REDUCTIONS = ("aten.sum.", "aten.mean.", "aten.amax.", "aten.amin.")
_ELEMENTWISE_PRODUCTS = ("aten.mul.Tensor", "aten.add.Tensor", "aten.sub.Tensor", "aten.div.Tensor")


@dataclass
class Diagnosis:
    rule: str
    site: Site | None
    problem: str
    advice: str
    allocations: list[Allocation]
    peak_after: int

    @property
    def blamed_bytes(self) -> int:
        return sum(a.bytes for a in self.allocations)


Rule = Callable[[Trace], list[Diagnosis]]
DIAGNOSES: dict[str, Rule] = {}


def diagnosis(name: str) -> Callable[[Rule], Rule]:
    def register(rule: Rule) -> Rule:
        DIAGNOSES[name] = rule
        return rule

    return register


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _reduced_soon_after(trace: Trace, temp: Allocation) -> Allocation | None:
    """The smaller allocation a reduction at the same line made while ``temp`` was alive, if any."""
    for other in trace.allocations:
        if other.alloc_tick <= temp.alloc_tick or other.preexisting:
            continue
        if temp.free_tick is not None and other.alloc_tick > temp.free_tick:
            break
        if other.site == temp.site and other.op.startswith(_REDUCTIONS) and other.bytes * 4 <= temp.bytes:
            return other
    return None


@diagnosis("broadcast-then-reduce")
def broadcast_then_reduce(trace: Trace) -> list[Diagnosis]:
    """A large elementwise product that a reduction on the same line immediately shrinks."""
    found: dict[Site | None, list[Allocation]] = {}
    for temp in largest_temporaries(trace, 20):
        if temp.op in _ELEMENTWISE_PRODUCTS and temp.phase == "forward":
            reduced = _reduced_soon_after(trace, temp)
            if reduced is not None:
                found.setdefault(temp.site, []).append(temp)
    results = []
    for site, temps in found.items():
        # the backward of the same line makes same-sized gradients of the broadcast product
        blamed = [
            a
            for a in trace.allocations
            if a.site == site and a.category == "temporary" and a.bytes >= temps[0].bytes
        ]
        ratio = temps[0].bytes // max(1, (_reduced_soon_after(trace, temps[0]) or temps[0]).bytes)
        results.append(
            Diagnosis(
                rule="broadcast-then-reduce",
                site=site,
                problem=f"{temps[0].op} builds a {_shape(temps[0].shape)} product that a reduction then "
                f"shrinks {ratio}x",
                advice="contract without materialising the product: torch.einsum or matmul "
                "(e.g. (z[..., None] * W).sum(-2) -> torch.einsum('...hd,hdm->...hm', z, W)); "
                "check with memtrim.verify(..., mode='reference')",
                allocations=blamed,
                peak_after=peak_without(trace, blamed),
            )
        )
    return results


@diagnosis("out-of-place-backward")
def out_of_place_backward(trace: Trace) -> list[Diagnosis]:
    """Chains of same-shaped temporaries inside a custom autograd.Function.backward."""
    groups: dict[tuple[str | None, tuple[int, ...], str], list[Allocation]] = {}
    for a in trace.allocations:
        custom_backward = a.phase == "backward" and a.function == "backward" and a.node is not None
        if custom_backward and a.category in ("temporary", "gradient") and a.site is not None:
            groups.setdefault((a.site.file, a.shape, a.dtype), []).append(a)
    results = []
    for (_, shape, dtype), allocs in groups.items():
        temps = [a for a in allocs if a.category == "temporary"]
        if len(allocs) < 2 or not temps:
            continue
        results.append(
            Diagnosis(
                rule="out-of-place-backward",
                site=temps[0].site,
                problem=f"{len(allocs)} {dtype} buffers of shape {_shape(shape)} made one after another in "
                f"{allocs[0].node}.backward",
                advice="reuse one buffer you own with in-place ops (t.sub_, t.mul_, t.div_) in "
                "the same order, so results stay bit-identical; check with memtrim.verify(..., mode='exact')",
                allocations=temps,
                peak_after=peak_without(trace, temps),
            )
        )
    return results


def diagnose(trace: Trace) -> list[Diagnosis]:
    """Every rule's findings that would lower the peak, largest saving first."""
    peak = find_peak(trace).bytes
    findings = [d for rule in DIAGNOSES.values() for d in rule(trace)]
    return sorted((d for d in findings if d.peak_after < peak), key=lambda d: d.peak_after)
