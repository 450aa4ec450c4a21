"""The Pareto front of memtrim.plan.search: no candidate on it is dominated, every candidate off it is,
and the plan chosen for a budget is on it (a user reading the table finds the plan printed above it)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from memtrim.plan.levers import Edits, Option
from memtrim.plan.search import Candidate, _best, _pareto

_options = [
    Option(f"lever-{i}", str(i), {}, ("exact", "reference")[i % 2], float(i % 3), Edits()) for i in range(6)
]


def _changes(c: Candidate) -> int:
    return int(any(o.keeps == "reference" for o in c.options))


def _key(c: Candidate) -> tuple[float, int, int, int]:
    return (c.cost, len(c.options), _changes(c), c.peak)


def _dominates(d: Candidate, c: Candidate) -> bool:
    mine, theirs = (
        (d.cost, len(d.options), _changes(d), d.peak),
        (c.cost, len(c.options), _changes(c), c.peak),
    )
    return all(a <= b for a, b in zip(mine, theirs, strict=True)) and mine != theirs


@given(
    st.lists(st.tuples(st.sets(st.integers(0, 5), max_size=4), st.integers(0, 50)), min_size=1, max_size=40),
    st.integers(0, 50),
)
def test_the_front_holds_exactly_the_undominated_candidates_and_the_chosen_plan(
    drawn: list[tuple[set[int], int]], budget: int
) -> None:
    candidates = [Candidate(tuple(_options[i] for i in sorted(picked)), peak) for picked, peak in drawn]
    front = _pareto(candidates)
    for c in front:
        assert not any(_dominates(d, c) for d in candidates)
    for c in candidates:
        if c not in front:
            # dominated, or a tie in every respect with one on the front (which one stays is arbitrary)
            assert any(_dominates(d, c) or _key(d) == _key(c) for d in front)
    fits = [c for c in candidates if c.peak <= budget]
    if fits:
        best = _best(candidates, budget)
        assert best is not None and any(_key(d) == _key(best) for d in front)
        assert (best.cost, len(best.options), _changes(best), best.peak) == min(
            (c.cost, len(c.options), _changes(c), c.peak) for c in fits
        )
    else:
        assert _best(candidates, budget) is None
