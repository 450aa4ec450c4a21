"""The analysis's batch paths on long traces give what the per-allocation rules and the per-event
definitions give: categories and roles computed once per kind of allocation (and per allocation again
once a rule of the user's is registered), per-phase peaks and the peak's event found at C speed."""

from __future__ import annotations

from builder import TraceBuilder
from hypothesis import given, settings
from hypothesis import strategies as st

from memtrim.analysis import CATEGORY_RULES, ROLE_RULES, Category, Role, categorize, role_of
from memtrim.analysis.categories import categorize_all
from memtrim.analysis.roles import roles_of
from memtrim.analysis.timeline import peaks_by_phase, sweep
from memtrim.trace.model import Allocation, Fact, Phase

# (phase of the op, bytes, ops it lives for or None, saved, facts, preexisting)
allocation_plans = st.lists(
    st.tuples(
        st.sampled_from(list(Phase)),
        st.integers(0, 4096),
        st.one_of(st.none(), st.integers(0, 6)),
        st.booleans(),
        st.sets(st.sampled_from(list(Fact)), max_size=2),
        st.booleans(),
    ),
    max_size=40,
)


def _build(plans: list[tuple[Phase, int, int | None, bool, set[Fact], bool]]) -> list[Allocation]:
    b = TraceBuilder()
    ends: dict[int, list[int]] = {}
    for step, (phase, nbytes, length, saved, facts, preexisting) in enumerate(plans):
        b.op(f"aten.op{step}.default", phase=phase)
        for ident in ends.pop(step, []):
            b.free(ident)
        ident = b.alloc(nbytes, saved=saved, facts=facts, preexisting=preexisting)
        if length is not None:
            ends.setdefault(step + length, []).append(ident)
    for step in sorted(ends):
        b.op(f"aten.late{step}.default", phase=Phase.OTHER)
        b.free(*ends[step])
    return b.build().allocations


@settings(max_examples=100, deadline=None)
@given(allocation_plans)
def test_batch_categories_and_roles_are_the_rules_answers(plans: list) -> None:  # type: ignore[type-arg]
    allocations = _build(plans)
    categories = categorize_all(allocations)
    assert categories == tuple(categorize(a) for a in allocations)
    assert roles_of(allocations, categories) == tuple(
        role_of(a, c) for a, c in zip(allocations, categories, strict=True)
    )


def test_a_registered_rule_is_asked_about_every_allocation() -> None:
    # the once-per-kind shortcut holds only for the built-in rules, which read a few fields: a user's
    # rule may read anything (here the size), so each allocation is asked again. Two allocations alike
    # in every field the built-in rules read (made outside any phase, freed in forward: no built-in
    # rule claims either), one small and one large.
    b = TraceBuilder()
    b.op("aten.empty.memory_format", phase=Phase.OTHER)
    small, large = b.alloc(64), b.alloc(1 << 20)
    b.op("aten.add.Tensor", phase=Phase.FORWARD)
    b.free(small, large)
    allocations = b.build().allocations
    assert categorize_all(allocations) == (Category.KEPT, Category.KEPT)
    assert roles_of(allocations, (Category.KEPT, Category.KEPT)) == (Role.OTHER, Role.OTHER)

    @CATEGORY_RULES.register("test-large")
    def _large(a: Allocation) -> Category | None:
        return Category.OUTPUT if a.bytes >= 1 << 20 else None

    try:
        assert categorize_all(allocations) == (Category.KEPT, Category.OUTPUT)
    finally:
        CATEGORY_RULES.unregister("test-large")

    @ROLE_RULES.register("test-large")
    def _large_role(a: Allocation, category: Category) -> Role | None:
        return Role.INPUT if a.bytes >= 1 << 20 else None

    try:
        assert roles_of(allocations, (Category.KEPT, Category.KEPT)) == (Role.OTHER, Role.INPUT)
    finally:
        ROLE_RULES.unregister("test-large")
    assert roles_of(allocations, (Category.KEPT, Category.KEPT)) == (Role.OTHER, Role.OTHER)


@settings(max_examples=100, deadline=None)
@given(allocation_plans)
def test_peaks_by_phase_and_the_peak_event_follow_their_definitions(plans: list) -> None:  # type: ignore[type-arg]
    allocations = _build(plans)
    curve = sweep(allocations, "cpu")
    phases, live = curve.phases, curve.live
    # a phase's peak: the most after any of its events, or carried into a run of its events from the
    # event before (0 at the start)
    expected = dict.fromkeys(Phase, 0)
    for i, phase in enumerate(phases):
        expected[phase] = max(expected[phase], live[i])
        if i == 0 or phases[i - 1] is not phase:
            expected[phase] = max(expected[phase], live[i - 1] if i else 0)
    assert peaks_by_phase(curve) == expected
    above = [i for i, value in enumerate(live) if value > 0 and value == max(live)]
    assert curve.peak_index() == (above[0] if above else None)
