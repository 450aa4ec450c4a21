"""The memtrim command, run as a user would."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")


def memtrim(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "memtrim", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


SCRIPT = textwrap.dedent(
    """
    import torch
    z = torch.randn(64, 12, 64)
    W_O = torch.randn(12, 64, 768)
    heads = (z[..., None] * W_O).sum(-2)
    """
)


def test_run_reports_the_line_and_writes_a_trace(tmp_path: Path) -> None:
    (tmp_path / "prog.py").write_text(SCRIPT)
    done = memtrim("run", "-o", "t.json", "prog.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "prog.py:5 in <module>" in done.stdout
    assert "144 MiB" in done.stdout  # 64*12*64*768*4 bytes
    shown = memtrim("show", "t.json", "--json", cwd=tmp_path)
    assert json.loads(shown.stdout)["largest_temporaries"][0]["bytes"] == 64 * 12 * 64 * 768 * 4


def test_run_of_a_failing_script_still_writes_the_trace(tmp_path: Path) -> None:
    (tmp_path / "boom.py").write_text(SCRIPT + "\nraise MemoryError('pretend OOM')\n")
    done = memtrim("run", "-o", "t.json", "boom.py", cwd=tmp_path)
    assert done.returncode == 1
    assert "pretend OOM" in done.stderr and "stopped with MemoryError" in done.stdout
    assert json.loads((tmp_path / "t.json").read_text())["error"] == "MemoryError: pretend OOM"


def test_bad_paths_get_clear_errors(tmp_path: Path) -> None:
    missing = memtrim("run", "nope.py", cwd=tmp_path)
    assert missing.returncode == 2 and "no such script" in missing.stderr
    (tmp_path / "x.json").write_text("{}")
    bad = memtrim("show", "x.json", cwd=tmp_path)
    assert bad.returncode == 2 and "schema" in bad.stderr


def test_the_script_traceback_is_printed_as_python_prints_it(tmp_path: Path) -> None:
    (tmp_path / "boom.py").write_text("import torch\n\ndef f():\n    return undefined_name\n\nf()\n")
    done = memtrim("run", "boom.py", cwd=tmp_path)
    assert done.returncode == 1
    python = subprocess.run([sys.executable, "boom.py"], cwd=tmp_path, capture_output=True, text=True)
    assert python.stderr.strip() in done.stderr  # the same traceback, frame for frame
    assert 'boom.py", line 4, in f' in done.stderr and "runpy" not in done.stderr
    assert "memtrim" not in done.stderr.split("Traceback", 1)[1].split("NameError", 1)[0]


def test_exit_codes_are_the_scripts(tmp_path: Path) -> None:
    cases = {
        "sys.exit()": (0, ""),
        "sys.exit(0)": (0, ""),
        "sys.exit(3)": (3, ""),
        "sys.exit('bad input')": (1, "bad input"),
    }
    for i, (call, (status, message)) in enumerate(cases.items()):
        (tmp_path / f"e{i}.py").write_text(f"import sys, torch\nx = torch.ones(4)\n{call}\n")
        done = memtrim("run", "-o", f"e{i}.json", f"e{i}.py", cwd=tmp_path)
        assert done.returncode == status, (call, done.stderr)
        assert message in done.stderr
        assert (tmp_path / f"e{i}.json").exists()  # the trace is written however the script ends


def test_output_paths_are_checked_before_the_run(tmp_path: Path) -> None:
    (tmp_path / "side_effect.py").write_text("open('ran', 'w').write('yes')\n")
    for flag in ("-o", "--html", "--png", "--perfetto", "--memory-viz"):
        done = memtrim("run", flag, "missing/out.file", "side_effect.py", cwd=tmp_path)
        assert done.returncode == 2, flag
        assert not (tmp_path / "ran").exists(), f"{flag}: the script ran before the path was checked"
        lines = done.stderr.strip().splitlines()
        assert (
            len(lines) == 1 and "memtrim: error: cannot write" in lines[0] and "create the folder" in lines[0]
        )


def test_version_module_and_top(tmp_path: Path) -> None:
    version = memtrim("--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("memtrim 0.1.0 (torch 2.13")
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "job.py").write_text(
        "import sys, torch\nassert sys.argv[1:] == ['--steps', '2'], sys.argv\n"
        "x = torch.ones(256)\ny = (x * 2).sum()\n"
    )
    done = memtrim("run", "-o", "m.json", "-m", "pkg.job", "--steps", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "job.py:4 in <module>" in done.stdout
    missing = memtrim("run", "-m", "pkg.nothing", cwd=tmp_path)
    assert missing.returncode == 2 and "no module named 'pkg.nothing'" in missing.stderr
    for bad in ("-1", "0", "x"):
        rejected = memtrim("show", "m.json", "--top", bad, cwd=tmp_path)
        assert rejected.returncode == 2 and "--top" in rejected.stderr
    assert memtrim("show", "m.json", "--top", "1", cwd=tmp_path).returncode == 0


def test_report_fits_100_columns(tmp_path: Path) -> None:
    deep = tmp_path / "a_rather_long_folder_name_for_a_project" / "with_nested_packages_inside"
    deep.mkdir(parents=True)
    (deep / "a_long_module_name_for_the_head_results_broadcast.py").write_text(
        "import torch\n\ndef per_head_results_of_the_attention_layer_computed_the_slow_way(z, W_O):\n"
        "    return (z[..., None] * W_O).sum(-2)\n\n"
        "z = torch.randn(8, 12, 64, requires_grad=True)\nW_O = torch.randn(12, 64, 768, requires_grad=True)\n"
        "per_head_results_of_the_attention_layer_computed_the_slow_way(z, W_O).square().sum().backward()\n"
    )
    done = memtrim(
        "run",
        "-o",
        "t.json",
        str(deep / "a_long_module_name_for_the_head_results_broadcast.py"),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    widths = [len(line) for line in done.stdout.splitlines()]
    assert max(widths) <= 100, done.stdout
    assert "…" in done.stdout  # a long source line shortened from the left
    assert ":4 in per_head_results_of_the_attention" in done.stdout  # line number and function kept


def test_what_the_script_still_holds_at_its_end_is_output_not_temporary(tmp_path: Path) -> None:
    # issue 10, item 3: the region closes before the script's globals are torn down
    (tmp_path / "hold.py").write_text(
        "import torch\nkept = torch.ones(1024, 1024)\ncycle = [torch.ones(256)]\ncycle.append(cycle)\n"
        "scratch = torch.ones(512) * 2\ndel scratch\n"
    )
    done = memtrim("run", "-o", "t.json", "--json", "hold.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["breakdown_at_peak"]["output"] == 1024 * 1024 * 4 + 256 * 4
    lines = {(g["line"], tuple(sorted(g["categories"]))) for g in data["live_at_peak"]}
    assert (2, ("output",)) in lines and (3, ("output",)) in lines
    # the one thing the script dropped itself is the only temporary
    assert [(t["line"], t["bytes"]) for t in data["largest_temporaries"]] == [(5, 512 * 4)] * 2


def test_errors_are_one_line_naming_the_fix(tmp_path: Path) -> None:
    (tmp_path / "t.json").write_text("not json")
    for args, expected in (
        (("show", "t.json"), "memtrim traces are JSON files"),
        (("show", "missing.json"), "no such trace file"),
        (("export", "missing.json"), "say what to export"),
        (("run",), "give a script to run"),
    ):
        done = memtrim(*args, cwd=tmp_path)
        assert done.returncode == 2, args
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("memtrim: error: ") and expected in lines[0], (
            done.stderr
        )


def test_run_writes_every_view(tmp_path: Path) -> None:
    (tmp_path / "prog.py").write_text(SCRIPT)
    done = memtrim(
        "run",
        "-o",
        "t.json",
        "--html",
        "r.html",
        "--png",
        "r.png",
        "--perfetto",
        "p.json",
        "--memory-viz",
        "m.pickle",
        "prog.py",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    assert "traceEvents" in json.loads((tmp_path / "p.json").read_text())
    assert (tmp_path / "m.pickle").read_bytes()[:2] == b"\x80\x04"
    # the viewer lists each alloc, each free (its free_requested/free_completed pair) and the snapshot
    snap = pickle.loads((tmp_path / "m.pickle").read_bytes())
    cpu = snap["device_traces"][0]
    listed = sum(e["action"] in ("alloc", "free_completed", "snapshot") for e in cpu)
    assert f"memtrim: m.pickle: memory_viz will list cpu (device 0): {listed:,} events" in done.stderr
    again = memtrim("export", "t.json", "--html", "again.html", cwd=tmp_path)
    assert again.returncode == 0 and (tmp_path / "again.html").exists()
