"""``torchrun --nproc-per-node 2 -m memtrim run -o trace.json train.py``: one trace per rank, rank 0
reports, and ``memtrim show`` on the rank traces puts the ranks side by side."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

import memtrim
from memtrim.units import format_bytes

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch has no torch.distributed")

TRAIN = """
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(3)))
for layer in model:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(256 * (dist.get_rank() + 1), 64)  # rank 1: twice the batch, twice the activations
for _ in range(2):
    optimizer.zero_grad()
    model(x).sum().backward()
    optimizer.step()
dist.destroy_process_group()
"""


def _memtrim(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_torchrun_writes_a_trace_per_rank_and_show_compares_them(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    ran = _memtrim(*torchrun, "-m", "memtrim", "run", "-o", "trace.json", "train.py", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.count("memtrim: peak") == 1  # rank 0 reports; rank 1 is quiet
    assert "2 rank traces written (trace.rank0.json trace.rank1.json)" in ran.stderr
    traces = [memtrim.load(str(tmp_path / f"trace.rank{r}.json")) for r in range(2)]
    for rank, trace in enumerate(traces):
        world = trace.log.metadata["distributed"]
        # (the program ends its process group before the region closes: rank and size from torchrun)
        assert (world["rank"], world["world_size"]) == (rank, 2) and world["run_id"]
    # the same shards on both ranks; rank 1's doubled batch makes its saved activations twice rank 0's
    # (the loss each rank keeps through backward, an activation kept after forward, is one scalar on both)
    activations = [
        sum(a.bytes for a in t.allocations if str(t.role(a)) == "activation" and a.saved) for t in traces
    ]
    assert activations[1] == 2 * activations[0] > 0
    sharded = [sum(a.bytes for a in t.allocations if str(t.role(a)) == "sharded_parameter") for t in traces]
    assert sharded[0] == sharded[1] == 3 * (64 * 64 + 64) * 4 // 2
    assert traces[1].peak_bytes > traces[0].peak_bytes

    shown = _memtrim(
        sys.executable, "-m", "memtrim", "show", "trace.rank1.json", "trace.rank0.json", cwd=tmp_path
    )
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith("2 ranks;")
    assert lines[1].split() == ["rank", "0", "rank", "1"]  # by rank, whatever the order given
    peaks, phases = lines[2].split(), lines[3].split()
    assert peaks[0] == "peak" and phases == ["phase", "backward", "backward"]
    assert [" ".join(peaks[1:3]), " ".join(peaks[3:5])] == [format_bytes(t.peak_bytes) for t in traces]
    assert max(len(line) for line in lines) <= 100, [line for line in lines if len(line) > 100]
    assert "What differs between ranks at their peaks:" in shown.stdout
    assert "activation:" in shown.stdout
    assert "Rank 1 peaks highest; its report:" in shown.stdout
    assert shown.stdout.count("memtrim: peak") == 1
