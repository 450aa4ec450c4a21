"""The analysis stage on hand-built traces: categories, roles, the breakdown, per-phase peaks, what-if
(against a brute-force recount), and the terminal report. No torch program runs here."""

from __future__ import annotations

from builder import TraceBuilder
from hypothesis import given, settings
from hypothesis import strategies as st

from memtrim.analysis import Added, Category, Edits, Role, analyze
from memtrim.report.terminal import render
from memtrim.trace.model import Fact, Phase

KiB = 1024


def _step() -> tuple[TraceBuilder, dict[str, int]]:
    """A training step by hand: a weight from before, an activation, a temporary, a gradient, Adam state."""
    b = TraceBuilder()
    ids = {}
    ids["weight"] = b.alloc(64 * KiB, preexisting=True, facts=[Fact.PARAMETER])
    ids["data"] = b.alloc(8 * KiB, preexisting=True)
    b.op("aten.mm.default", phase=Phase.FORWARD, line=3)
    ids["hidden"] = b.alloc(16 * KiB, saved=True)
    b.op("aten.gelu.default", line=4)
    ids["scratch"] = b.alloc(32 * KiB)
    b.free(ids["scratch"])
    b.op("aten.mm.default", phase=Phase.BACKWARD, line=3, node="MmBackward0")
    ids["grad"] = b.alloc(64 * KiB, facts=[Fact.GRADIENT])
    b.free(ids["hidden"])
    b.op("aten.zeros_like.default", phase=Phase.OPTIMIZER, line=9)
    ids["exp_avg"] = b.alloc(64 * KiB, facts=[Fact.OPTIMIZER_STATE])
    b.op("aten.sqrt.default", line=9)
    ids["sqrt"] = b.alloc(64 * KiB)
    b.free(ids["sqrt"])
    return b, ids


def test_categories_and_roles_from_facts_then_lifetime() -> None:
    b, ids = _step()
    analysis = analyze(b.build())
    allocs = analysis.allocations
    assert [analysis.category(allocs[i]) for i in ids.values()] == [
        Category.PREEXISTING,
        Category.PREEXISTING,
        Category.SAVED,
        Category.TEMPORARY,
        Category.GRADIENT,
        Category.OUTPUT,
        Category.TEMPORARY,
    ]
    assert {name: analysis.role(allocs[i]) for name, i in ids.items()} == {
        "weight": Role.PARAMETER,
        "data": Role.INPUT,
        "hidden": Role.ACTIVATION,
        "scratch": Role.TEMPORARY,
        "grad": Role.GRADIENT,
        "exp_avg": Role.OPTIMIZER_STATE,
        "sqrt": Role.TEMPORARY,
    }


def test_breakdown_at_the_peak_sums_to_the_peak_and_counts_preexisting_weights() -> None:
    b, _ = _step()
    analysis = analyze(b.build())
    # the peak: grad 64 + exp_avg 64 + sqrt 64 KiB alive in the optimizer (hidden freed in backward)
    assert analysis.peak.bytes == 192 * KiB and analysis.peak.phase is Phase.OPTIMIZER
    bd = analysis.breakdown_at_peak
    assert bd.made == {Role.GRADIENT: 64 * KiB, Role.OPTIMIZER_STATE: 64 * KiB, Role.TEMPORARY: 64 * KiB}
    assert bd.preexisting == {Role.PARAMETER: 64 * KiB, Role.INPUT: 8 * KiB}
    assert bd.above_start == analysis.peak.bytes
    assert bd.total(Role.PARAMETER) == 64 * KiB


def test_peaks_by_phase_and_breakdown_at_phase_ends() -> None:
    b, _ = _step()
    analysis = analyze(b.build())
    assert analysis.peak_by_phase == {
        Phase.FORWARD: 48 * KiB,  # hidden + scratch
        Phase.BACKWARD: 80 * KiB,  # hidden + grad
        Phase.OPTIMIZER: 192 * KiB,
        Phase.OTHER: 0,
    }
    ends = analysis.breakdown_at_phase_end
    assert ends[Phase.FORWARD].made == {Role.ACTIVATION: 16 * KiB}
    assert ends[Phase.BACKWARD].made == {Role.GRADIENT: 64 * KiB}
    assert ends[Phase.OPTIMIZER].made == {Role.GRADIENT: 64 * KiB, Role.OPTIMIZER_STATE: 64 * KiB}


def test_a_preexisting_free_lowers_the_curve_and_is_accounted() -> None:
    b = TraceBuilder()
    old = b.alloc(10 * KiB, preexisting=True)
    b.op("aten.add.Tensor")
    new = b.alloc(4 * KiB)
    b.free(old)
    b.op("aten.mul.Tensor")
    b.alloc(4 * KiB)
    analysis = analyze(b.build())
    assert analysis.curve().live == [4 * KiB, -6 * KiB, -2 * KiB]
    assert analysis.peak.bytes == 4 * KiB and analysis.peak.allocation is analysis.allocations[new]
    late = analysis.breakdown_at(analysis.log.end_tick)
    assert late.preexisting_freed == 10 * KiB and late.above_start == -2 * KiB


def test_the_headline_is_the_largest_device_and_cuda_charges_512_byte_blocks() -> None:
    b = TraceBuilder()
    b.op("aten.empty.memory_format")
    b.alloc(1000, device="cpu")
    b.alloc(1000, device="cuda:0")
    b.alloc(1, device="cuda:0")
    analysis = analyze(b.build())
    assert analysis.peaks["cpu"].bytes == 1000
    assert analysis.peaks["cuda:0"].bytes == 1024 + 512  # the caching allocator's rounding
    assert analysis.peak.device == "cuda:0"
    assert analysis.peak_as("cuda").bytes == 1024 + 512


# -- what-if against a brute-force recount ---------------------------------------------------------
def _brute_peak(events: list[tuple[float, int, float | None]]) -> int:
    """Peak of (alloc tick, bytes, free tick) intervals, counted at every event time. At equal ticks
    allocations come before frees (the replay's rule: it never under-states a peak), so at time t
    everything made at or before t and not freed before t is counted."""
    times = sorted({t for a, _, f in events for t in (a, f) if t is not None})
    best = 0
    for t in times:
        live = sum(n for a, n, f in events if a <= t and (f is None or f >= t))
        best = max(best, live)
    return best


programs = st.lists(
    st.tuples(st.integers(1, 1000), st.integers(0, 30), st.one_of(st.none(), st.integers(1, 30))),
    min_size=1,
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(programs, st.data())
def test_replay_matches_a_brute_force_recount(
    program: list[tuple[int, int, int | None]], data: st.DataObject
) -> None:
    b = TraceBuilder()
    opened: list[tuple[int, int, int | None]] = []  # (id, bytes, free after op k)
    for step in range(32):
        b.op(f"aten.op{step}.default")
        for nbytes, start, length in program:
            if start == step:
                opened.append((b.alloc(nbytes), nbytes, None if length is None else step + length))
        for ident, _, end in opened:
            if end == step:
                b.free(ident)
    analysis = analyze(b.build())
    allocs = analysis.allocations
    ids = [a.id for a in allocs]
    remove = set(data.draw(st.sets(st.sampled_from(ids))))
    shrink = (
        {i: data.draw(st.integers(0, 1000)) for i in data.draw(st.sets(st.sampled_from(ids)))} if ids else {}
    )
    early = {}
    for i in data.draw(st.sets(st.sampled_from(ids))):
        a = allocs[i]
        early[i] = a.alloc_tick + 0.5  # freed right after it is made
    added = tuple(
        Added(n, t, None if d is None else t + d)
        for n, t, d in data.draw(
            st.lists(
                st.tuples(st.integers(1, 500), st.integers(0, 100), st.one_of(st.none(), st.integers(1, 50))),
                max_size=3,
            )
        )
    )
    edits = Edits(remove=frozenset(remove), resize=shrink, free_at=early, add=added)

    intervals: list[tuple[float, int, float | None]] = []
    for a in allocs:
        if a.id in remove:
            continue
        end = early.get(a.id, a.free_tick)
        intervals.append((a.alloc_tick, shrink.get(a.id, a.bytes), end))
    intervals += [(x.alloc_tick, x.bytes, x.free_tick) for x in added]
    assert analysis.peak_with(edits) == _brute_peak(intervals)
    plain = [(a.alloc_tick, a.bytes, a.free_tick) for a in allocs]
    assert analysis.peak.bytes == _brute_peak(plain)
    kept = [(a.alloc_tick, a.bytes, a.free_tick) for a in allocs if a.id not in remove]
    assert analysis.peak_without([allocs[i] for i in remove]) == _brute_peak(kept)


# -- the terminal report ---------------------------------------------------------------------------
def test_terminal_report_names_the_peak_its_line_roles_and_temporaries() -> None:
    b, _ = _step()
    text = render(analyze(b.build()), top=3)
    lines = text.splitlines()
    assert lines[0] == "memtrim: peak 192 KiB above the region's start on cpu"
    assert lines[1] == "  reached in optimizer by aten.sqrt.default at prog.py:9 in <module>"
    assert "At the peak, by role:" in text
    row = next(line for line in lines if line.strip().startswith("parameter"))
    assert row.split() == ["parameter", "-", "64", "KiB", "64", "KiB"]
    temps = lines[lines.index("Largest temporaries (made and freed in the same phase):") + 2].split()
    assert temps[:2] == ["64", "KiB"] and "sqrt.default" in temps  # the largest temporary first


def test_terminal_report_escapes_control_characters_from_the_trace() -> None:
    b = TraceBuilder()
    b.op("aten.mul.Tensor", file="evil\x1b]0;pwned\x07.py", function="f\x1b[2J")
    b.alloc(4096)
    text = render(analyze(b.build()))
    assert "\x1b" not in text and "\x07" not in text
    assert "evil\\x1b]0;pwned\\x07.py:1 in f\\x1b[2J" in text


def test_an_empty_trace_says_so() -> None:
    assert render(analyze(TraceBuilder().build())) == "memtrim: no allocations inside the region"


def test_post_mortem_shows_what_was_alive_at_the_failure_not_at_the_peak() -> None:
    b = TraceBuilder()
    b.op("aten.empty.memory_format", line=2)
    early = b.alloc(1024 * KiB)  # the earlier peak, freed long before the failure
    b.free(early)
    b.op("aten.mm.default", line=5)
    kept = b.alloc(64 * KiB)
    failing = b.op("aten.mm.default", phase=Phase.BACKWARD, line=5, node="MmBackward0")
    error = "RuntimeError: you tried to allocate 1048576 bytes."
    log = b.build(error=error)
    log.failed_op = log.ops[failing]
    analysis = analyze(log)
    failure = analysis.failure
    assert failure is not None and failure.requested_bytes == 1048576
    assert failure.live_bytes == 64 * KiB and analysis.peak.bytes == 1024 * KiB
    assert [g.bytes for g in failure.lines] == [64 * KiB]
    text = render(analysis)
    assert text.splitlines()[:3] == [
        f"memtrim: the region stopped with {error}",
        "  failing op: aten.mm.default in backward at prog.py:5 in <module> (it asked for 1 MiB)",
        "  alive at the failure: 64 KiB above the region's start",
    ]
    assert text.index("Alive at the failure, by source line:") < text.index("the peak was 1 MiB")
    assert analysis.allocations[kept].alive_at(failure.tick)


def test_cuda_out_of_memory_messages_give_the_requested_bytes() -> None:
    from memtrim.analysis.failure import requested_bytes

    cuda = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity"
    )
    assert requested_bytes(cuda) == 20 * 2**20
    assert requested_bytes("CUDA out of memory. Tried to allocate 512 bytes. GPU 0 has") == 512
    assert requested_bytes("ValueError: shapes do not match") is None
