"""``memtrim fit`` and ``memtrim run --plan``, run as a user would: the plan it prints and writes, the
re-measured peak against torch.profiler's allocation events for the same script run inside
``memtrim.applied(plan)``, the numeric check (bit for bit, a plan that changes the numbers, a script
that is not deterministic), exit statuses 0, 1, 2 and 3."""

from __future__ import annotations

import json
import runpy
import textwrap
from pathlib import Path

import pytest
from groundtruth import profiler_memory
from test_cli import memtrim

import memtrim as mt

STACK = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(64, 512)
            self.down = nn.Linear(512, 64)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, 64)
    for step in range(2):
        loss = model(x).square().mean() * SCALE
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    """
)
HONEST = STACK.replace("SCALE", "1.0")
# a program whose numbers depend on whether its first block is checkpointed: the check must catch it
SENSITIVE = STACK.replace("SCALE", '(1.5 if "forward" in model[0].__dict__ else 1.0)')
# seeded from the clock: two runs differ with or without a plan
UNSEEDED = HONEST.replace("torch.manual_seed(0)", "import time; torch.manual_seed(time.time_ns())")
BUDGET = 6 * 2**20  # between what checkpointing one block and two blocks reach (6.46 MiB unplanned)


def _profiled(script: Path, plan: mt.Plan | None) -> int:
    with profiler_memory() as truth:
        if plan is None:
            runpy.run_path(str(script), run_name="__main__")
        else:
            with mt.applied(plan):
                runpy.run_path(str(script), run_name="__main__")
    return truth.peak_in_window


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, int]:
    folder = tmp_path_factory.mktemp("fit")
    (folder / "stack.py").write_text(HONEST)
    done = memtrim("fit", "--budget", f"{BUDGET}", "-o", "plan.json", "stack.py", cwd=folder)
    return folder, done.stdout + done.stderr, done.returncode


def test_fit_prints_writes_and_re_measures_a_plan_the_profiler_confirms(
    fitted: tuple[Path, str, int],
) -> None:
    folder, output, status = fitted
    assert status == 0, output
    plan = mt.load_plan(str(folder / "plan.json"))
    assert [lever.lever for lever in plan.levers] == ["checkpoint"] and plan.levers[0].keeps == "exact"
    assert plan.predicted_peak <= BUDGET < plan.baseline_peak
    assert plan.measured_peak is not None and plan.measured_peak <= BUDGET
    for text in ("lever", "checkpoint", "Pareto front", "memtrim.fixes.checkpoint_modules(model, ['0'])"):
        assert text in output
    assert f"measured peak {mt.units.format_bytes(plan.measured_peak)}" in output
    assert "within budget" in output
    # ground truth: the script's own allocations, with and without the plan, seen by torch.profiler
    script = folder / "stack.py"
    unplanned, planned = _profiled(script, None), _profiled(script, plan)
    print(
        f"baseline {plan.baseline_peak} profiled {unplanned}; "
        f"predicted {plan.predicted_peak} profiled {planned}"
    )
    assert abs(unplanned - plan.baseline_peak) <= 0.05 * unplanned
    assert abs(planned - plan.predicted_peak) <= 0.05 * planned
    assert planned <= BUDGET * 1.01


def test_the_numeric_check_compares_losses_gradients_and_parameters_bit_for_bit(
    fitted: tuple[Path, str, int],
) -> None:
    folder, output, _ = fitted
    numerics = json.loads((folder / "plan.json").read_text())["numerics"]
    assert numerics["verdict"] == "pass"
    assert numerics["max_differences"] == {"loss": 0.0, "gradients": 0.0, "parameters": 0.0}
    # two steps' losses; 4 blocks x (2 weights + 2 biases)
    assert "2 loss(es), 16 gradients, 16 parameters" in numerics["note"]
    assert "numeric check: pass" in output


def test_run_with_a_saved_plan_applies_it(fitted: tuple[Path, str, int]) -> None:
    folder, _, _ = fitted
    plan = mt.load_plan(str(folder / "plan.json"))
    done = memtrim("run", "--plan", "plan.json", "--json", "-o", "t.json", "stack.py", cwd=folder)
    assert done.returncode == 0, done.stderr
    assert "1 lever(s) applied" in done.stderr
    assert json.loads(done.stdout)["bytes"] == plan.measured_peak
    bad = memtrim("run", "--plan", "t.json", "stack.py", cwd=folder)  # a trace, not a plan
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "not a memtrim plan" in bad.stderr


def test_a_plan_that_changes_the_numbers_is_not_safe(tmp_path: Path) -> None:
    (tmp_path / "sensitive.py").write_text(SENSITIVE)
    done = memtrim("fit", "--budget", f"{BUDGET}", "-o", "plan.json", "sensitive.py", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "numeric check: fail" in done.stdout
    numerics = json.loads((tmp_path / "plan.json").read_text())["numerics"]
    assert numerics["verdict"] == "fail" and numerics["max_differences"]["loss"] > 0


def test_a_script_that_is_not_deterministic_cannot_be_checked(tmp_path: Path) -> None:
    (tmp_path / "unseeded.py").write_text(UNSEEDED)
    done = memtrim("fit", "--budget", f"{BUDGET}", "-o", "plan.json", "unseeded.py", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    numerics = json.loads((tmp_path / "plan.json").read_text())["numerics"]
    assert numerics["verdict"] == "not-run" and "not deterministic" in numerics["note"]


def test_no_plan_fits_says_the_floor_in_one_paragraph_and_bad_input_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "stack.py").write_text(HONEST)
    done = memtrim("fit", "--budget", "1MiB", "stack.py", cwd=tmp_path)
    assert done.returncode == 3
    assert done.stdout.startswith("no plan fits 1 MiB") and done.stdout.count("\n") == 1
    assert "optimizer_state" in done.stdout and "Traceback" not in done.stdout + done.stderr
    for argv, said in (
        (("fit", "--budget", "lots", "stack.py"), "not a memory budget"),
        (("fit", "stack.py"), "give the memory budget"),
        (("fit", "--budget", "1GiB", "missing.py"), "no such script"),
    ):
        bad = memtrim(*argv, cwd=tmp_path)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and said in bad.stderr, bad.stderr


def test_fit_of_a_region_records_its_entries_and_says_what_was_alive_before(tmp_path: Path) -> None:
    head, loop = HONEST.split("for step in range(2):")
    body = "".join(f"    {line}\n" for line in loop.strip("\n").splitlines())
    looped = head + "import memtrim\nfor step in range(3):\n    with memtrim.region('step'):\n" + body
    (tmp_path / "loop.py").write_text(looped)
    done = memtrim(
        "fit", "--budget", "2.5MiB", "--region", "step", "-o", "plan.json", "loop.py", cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    plan = mt.load_plan(str(tmp_path / "plan.json"))
    assert plan.measured_peak is not None and plan.measured_peak <= 2.5 * 2**20
    # the parameters (4 blocks of two 64x512 weights and their biases), AdamW's two states of each and
    # its 16 step counters (0-dim float32), the input x
    params = 4 * (2 * 64 * 512 + 512 + 64) * 4
    before = 3 * params + 16 * 4 + 256 * 64 * 4
    assert f"{mt.units.format_bytes(before)} of tensors it used were alive before" in done.stdout
    assert "3 loss(es)" in plan.numerics.note and plan.numerics.verdict == "pass"


# the same stack, its size from the command line: a full-size config fitted on fake tensors, a small one
# for the numeric check
SIZED = HONEST.replace(
    "model = nn.Sequential(*[Block() for _ in range(4)])",
    "import sys\nmodel = nn.Sequential(*[Block() for _ in range(int(sys.argv[1]))])",
).replace("x = torch.randn(256, 64)", "x = torch.randn(int(sys.argv[2]), 64)")


@pytest.mark.parametrize("scale", ["1.0", '(1.5 if "forward" in model[0].__dict__ else 1.0)'])
def test_a_fake_fit_checks_its_numbers_on_the_small_config_given_with_it(tmp_path: Path, scale: str) -> None:
    """``--fake --check-args``: the plan is fitted and re-measured on fake tensors of the full-size
    config, and its numeric check runs the small config on real tensors without and with the plan: bit
    for bit for the honest program, a failure (exit status 1) for one whose numbers change when its
    first block is checkpointed. The report says where the check ran and what the plan did there."""
    (tmp_path / "stack.py").write_text(SIZED.replace("* 1.0", f"* {scale}"))
    fit = ("fit", "--fake", "--check-args", "2 32", "--budget", f"{BUDGET}", "-o", "plan.json")
    done = memtrim(*fit, "stack.py", "4", "256", cwd=tmp_path)
    output = done.stdout + done.stderr
    plan = mt.load_plan(str(tmp_path / "plan.json"))
    assert {lever.lever for lever in plan.levers} >= {"checkpoint"}, output
    assert "on real tensors of the small config (arguments '2 32'), not the full-size program" in output
    assert "without the plan" in plan.numerics.note and "with it" in plan.numerics.note
    if scale == "1.0":
        assert done.returncode == 0, output
        assert plan.numerics.verdict == "pass", plan.numerics
        assert "that run: bit for bit (2 loss(es), 8 gradients" in plan.numerics.note  # 2 blocks, 2 steps
    else:
        assert done.returncode == 1, output
        assert plan.numerics.verdict == "fail", plan.numerics
        assert plan.numerics.max_differences["loss"] > 0


def test_check_args_without_fake_is_refused_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "stack.py").write_text(HONEST)
    done = memtrim("fit", "--check-args", "2 32", "--budget", f"{BUDGET}", "stack.py", cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "drop --check-args or add --fake" in done.stderr


def test_fit_under_fake_measures_the_plan_on_fake_tensors_as_the_profiler_does_on_real_ones(
    tmp_path: Path,
) -> None:
    # fake tensors allocate nothing, but a CPU program's fake storages have the real sizes: the peak
    # re-measured under --fake is the one torch.profiler sees when the plan runs on real tensors
    (tmp_path / "stack.py").write_text(HONEST)
    done = memtrim("fit", "--fake", "--budget", f"{BUDGET}", "-o", "plan.json", "stack.py", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "numeric check: not-run — measured on fake tensors" in done.stdout
    plan = mt.load_plan(str(tmp_path / "plan.json"))
    assert plan.numerics.verdict == "not-run"
    assert {lever.lever for lever in plan.levers} >= {"checkpoint"}
    real = _profiled(tmp_path / "stack.py", plan)
    assert plan.measured_peak is not None
    assert abs(plan.measured_peak - real) <= 0.01 * real, (plan.measured_peak, real)
