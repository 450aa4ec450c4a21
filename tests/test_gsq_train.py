"""GSQ end-to-end: beats round-to-nearest, reproducible, CLI JSON, 2-process data parallel == 1 process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from memtrim.cases.gsq import Lion, TrainConfig, main, minmax_scales, mse_scales, rtn_2bit, run

SRC = str(Path(__file__).resolve().parents[1] / "src")
SMALL = TrainConfig(hidden=64, intermediate=128, tokens=1024, heldout_tokens=256, group_size=32, steps=150)
TINY = ["--hidden", "32", "--intermediate", "64", "--tokens", "256", "--heldout-tokens", "64"]
TINY += ["--group-size", "16", "--steps", "12"]


def test_trained_hard_weights_beat_round_to_nearest_and_reproduce():
    first = run(SMALL)
    assert first["hard_mse"] < 0.6 * first["rtn_mse"]
    assert first["heldout_hard_mse"] < first["heldout_rtn_mse"]
    assert first["final_loss"] < first["first_loss"]
    again = run(SMALL)
    assert again["hard_weights_sha256"] == first["hard_weights_sha256"]
    assert again["hard_mse"] == first["hard_mse"]
    other_seed = run(replace(SMALL, seed=1, steps=10))
    assert other_seed["hard_weights_sha256"] != run(replace(SMALL, steps=10))["hard_weights_sha256"]


def test_variants_and_adam_train_identically_where_they_should():
    lean = run(replace(SMALL, steps=20, optimizer="adam"))
    original = run(replace(SMALL, steps=20, optimizer="adam", backward="original"))
    assert lean["hard_weights_sha256"] == original["hard_weights_sha256"]
    assert lean["final_loss"] == original["final_loss"]


def test_cli_json_prints_one_object(capsys):
    assert main([*TINY, "--json"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out)
    assert out.count("\n") == 1
    assert {"hard_mse", "rtn_mse", "hard_weights_sha256", "seconds"} <= summary.keys()
    assert summary["config"]["steps"] == 12


def test_cli_reports_bad_configuration(capsys):
    assert main([*TINY, "--shards", "3"]) == 2
    assert "tokens=256 must divide into shards=3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*TINY, "--optimizer", "sgd"])
    assert "invalid choice: 'sgd'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'; use 'lion' or 'adam'"):
        run(replace(SMALL, optimizer="sgd"))
    with pytest.raises(ValueError, match="shards=2 but the world size is 4: each rank takes one shard"):
        replace(SMALL).validate(world_size=4)


def test_export_round_trips(tmp_path):
    from memtrim.cases.gsq import unpack_2bit

    path = tmp_path / "gsq.pt"
    assert main([*TINY, "--export", str(path)]) == 0
    saved = torch.load(path)
    for layer in saved["layers"].values():
        codes = unpack_2bit(layer["codes_2bit"]).float()
        out_f, in_f = layer["shape"]
        scales = layer["scales"].unsqueeze(-1)
        rebuilt = (codes.view(out_f, -1, layer["group_size"]) * scales).view(out_f, in_f)
        assert torch.equal(rebuilt, layer["hard_weights"])


def test_scales_and_round_to_nearest():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    s = minmax_scales(w, 16)
    ratio = w.view(16, 4, 16) / s.unsqueeze(-1)
    assert ratio.min() >= -2 - 1e-6 and ratio.max() <= 1 + 1e-6
    codes = rtn_2bit(w, s, 16).view(16, 4, 16) / s.unsqueeze(-1)
    assert torch.equal(codes, codes.round()) and codes.min() >= -2 and codes.max() <= 1
    err = lambda sc: (rtn_2bit(w, sc, 16) - w).square().view(16, 4, 16).sum(-1)  # noqa: E731
    assert (err(mse_scales(w, 16)) <= err(s)).all()


def test_lion_step_matches_its_definition():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.0)
    p.grad = torch.tensor([0.3, -0.1, 0.0])
    opt.step()
    assert torch.equal(p.detach(), torch.tensor([0.9, -1.9, 0.5]))
    assert torch.allclose(opt.state[p]["exp_avg"], torch.tensor([0.003, -0.001, 0.0]))


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo unavailable"
)
def test_torchrun_two_processes_equal_one_process(tmp_path):
    args = [*TINY, "--steps", "25", "--json"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "memtrim.cases.gsq", *args, "--export", str(tmp_path / "dp.pt")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout  # only rank 0 prints
    parallel = json.loads(lines[0])
    assert parallel["world_size"] == 2

    # The single-process run with the same global batch (split into the same 2 shards, summed in order).
    solo = run(TrainConfig(**parallel["config"]), export=str(tmp_path / "single.pt"))
    assert solo["world_size"] == 1
    for key in ("hard_weights_sha256", "hard_mse", "rtn_mse", "first_loss", "final_loss"):
        assert parallel[key] == solo[key], key
    dp, single = torch.load(tmp_path / "dp.pt"), torch.load(tmp_path / "single.pt")
    for name in single["layers"]:
        for key in ("hard_weights", "scales", "codes_2bit"):
            assert torch.equal(dp["layers"][name][key], single["layers"][name][key]), (name, key)


def test_run_leaves_the_callers_rng_and_thread_count_alone():
    torch.manual_seed(5)
    state, threads = torch.get_rng_state(), torch.get_num_threads()
    run(replace(SMALL, steps=3, threads=1))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.get_num_threads() == threads
