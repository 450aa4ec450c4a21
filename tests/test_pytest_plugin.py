"""The pytest plugin (``@pytest.mark.memtrim``, the ``memtrim_trace`` fixture, ``--memtrim-dir``) run
on test files of its own through pytest's ``pytester``; the byte figures it reports are checked against
torch.profiler and the sizes of the tests' own tensors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from groundtruth import profiler_memory

import memtrim
from memtrim.analysis.roles import Role
from memtrim.integrations.budget import Budget, BudgetError, read_marker
from memtrim.units import format_bytes

pytest_plugins = ("pytester",)

MiB = 2**20


@pytest.fixture(autouse=True, scope="module")
def _modules_imported_once() -> None:
    """pytester's in-process runs drop the modules a run imported: torch's lazily imported ones
    (``torch._inductor.test_operators`` registers an op library, once per process) must be imported
    here, out of its reach, before the first run."""
    with memtrim.track(fake=True):
        torch.nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()
    with memtrim.track():
        torch.nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()


LIMITS = textwrap.dedent(
    """\
    import pytest
    import torch

    def blocks():
        a = torch.ones(1024, 1024)
        b = torch.ones(512, 1024)
        return (a.numel() * a.element_size(), b.numel() * b.element_size())

    @pytest.mark.memtrim(peak="5 MiB")
    def test_over():
        blocks()

    @pytest.mark.memtrim(peak=8 * 2**20)
    def test_under():
        blocks()
    """
)


def _blocks_truth() -> tuple[int, tuple[int, int]]:
    """The peak torch.profiler sees for LIMITS's ``blocks()``, and its tensors' sizes."""
    space: dict[str, object] = {}
    exec(compile(LIMITS, "limits", "exec"), space)
    with profiler_memory() as truth:
        sizes = space["blocks"]()  # type: ignore[operator]
    return truth.peak, sizes


def test_one_test_over_its_limit_fails_naming_limit_peak_and_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_limits=LIMITS)
    result = pytester.runpytest()
    assert result.ret == 1
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    peak, sizes = _blocks_truth()
    assert peak == sum(sizes) == 6 * MiB
    assert f"the test's peak was limited to 5 MiB ({5 * MiB:,} B) but reached 6 MiB ({peak:,} B)" in out
    # the top lines alive at the peak: bytes, role, the test file's own line, op
    over = out[out.index("_ test_over _") :]
    lines = [line.split() for line in over.splitlines() if "test_limits.py:" in line]
    assert [(w[0], w[1], w[2], w[3].split("/")[-1], w[-1]) for w in lines[:2]] == [
        ("4", "MiB", "temporary", "test_limits.py:5", "aten.ones.default"),
        ("2", "MiB", "temporary", "test_limits.py:6", "aten.ones.default"),
    ]
    assert sizes == (4 * MiB, 2 * MiB)
    assert "_ test_under _" not in out


TRAIN_STEP = textwrap.dedent(
    """\
    import pytest
    import torch

    def train_step():
        layer = torch.nn.Linear(512, 512)
        optimizer = torch.optim.AdamW(layer.parameters(), foreach=False)
        layer(torch.ones(8, 512)).sum().backward()
        optimizer.step()
        return optimizer

    @pytest.mark.memtrim(peak="4 MiB")
    def test_step():
        train_step()
    """
)


def test_the_failure_ends_with_the_first_finding(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_step=TRAIN_STEP)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    space: dict[str, object] = {}
    exec(compile(TRAIN_STEP, "train_step", "exec"), space)
    with profiler_memory() as truth:
        optimizer = space["train_step"]()  # type: ignore[operator]
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    out = result.stdout.str()
    assert f"but reached 6.01 MiB ({truth.peak:,} B) on cpu" in out
    # AdamW's moments (made in the step) and its temporaries, alive together at the peak
    assert (
        f"test_step.py:8 in train_step  aten.zeros_like.default ({format_bytes(state)} optimizer_state, "
        in out
    )
    assert "How to cut it (the first finding):\n  - " in out
    assert "    write: construct the optimizer with fused=True" in out
    assert "    peak after: 6.01 MiB -> " in out and "[optimizer-step]" in out


def test_a_role_limit_reads_that_roles_bytes_at_the_peak(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_roles="""
        import pytest
        import torch

        @pytest.mark.memtrim(peak="1 MiB", role="parameter")
        def test_weights():
            layer = torch.nn.Linear(1024, 512)
            layer(torch.ones(4, 1024)).sum().backward()

        @pytest.mark.memtrim(peak="1 MiB", role="optimizer_state")
        def test_no_optimizer():
            layer = torch.nn.Linear(1024, 512)
            layer(torch.ones(4, 1024)).sum().backward()
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    weights = (1024 * 512 + 512) * 4  # the Linear's weight and bias, float32
    assert (
        f"parameter bytes at the peak were limited to 1 MiB ({MiB:,} B) but were 2 MiB ({weights:,} B)"
        in result.stdout.str()
    )


def test_fake_runs_a_model_too_large_for_this_machine(pytester: pytest.Pytester) -> None:
    # 160 Linear layers of 8192x8192 float32: 1.07e10 weights, 40 GiB that nothing allocates (the CI
    # machine has 24 GiB)
    pytester.makepyfile(
        test_fake="""
        import pytest
        import torch
        from torch._subclasses.fake_tensor import FakeTensor

        def build():
            dims = [(8192, 8192)] * 160
            return torch.nn.Sequential(*[torch.nn.Linear(i, o, bias=False) for i, o in dims])

        @pytest.mark.memtrim(peak="41 GiB", fake=True)
        def test_fits(memtrim_trace):
            model = build()
            params = list(model.parameters())
            assert all(isinstance(p, FakeTensor) for p in params)
            assert memtrim_trace.peak_bytes == sum(p.numel() * p.element_size() for p in params)

        @pytest.mark.memtrim(peak="39.5 GiB", fake=True)
        def test_does_not_fit():
            build()
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    weights = 160 * 8192 * 8192 * 4
    assert weights == 40 * 2**30
    out = result.stdout.str()
    assert f"limited to 39.5 GiB ({int(39.5 * 2**30):,} B) but reached 40 GiB ({weights:,} B) on cpu" in out
    assert "(fake tensors: nothing was allocated)" in out
    assert "test_fake.py:7 in " in out  # the list comprehension (named build on Python 3.12+)


def test_the_fixture_is_the_body_s_trace_and_the_dir_keeps_json_and_html(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_fixture="""
        import pytest
        import torch

        def test_reads_its_own_trace(memtrim_trace):
            x = torch.ones(256)
            assert memtrim_trace.peak_bytes == 1024
            y = torch.ones(512)
            assert memtrim_trace.peak_bytes == 1024 + 2048

        @pytest.mark.memtrim(peak="1 KiB")
        def test_over():
            x = torch.ones(1024)

        def test_unmarked():
            x = torch.ones(1024)

        @pytest.fixture
        def early(memtrim_trace):
            return memtrim_trace.peak_bytes

        def test_fixture_of_a_fixture(early):
            pass
        """
    )
    result = pytester.runpytest("--memtrim-dir", "traces")
    result.assert_outcomes(passed=2, failed=1, errors=1)
    out = result.stdout.str()
    assert "memtrim_trace is the trace of the test's own body: ask for it in the test function" in out
    names = sorted(p.name for p in (pytester.path / "traces").iterdir())
    assert names == [
        "test_fixture.py_test_over.html",
        "test_fixture.py_test_over.json",
        "test_fixture.py_test_reads_its_own_trace.html",
        "test_fixture.py_test_reads_its_own_trace.json",
    ]
    saved = memtrim.load(str(pytester.path / "traces" / "test_fixture.py_test_over.json"))
    assert saved.peak_bytes == 4096
    assert json.loads((pytester.path / "traces" / "test_fixture.py_test_over.json").read_text())["schema"]
    html = (pytester.path / "traces" / "test_fixture.py_test_over.html").read_text()
    assert html.lstrip().lower().startswith("<!doctype html")


def test_bad_markers_are_setup_errors_naming_the_fix(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_bad="""
        import pytest

        @pytest.mark.memtrim(peak="lots")
        def test_size(): pass

        @pytest.mark.memtrim(peak="1 MiB", role="weights")
        def test_role(): pass

        @pytest.mark.memtrim(limit="1 MiB")
        def test_argument(): pass

        @pytest.mark.memtrim(role="activation")
        def test_role_alone(): pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=4)
    out = result.stdout.str()
    assert "@pytest.mark.memtrim: peak: not a memory budget: 'lots' (write it like 24GiB" in out
    assert "role must be one of parameter," in out and "activation" in out and "got 'weights'" in out
    assert "unknown argument 'limit': the marker is memtrim(peak=None, *, role=None, fake=False)" in out
    assert "role='activation' limits that role's bytes: give the limit too" in out
    assert "During handling" not in out


@pytest.mark.parametrize(
    ("args", "kwargs", "peak"),
    [
        (("24 MiB",), {}, 24 * MiB),
        ((), {"peak": "1.5GB"}, 1_500_000_000),
        ((), {"peak": 4096}, 4096),
        ((), {"peak": "2GiB"}, 2 * 2**30),
    ],
)
def test_marker_sizes(args: tuple[object, ...], kwargs: dict[str, object], peak: int) -> None:
    assert read_marker(args, kwargs) == Budget(peak=peak)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"peak": True}, "peak must be a size like"),
        ({"peak": 0}, "peak: "),
        ({"peak": -1}, "peak: "),
        ({"peak": 1.5}, "peak must be a size like"),
        ({"peak": "1 MiB", "fake": "yes"}, "fake must be True or False; got 'yes'"),
        ({"peak": "1 MiB", "role": 3}, "role must be one of parameter,"),
    ],
)
def test_marker_refuses(kwargs: dict[str, object], says: str) -> None:
    with pytest.raises(BudgetError, match=re.escape(says)):
        read_marker((), kwargs)


@pytest.mark.parametrize("role", list(Role))
def test_every_role_can_be_limited(role: Role) -> None:
    assert read_marker((), {"peak": "1 MiB", "role": role.value}) == Budget(peak=MiB, role=role)


def test_loading_the_plugin_imports_neither_torch_nor_memtrim() -> None:
    code = "import sys, _memtrim_pytestplugin; print(sorted({m.split('.')[0] for m in sys.modules}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(eval(out))
    assert "_memtrim_pytestplugin" in loaded and "pytest" in loaded
    assert not loaded & {"torch", "memtrim"}


def test_the_plugin_is_registered_through_pytest11(pytestconfig: pytest.Config) -> None:
    assert pytestconfig.pluginmanager.has_plugin("memtrim")
    assert torch.ones(1).numel() == 1  # an unmarked test: the plugin left it alone


def test_a_run_without_the_marker_imports_neither_torch_nor_memtrim(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_plain="""
        import sys

        def test_plain(request):
            assert request.config.pluginmanager.has_plugin("memtrim")
            assert not {"torch", "memtrim"} & {m.split(".")[0] for m in sys.modules}
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_a_unittest_method_is_limited_too(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_case="""
        import unittest

        import pytest
        import torch

        class Blocks(unittest.TestCase):
            @pytest.mark.memtrim(peak="3 MiB")
            def test_over(self):
                a = torch.ones(1024, 1024)

            @pytest.mark.memtrim(peak="5 MiB")
            def test_under(self):
                a = torch.ones(1024, 1024)
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    assert f"limited to 3 MiB ({3 * MiB:,} B) but reached 4 MiB ({4 * MiB:,} B)" in result.stdout.str()
    assert "test_case.py:9 in test_over  aten.ones.default" in result.stdout.str()
