"""torch.compile under tracking: a tracked compiled call records the eager program (and says so), and
the user's compiled code is exactly as it was after the region."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
from groundtruth import memtrim_deltas, profiler_memory

import memtrim
from memtrim.capture.compiled import NOTE, NOTE_KEY


def program(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.cos(torch.sin(2 * x) * 3) * 4).sum()


class Counting:
    """A dynamo backend that runs the captured graph as is and counts compiles and compiled runs."""

    def __init__(self) -> None:
        self.compiles = 0
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.compiles += 1

        def run(*args: Any) -> Any:
            self.runs += 1
            return gm(*args)

        return run


def test_a_tracked_call_runs_eagerly_and_the_function_stays_compiled() -> None:
    backend = Counting()
    compiled = torch.compile(program, backend=backend)
    x = torch.randn(1 << 16)
    compiled(x)
    assert (backend.compiles, backend.runs) == (1, 1)
    with profiler_memory() as truth, memtrim.track() as trace:
        tracked = compiled(x)
    assert (backend.compiles, backend.runs) == (1, 1)  # the eager program ran, and was recorded
    assert memtrim_deltas(trace) == truth.deltas and trace.peak_bytes == truth.peak
    assert trace.peak_bytes >= 2 * x.numel() * x.element_size()  # the eager temporaries
    assert trace.log.metadata[NOTE_KEY] == NOTE
    assert torch.equal(tracked, program(x))
    compiled(x)
    assert (backend.compiles, backend.runs) == (1, 2)  # the cached compiled code, not de-compiled
    fresh = Counting()
    torch.compile(program, backend=fresh)(x)
    assert (fresh.compiles, fresh.runs) == (1, 1)  # and the code is not marked to be skipped


def test_compiling_a_module_inside_the_region() -> None:
    backend = Counting()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    with memtrim.track() as trace:
        compiled = torch.compile(model, backend=backend)
        compiled(x).sum().backward()
    assert backend.compiles == 0
    assert any(a.op == "aten.addmm.default" for a in trace.allocations)
    compiled(x)
    assert (backend.compiles, backend.runs) == (1, 1)


def test_the_stance_the_program_set_is_kept() -> None:
    from torch._dynamo import eval_frame

    backend = Counting()
    compiled = torch.compile(program, backend=backend)
    x = torch.randn(100)
    with torch.compiler.set_stance("eager_on_recompile"):
        with memtrim.track():
            compiled(x)
        assert eval_frame._stance.stance == "eager_on_recompile"
        compiled(x)  # no compiled code yet, and this stance does not compile: eager
    assert eval_frame._stance.stance == "default"
    assert backend.compiles == 0
    compiled(x)
    assert backend.compiles == 1


def test_compile_first_imported_inside_the_region() -> None:
    # memtrim does not import dynamo itself (2 s, 70 MiB); a program whose torch.compile imports it
    # inside the region is covered by an import hook.
    script = textwrap.dedent(
        """
        import json, sys, torch, memtrim
        assert "torch._dynamo" not in sys.modules
        compiles = []
        def backend(gm, inputs):
            compiles.append(1)
            return gm
        def f(x):
            return (x.sin() * 2).sum()
        x = torch.randn(1000)
        with memtrim.track() as trace:
            compiled = torch.compile(f, backend=backend)
            compiled(x)
        during = len(compiles)
        compiled(x)
        print(json.dumps({"during": during, "after": len(compiles),
                          "note": trace.log.metadata.get("torch_compile") is not None,
                          "hook": any(type(f).__name__ == "_DynamoImportWatch" for f in sys.meta_path)}))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "during": 0,
        "after": 1,
        "note": True,
        "hook": False,
    }


@pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="inductor needs a C++ compiler"
)
def test_inductor_code_keeps_its_peak_after_the_region() -> None:
    compiled = torch.compile(program)
    x = torch.randn(1 << 18)  # 1 MiB
    compiled(x)
    with profiler_memory() as before:
        compiled(x)
    with memtrim.track() as trace:
        compiled(x)
    with profiler_memory() as after:
        compiled(x)
    assert after.peak == before.peak < x.numel() * x.element_size()  # fused: no full-size temporary
    assert trace.peak_bytes >= 2 * x.numel() * x.element_size()  # the eager program, recorded
