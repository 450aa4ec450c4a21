"""Two torchrun jobs compared rank by rank (``memtrim diff B0 B1 -- A0 A1``, ``memtrim.diff_ranks``) on
hand-built rank traces: every byte asserted is the sum of the hand-built allocations, and ranks are
paired by the rank each trace recorded, whatever order the traces are given in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from builder import TraceBuilder

import memtrim
from memtrim.analysis import Analysis, analyze
from memtrim.analysis.rankdiff import RankSetError, diff_rank_sets
from memtrim.cli import main
from memtrim.report import rankdiff
from memtrim.trace.model import Phase, TraceLog
from memtrim.units import format_bytes, format_change, format_delta

SRC = str(Path(__file__).resolve().parents[1] / "src")

# (activation, temporary) per rank: the activation is saved in forward and the temporary made in
# backward while it is alive, so a rank's peak is their sum
BEFORE = {0: (4096, 1024), 1: (4096, 8192)}  # peaks 5,120 and 12,288: rank 1 is the job's peak
AFTER = {0: (8192, 1024), 1: (4096, 2048)}  # peaks 9,216 and 6,144: now rank 0 is


def _log(rank: int | None, activation: int, temporary: int, world: int = 2, run: str = "job") -> TraceLog:
    b = TraceBuilder()
    b.op("aten.mm.default", phase=Phase.FORWARD, line=3)
    saved = b.alloc(activation, saved=True)
    b.op("aten.mul.Tensor", phase=Phase.BACKWARD, line=5)
    tmp = b.alloc(temporary)
    b.free(tmp, saved)
    metadata = {} if rank is None else {"distributed": {"rank": rank, "world_size": world, "run_id": run}}
    return b.build(metadata=metadata)


def _job(sizes: dict[int, tuple[int, int]], order: list[int], run: str, world: int = 2) -> list[Analysis]:
    return [analyze(_log(r, *sizes[r], world=world, run=run)) for r in order]


def _peak(sizes: tuple[int, int]) -> int:
    return sizes[0] + sizes[1]


def test_ranks_are_paired_by_their_recorded_rank_and_the_bytes_are_the_events() -> None:
    # before given rank 1 first: paired by argument order, rank 0 would read 12,288 -> 9,216
    d = diff_rank_sets(_job(BEFORE, [1, 0], "b"), _job(AFTER, [0, 1], "a"))
    data = rankdiff.to_dict(d)
    assert data["world_size"] == 2 and not data["empty"]
    assert data["peak"] == {"before": 12288, "after": 9216}
    assert data["highest_rank"] == {"before": 1, "after": 0}
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for r in data["ranks"]:
        (act_b, tmp_b), (act_a, tmp_a) = BEFORE[r["rank"]], AFTER[r["rank"]]
        assert r["peak"] == {"before": act_b + tmp_b, "after": act_a + tmp_a}
        assert r["by_role_at_peak"] == {
            "activation": {"before": act_b, "after": act_a},
            "temporary": {"before": tmp_b, "after": tmp_a},
        }
    # the rank that matters is the highest after: its full one-trace diff comes last
    assert data["focus"]["rank"] == 0
    assert data["focus"]["diff"]["peak"] == {"before": 5120, "after": 9216}


def test_the_text_table_roles_and_focus() -> None:
    d = diff_rank_sets(_job(BEFORE, [1, 0], "b"), _job(AFTER, [1, 0], "a"))
    lines = rankdiff.render_text(d).splitlines()
    assert (
        lines[0] == f"memtrim diff: 2 ranks; the job's peak (its highest rank's) {format_change(12288, 9216)}"
    )
    assert lines[1] == "  highest: rank 1 before, rank 0 after"
    table = lines[lines.index("Peak per rank:") + 1 :][:3]
    assert [row.split()[0] for row in table] == ["rank", "0", "1"]
    for row in table[1:]:
        rank = int(row.split()[0])
        before, after = _peak(BEFORE[rank]), _peak(AFTER[rank])
        cells = [format_bytes(before), format_bytes(after), format_delta(before, after)]
        assert " ".join(row.split()[1:]).startswith(" ".join(cells))
    assert table[1].endswith("highest after") and table[2].endswith("highest before")
    roles = lines[lines.index("What changed at each rank's peak, by role:") + 1 :][:2]
    assert roles[0].split() == ["rank", "0", "activation", *format_change(4096, 8192).split()]
    assert roles[1].split() == ["rank", "1", "temporary", *format_change(8192, 2048).split()]
    assert (
        f"Rank 0 sets the job's peak after the change ({format_bytes(9216)}; {format_bytes(5120)} before)"
        in ("\n".join(lines))
    )
    assert f"memtrim diff: peak {format_change(5120, 9216)}" in lines  # rank 0's own diff
    assert max(len(line) for line in lines) <= 100


def test_markdown_for_a_pull_request() -> None:
    d = diff_rank_sets(_job(BEFORE, [0, 1], "b"), _job(AFTER, [1, 0], "a"))
    md = rankdiff.render_markdown(d).splitlines()
    assert md[0] == "**memtrim** (2 ranks): the job's peak (its highest rank's) 12 KiB → 9 KiB (-3 KiB)"
    assert "| 0 | 5 KiB | 9 KiB | +4 KiB |" in md and "| 1 | 12 KiB | 6 KiB | -6 KiB |" in md
    assert "| **job** (highest rank) | 12 KiB (rank 1) | 9 KiB (rank 0) | -3 KiB |" in md
    assert "| 0 | activation | 4 KiB | 8 KiB | +4 KiB |" in md
    assert "| 1 | temporary | 8 KiB | 2 KiB | -6 KiB |" in md
    assert "**memtrim**: peak 5 KiB → 9 KiB (+4 KiB)" in md  # rank 0's own diff


def test_a_tie_at_the_job_peak_is_said_and_the_rank_that_moved_most_is_shown() -> None:
    after = {0: (4096, 2048), 1: (4096, 2048)}  # both 6,144; rank 1 moved 6,144, rank 0 by 1,024
    d = diff_rank_sets(_job(BEFORE, [0, 1], "b"), _job(after, [0, 1], "a"))
    assert d.peak == (12288, 6144) and d.at_job_peak(1) == [0, 1] and d.focus.rank == 1
    text = rankdiff.render_text(d)
    assert "  highest: rank 1 before, ranks 0, 1 (tied) after" in text
    assert "Rank 1 shares the job's peak after the change" in text


def test_no_differences_and_identical_changes_grouped() -> None:
    same = diff_rank_sets(_job(BEFORE, [0, 1], "b"), _job(BEFORE, [1, 0], "a"))
    assert same.empty
    assert rankdiff.render_text(same) == (
        "memtrim diff: 2 ranks; no differences on any rank (the job's peak 12 KiB in both)"
    )
    # 20 ranks: ranks 0-17 change alike (grouped), the table lists 16 of them and fits 100 columns
    before = {r: (4096, 1024) for r in range(20)}
    after = {r: (8192, 1024) for r in range(18)} | {18: (4096, 1024), 19: (4096, 4096)}
    d = diff_rank_sets(
        _job(before, list(range(20)), "b", world=20), _job(after, list(range(20)), "a", world=20)
    )
    lines = rankdiff.render_text(d).splitlines()
    assert "  ranks 0-17  activation  4 KiB -> 8 KiB (+4 KiB)" in lines
    assert "  rank 19     temporary   1 KiB -> 4 KiB (+3 KiB)" in lines
    assert "  (4 more ranks; --json has all)" in lines
    assert max(len(line) for line in lines) <= 100
    assert len(rankdiff.to_dict(d)["ranks"]) == 20


def test_fewer_ranks_than_the_job_had_are_said() -> None:
    d = diff_rank_sets(_job(BEFORE, [1], "b", world=4), _job(AFTER, [1], "a", world=4))
    assert d.partial and rankdiff.render_text(d).startswith("memtrim diff: 1 of 4 ranks;")


@pytest.mark.parametrize(
    ("before", "after", "says"),
    [
        # a rank missing on one side
        (
            [(0, "b", 2), (1, "b", 2)],
            [(0, "a", 2)],
            "rank 1 given for the before job but not for the after job",
        ),
        # different world sizes
        (
            [(0, "b", 2), (1, "b", 2)],
            [(r, "a", 4) for r in range(4)],
            "the before job has 2 ranks and the after",
        ),
        # the same rank twice
        ([(0, "b", 2), (0, "b", 2)], [(0, "a", 2), (1, "a", 2)], "are both rank 0 of the before job"),
        # two jobs on one side
        ([(0, "b", 2), (1, "x", 2)], [(0, "a", 2), (1, "a", 2)], "come from different runs ('b', 'x')"),
        # a single process's trace among rank traces
        ([(0, "b", 2), (None, "b", 2)], [(0, "a", 2), (1, "a", 2)], "before trace 2 records no rank"),
        # one side single, the other ranks
        ([(None, "b", 1)], [(0, "a", 2), (1, "a", 2)], "the before side (before trace 1) has no rank traces"),
        ([], [(0, "a", 2)], "give at least one trace on each side"),
    ],
)
def test_sets_that_cannot_be_paired_name_the_fix(
    before: list[tuple[int | None, str, int]], after: list[tuple[int | None, str, int]], says: str
) -> None:
    def job(spec: list[tuple[int | None, str, int]]) -> list[Analysis]:
        return [analyze(_log(rank, 4096, 1024, world=world, run=run)) for rank, run, world in spec]

    with pytest.raises(RankSetError) as caught:
        diff_rank_sets(job(before), job(after))
    assert says in str(caught.value)


def _save(folder: Path, name: str, log: TraceLog) -> str:
    path = str(folder / name)
    memtrim.Trace(log).save(path)
    return path


def _save_jobs(folder: Path) -> None:
    for job, sizes in (("before", BEFORE), ("after", AFTER)):
        for rank, (act, tmp) in sizes.items():
            _save(folder, f"{job}.rank{rank}.json", _log(rank, act, tmp, run=job))
    _save(folder, "single.json", _log(None, 4096, 1024))


def test_api_takes_traces_files_or_base_names(tmp_path: Path) -> None:
    _save_jobs(tmp_path)
    by_base = memtrim.diff_ranks(str(tmp_path / "before.json"), str(tmp_path / "after.json"))
    assert by_base.peak == (12288, 9216) and by_base.highest == (1, 0)
    files = [str(tmp_path / f"after.rank{r}.json") for r in (1, 0)]
    traces = [memtrim.load(str(tmp_path / f"before.rank{r}.json")) for r in (1, 0)]
    mixed = memtrim.diff_ranks(traces, files)
    assert mixed.to_dict() == by_base.to_dict()
    assert mixed.focus[0] == 0 and mixed.focus[1].peak == (5120, 9216)
    assert {r: d.peak for r, d in mixed.ranks.items()} == {0: (5120, 9216), 1: (12288, 6144)}
    with pytest.raises(RankSetError, match=r"single\.json\) has no rank traces"):
        memtrim.diff_ranks(str(tmp_path / "before.json"), str(tmp_path / "single.json"))


def test_cli_errors_are_one_line_naming_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _save_jobs(tmp_path)
    b, a, one = (str(tmp_path / n) for n in ("before.json", "after.json", "single.json"))
    cases = [
        (["diff", b, one], "has no rank traces while the before side has the ranks"),
        (
            ["diff", b, a, "--html", str(tmp_path / "d.html")],
            "--html draws two traces, not two sets of ranks",
        ),
        (["diff", b, a, one], "3 traces given; memtrim diff BEFORE AFTER for two traces"),
        (["diff", b, "--"], "no trace after --"),
        (["diff", one, "--", a], "the before side (" + one + ") has no rank traces"),
        (
            ["diff", str(tmp_path / "before.rank0.json"), "--", a],
            "rank 1 given for the after job but not for the before job; give the same ranks of both "
            f"(the before job's {tmp_path / 'before.rank1.json'})",
        ),
    ]
    for argv, says in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("memtrim: error: ") and says in err and err.count("\n") == 1, err
    # base names, options on either side of --
    assert main(["diff", "--top", "1", b, "--", a, "--markdown"]) == 0
    md = capsys.readouterr().out
    assert md.startswith("**memtrim** (2 ranks): the job's peak (its highest rank's) 12 KiB → 9 KiB")


def test_diff_command_on_saved_rank_traces(tmp_path: Path) -> None:
    _save_jobs(tmp_path)
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-m", "memtrim", "diff", "before.rank1.json", "before.rank0.json", "--",
         "after.rank0.json", "after.rank1.json", "--json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["peak"] == {"before": 12288, "after": 9216}
    assert [(r["rank"], r["peak"]["before"], r["peak"]["after"]) for r in data["ranks"]] == [
        (0, 5120, 9216),
        (1, 12288, 6144),
    ]


def test_a_base_name_finds_its_rank_files_in_rank_order(tmp_path: Path) -> None:
    from memtrim.api import rank_set
    from memtrim.trace.ranks import rank_files

    for name in (
        "t.rank10.json",
        "t.rank2.json",
        "t.rank0.json",
        "t.rankx.json",
        "t.rank1.json.bak",
        "u.rank3.json",
    ):
        (tmp_path / name).write_text("{}")
    assert rank_files(str(tmp_path / "t.json")) == [str(tmp_path / f"t.rank{r}.json") for r in (0, 2, 10)]
    assert rank_files(str(tmp_path / "none.json")) == [] and rank_files("/no/such/folder/t.json") == []
    (tmp_path / "t.json").write_text("{}")  # a file of that name is taken as given
    assert [name for _, name in rank_set(str(tmp_path / "t.json"))] == [str(tmp_path / "t.json")]
