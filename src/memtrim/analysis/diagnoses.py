"""How to cut the peak: a registry of small rules, each reading an :class:`Analysis` and proposing a fix.

Every finding carries the peak the same timeline would have had with the fix applied (a what-if replay
of the recorded events), so advice comes with the bytes it is worth, and the conditions the rule
checked (``safe_because``). Add a rule with ``@DIAGNOSES.register("name")``; it receives the analysis
and yields findings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from memtrim.analysis.categories import Category
from memtrim.registry import Registry
from memtrim.trace.model import Allocation, Phase, Site, shape_text

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis

VerifyMode = Literal["exact", "reference"]


@dataclass(frozen=True)
class Diagnosis:
    """One finding: what is wrong at a line, the fix, and what the peak would be with it."""

    rule: str
    site: Site | None
    problem: str
    fix: str
    allocations: tuple[Allocation, ...]
    """The recorded allocations the fix removes or changes."""
    peak_before: int
    peak_after: int
    """The what-if peak with the fix applied to the recorded timeline."""
    safe_because: tuple[str, ...] = ()
    """The conditions the rule checked on the trace for the fix to keep results."""
    verify_mode: VerifyMode | None = None
    """The ``memtrim.verify`` mode that proves the fix."""
    module: str | None = None

    @property
    def bytes_at_stake(self) -> int:
        return sum(a.bytes for a in self.allocations)

    @property
    def saving(self) -> int:
        return self.peak_before - self.peak_after

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(a.op for a in self.allocations))


Rule = Callable[["Analysis"], Iterable[Diagnosis]]
DIAGNOSES: Registry[str, Rule] = Registry(
    "diagnosis rule", "memtrim.analysis.diagnoses.DIAGNOSES.register(name)"
)


def diagnose(analysis: Analysis) -> list[Diagnosis]:
    """Every rule's findings that would lower the peak, largest saving first."""
    peak = analysis.peak.bytes
    findings = [d for rule in DIAGNOSES.values() for d in rule(analysis)]
    return sorted((d for d in findings if d.peak_after < peak), key=lambda d: (d.peak_after, d.rule))


# -- rules -----------------------------------------------------------------------------------------
_REDUCTIONS = ("aten.sum.", "aten.mean.", "aten.amax.", "aten.amin.")
_ELEMENTWISE_PRODUCTS = ("aten.mul.Tensor", "aten.add.Tensor", "aten.sub.Tensor", "aten.div.Tensor")


def _reduced_soon_after(allocations: list[Allocation], temp: Allocation) -> Allocation | None:
    """The smaller allocation a reduction at the same line made while ``temp`` was alive, if any."""
    for other in allocations[temp.id + 1 :]:
        if other.preexisting or other.alloc_tick <= temp.alloc_tick:
            continue
        if temp.free_tick is not None and other.alloc_tick > temp.free_tick:
            break
        if other.site == temp.site and other.op.startswith(_REDUCTIONS) and other.bytes * 4 <= temp.bytes:
            return other
    return None


@DIAGNOSES.register("broadcast-then-reduce")
def broadcast_then_reduce(analysis: Analysis) -> list[Diagnosis]:
    """A large elementwise product that a reduction on the same line immediately shrinks."""
    allocations = analysis.allocations
    found: dict[Site | None, list[tuple[Allocation, Allocation]]] = {}
    for temp in analysis.largest_temporaries(20):
        if temp.op in _ELEMENTWISE_PRODUCTS and temp.phase is Phase.FORWARD:
            reduced = _reduced_soon_after(allocations, temp)
            if reduced is not None:
                found.setdefault(temp.site, []).append((temp, reduced))
    results = []
    for site, pairs in found.items():
        product, reduced = pairs[0]
        # the backward of the same line makes same-sized gradients of the broadcast product
        blamed = tuple(
            a
            for a in allocations
            if a.site == site and analysis.category(a) is Category.TEMPORARY and a.bytes >= product.bytes
        )
        results.append(
            Diagnosis(
                rule="broadcast-then-reduce",
                site=site,
                problem=f"{product.op} builds a {shape_text(product.shape)} product that a reduction then "
                f"shrinks {product.bytes // max(1, reduced.bytes)}x",
                fix="contract without materialising the product: torch.einsum or matmul "
                "(e.g. (z[..., None] * W).sum(-2) -> torch.einsum('...hd,hdm->...hm', z, W)); "
                "check with memtrim.verify(..., mode='reference')",
                allocations=blamed,
                peak_before=analysis.peak.bytes,
                peak_after=analysis.peak_without(blamed),
                verify_mode="reference",
                module=product.module,
            )
        )
    return results


@DIAGNOSES.register("out-of-place-backward")
def out_of_place_backward(analysis: Analysis) -> list[Diagnosis]:
    """Chains of same-shaped temporaries inside a custom autograd.Function.backward."""
    groups: dict[tuple[str | None, tuple[int, ...], str], list[Allocation]] = {}
    for a in analysis.allocations:
        custom_backward = a.phase is Phase.BACKWARD and a.function == "backward" and a.node is not None
        category = analysis.category(a)
        if custom_backward and category in (Category.TEMPORARY, Category.GRADIENT) and a.site is not None:
            groups.setdefault((a.site.file, a.shape, a.dtype), []).append(a)
    results = []
    for (_, shape, dtype), allocs in groups.items():
        temps = tuple(a for a in allocs if analysis.category(a) is Category.TEMPORARY)
        if len(allocs) < 2 or not temps:
            continue
        results.append(
            Diagnosis(
                rule="out-of-place-backward",
                site=temps[0].site,
                problem=f"{len(allocs)} {dtype} buffers of shape {shape_text(shape)} made one after "
                f"another in {allocs[0].node}.backward",
                fix="reuse one buffer you own with in-place ops (t.sub_, t.mul_, t.div_) in "
                "the same order, so results stay bit-identical; check with memtrim.verify(..., mode='exact')",
                allocations=temps,
                peak_before=analysis.peak.bytes,
                peak_after=analysis.peak_without(temps),
                verify_mode="exact",
                module=temps[0].module,
            )
        )
    return results
