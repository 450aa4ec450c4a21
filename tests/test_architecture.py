"""The pipeline's import rules (docs/ARCHITECTURE.md), checked on the source: data flows one way.

trace imports nothing of memtrim; capture -> trace; analysis -> trace; doctor -> analysis, trace;
report -> doctor, analysis, trace; verify/bench/fixes -> capture, doctor, analysis, report, trace, and
verify -> fixes too (the checks it shares with the fix it proves); plan -> those, fixes and verify;
api, cases, cli and the package itself on top. ``memtrim.registry`` and ``memtrim.units`` are leaves any
stage may import. Every import counts, also one inside a function or under ``TYPE_CHECKING``: a lazy
import is still an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import memtrim

SRC = Path(memtrim.__file__).parent
LEAVES = {"registry", "units"}
LOWER = {"trace", "capture", "analysis", "doctor", "report"}
ALLOWED: dict[str, set[str]] = {
    "trace": set(),
    "capture": {"trace"},
    "analysis": {"trace"},
    "doctor": {"analysis", "trace"},
    "report": {"doctor", "analysis", "trace"},
    "verify": LOWER | {"fixes"},
    "bench": LOWER,
    "fixes": LOWER,
    "plan": LOWER | {"fixes", "verify"},
}
# integrations: a callback or plugin per framework (transformers, lightning, pytest), each imported only by
# name or by pytest, never by ``import memtrim``
TOP = {"api", "cases", "cli", "jupyter", "integrations", "__init__", "__main__"}


def _stage(path: Path) -> str:
    return path.relative_to(SRC).parts[0].removesuffix(".py")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every ``import memtrim...`` / ``from memtrim... import`` in the file."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            # relative: resolve against the file's package
            package = path.relative_to(SRC).parent.parts
            base = package[: len(package) - node.level + 1]
            found.append((node.lineno, ".".join(("memtrim", *base, *(node.module or "").split(".")))))
    return [(line, name) for line, name in found if name == "memtrim" or name.startswith("memtrim.")]


def _edges() -> list[tuple[str, int, str, str]]:
    edges = []
    for path in sorted(SRC.rglob("*.py")):
        stage = _stage(path)
        for line, module in _imports(path):
            parts = module.split(".")
            target = parts[1] if len(parts) > 1 else "__init__"
            edges.append((str(path.relative_to(SRC)), line, stage, target))
    return edges


def test_every_import_follows_the_pipeline() -> None:
    wrong = []
    for where, line, stage, target in _edges():
        if stage in TOP or target == stage:
            continue
        if target in LEAVES:
            if stage in LEAVES:
                wrong.append(f"{where}:{line}: leaf {stage} imports memtrim.{target}")
            continue
        if stage in LEAVES or target not in ALLOWED.get(stage, set()):
            wrong.append(f"{where}:{line}: {stage} imports memtrim.{target}")
    assert not wrong, "imports that run against the pipeline:\n" + "\n".join(wrong)


def test_the_check_sees_function_local_and_type_checking_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from memtrim.analysis import Analysis\n"
        "def f():\n    import memtrim.report.terminal\n"
    )
    assert [name for _, name in _imports(probe)] == ["memtrim.analysis", "memtrim.report.terminal"]


def test_every_stage_is_known() -> None:
    stages = {_stage(p) for p in SRC.rglob("*.py")}
    unknown = stages - set(ALLOWED) - TOP - LEAVES
    assert not unknown, f"add {sorted(unknown)} to ALLOWED here and to docs/ARCHITECTURE.md"


@pytest.mark.parametrize("name", ["verify", "bench"])
def test_subpackages_are_not_shadowed_by_functions(name: str) -> None:
    import importlib

    package = importlib.import_module(f"memtrim.{name}")
    assert getattr(memtrim, name, package) is package


def test_no_package_attribute_hides_one_of_its_modules() -> None:
    # `memtrim.bench.compare` once named both the function and the module bench/compare.py: the function
    # won, and `import memtrim.bench.compare` gave a module that `memtrim.bench.compare` then did not name.
    import importlib
    import types

    hidden = []
    for init in sorted(SRC.rglob("__init__.py")):
        package_name = ".".join(("memtrim", *init.parent.relative_to(SRC).parts))
        package = importlib.import_module(package_name)
        for child in sorted(init.parent.iterdir()):
            name = child.stem if child.suffix == ".py" else child.name
            if name.startswith("_") or not (child.suffix == ".py" or (child / "__init__.py").exists()):
                continue
            value = getattr(package, name, None)
            if value is not None and not isinstance(value, types.ModuleType):
                hidden.append(
                    f"{package_name}.{name} is {type(value).__name__}, hiding {child.relative_to(SRC)}"
                )
    assert not hidden, "\n".join(hidden)


def test_numpy_is_not_needed_at_run_time() -> None:
    # numpy is not a dependency of memtrim (`pip install memtrim` runs both demos without it): no module
    # imports it and nothing calls Tensor.numpy().
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(name == "numpy" or name.startswith("numpy.") for name in names):
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno}: imports numpy")
            if isinstance(node, ast.Attribute) and node.attr == "numpy":
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno}: calls .numpy()")
    assert not offenders, "\n".join(offenders)


def test_importing_memtrim_imports_no_framework_it_integrates_with() -> None:
    # the integrations are optional extras: `import memtrim` (and its command) must work, and stay as
    # fast, without them
    import subprocess
    import sys

    code = (
        "import sys, memtrim, memtrim.cli, memtrim.integrations, memtrim.integrations.step\n"
        "print(sorted(m for m in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning', 'pytest')"
        " if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_reading_saved_traces_imports_no_torch(tmp_path: Path) -> None:
    # `memtrim show/export/diff` on a saved trace need no tensor: torch's import (about a second) is
    # paid only by the commands and names that record, apply or verify
    import subprocess
    import sys

    import torch

    class Stack(torch.nn.Module):  # repeated blocks: the doctor weighs checkpointing them in FLOPs
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
                for _ in range(3)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    model = Stack()
    with memtrim.track() as trace:
        model(torch.ones(32, 64)).sum().backward()
    from memtrim.doctor.rules.checkpoint import block_recomputes

    blocks = block_recomputes(trace.analysis)["Stack.layers"]
    assert [block.flops for block in blocks] == [2 * (2 * 32 * 64 * 256)] * 3  # two matmuls each
    saved = tmp_path / "step.json"
    trace.save(str(saved))
    commands = [
        ["show", str(saved), "--html", str(tmp_path / "step.html")],
        ["export", str(saved), "--perfetto", str(tmp_path / "step.pftrace")],
        ["export", str(saved), "--memory-viz", str(tmp_path / "step.pickle")],
        ["diff", str(saved), str(saved)],
    ]
    code = (
        "import sys, memtrim, memtrim.cli\n"
        f"for argv in {commands!r}:\n"
        "    assert memtrim.cli.main(argv) == 0, argv\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "torch imported: False"
    assert (tmp_path / "step.html").stat().st_size > 0
    assert (tmp_path / "step.pftrace").stat().st_size > 0
