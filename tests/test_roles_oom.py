"""A real allocation failure (the address space capped with RLIMIT_AS, as ``ulimit -v`` does, in a
subprocess): the trace keeps what the post-mortem needs — the error with the bytes the allocator was
asked for, the failing op and its line, and the roles of what was alive then."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import memtrim
from memtrim.analysis.roles import Role
from memtrim.trace.model import Fact

PROGRAM = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    import memtrim


    class Wasteful(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            scratch = torch.empty(2**30, dtype=torch.float32)  # 4 GiB: beyond the cap
            return g


    torch.manual_seed(0)
    first, second = torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256)
    x = torch.randn(64, 256)

    def step():
        h = Wasteful.apply(first(x))
        second(torch.nn.functional.gelu(h)).sum().backward()

    step()  # warm-up: the allocator, the thread pool and autograd are set up
    first.zero_grad(set_to_none=True)
    second.zero_grad(set_to_none=True)

    def virtual_bytes():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    limit = virtual_bytes() + 256 * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        with memtrim.track() as trace:
            step()
    except RuntimeError as exc:
        print("raised:", type(exc).__name__, file=sys.stderr)
    trace.save(sys.argv[1])
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)
    print(json.dumps({
        "weights": size([*first.parameters(), *second.parameters()]),
        "gradients": size(p.grad for p in (*first.parameters(), *second.parameters()) if p.grad is not None),
        "first_has_grads": any(p.grad is not None for p in first.parameters()),
    }))
    """
)
HUGE_LINE = next(i for i, line in enumerate(PROGRAM.splitlines(), 1) if "scratch = torch.empty" in line)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_out_of_memory_records_the_request_the_op_and_what_was_alive(tmp_path: Path) -> None:
    script, saved = tmp_path / "oom.py", tmp_path / "oom.memtrim.json"
    script.write_text(PROGRAM)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, str(script), str(saved)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "raised:" in done.stderr
    trace = memtrim.load(str(saved))

    assert trace.error is not None
    found = re.search(r"you tried to allocate (\d+) bytes", trace.error)
    assert found and int(found.group(1)) == 2**30 * 4
    op = trace.failed_op
    assert op is not None and op.op == "aten.empty.memory_format"
    assert (op.phase, op.node) == ("backward", "WastefulBackward")
    assert op.site is not None and (op.site.file, op.site.line) == (str(script), HUGE_LINE)

    # alive at the failure, mid-backward: all the weights (from before the region), the gradients
    # autograd had stored by then (the second layer's), and the first GELU's saved input
    program = json.loads(done.stdout)
    assert program["gradients"] > 0 and not program["first_has_grads"]
    alive = trace.analysis.breakdown_at(op.tick)
    assert alive.preexisting[Role.PARAMETER] == program["weights"]
    stored = [a for a in trace.allocations if Fact.GRADIENT in a.facts and a.alive_at(op.tick)]
    assert sum(a.bytes for a in stored) == program["gradients"]
    # (the role also counts what backward made and still held when it failed: GELU's gradient)
    assert alive.made[Role.GRADIENT] >= program["gradients"]
    assert not any(a.bytes == 2**32 for a in trace.allocations)  # the failed request made nothing
