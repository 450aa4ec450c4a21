"""Which frames are the user's: the standard library and chosen library roots are skipped like torch,
and the classification caches hold no code object alive."""

from __future__ import annotations

import copy
import gc
import importlib.util
import sys
import weakref
from pathlib import Path

import torch
from groundtruth import profiler_memory

import memtrim
from memtrim.capture import frames


def _line(marker: str) -> int:
    """The line of this file holding ``marker`` (a comment at the end of the line)."""
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.rstrip().endswith(marker))


def test_a_deepcopy_is_blamed_on_the_line_that_called_it() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    with profiler_memory() as truth, memtrim.track() as trace:
        clone = copy.deepcopy(model)  # <- deepcopy
    made = [a for a in trace.allocations if not a.preexisting]
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(a.bytes for a in made) == param_bytes == sum(truth.allocated_sizes)
    assert {(a.file, a.line) for a in made} == {(__file__, _line("# <- deepcopy"))}
    assert all(not a.function or a.function != "deepcopy" for a in made)
    del clone


class _Squares(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((256,), float(i))


def test_batches_from_dataloader_workers_name_no_standard_library_line() -> None:
    loader = torch.utils.data.DataLoader(_Squares(), batch_size=2, num_workers=1)
    with memtrim.track() as trace:
        total = [batch.square().sum() for batch in loader]  # <- loop
    assert len(total) == 2
    sites = {a.site for a in trace.allocations if a.site is not None}
    assert sites, "the squares were recorded"
    stdlib = frames._STDLIB
    assert not [s for s in sites if s.file.startswith(stdlib)]
    squares = [a for a in trace.allocations if a.op == "aten.pow.Tensor_Scalar"]
    assert [a.bytes for a in squares] == [2 * 256 * 4] * 2
    assert {(a.file, a.line) for a in squares} == {(__file__, _line("# <- loop"))}


def test_library_roots_are_skipped_like_torch(tmp_path: Path) -> None:
    library = tmp_path / "somelib"
    library.mkdir()
    (library / "ops.py").write_text("import torch\n\n\ndef doubled(n):\n    return torch.ones(n) * 2\n")
    spec = importlib.util.spec_from_file_location("somelib_ops", library / "ops.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def run() -> memtrim.Trace:
        with memtrim.track() as trace:
            module.doubled(1000)  # <- library call
        return trace

    inside = run()
    assert {(a.file, a.line) for a in inside.allocations} == {(str(library / "ops.py"), 5)}
    try:
        frames.set_library_roots([str(library)])
        assert frames.library_roots() == (str(library) + "/",)
        skipped = run()
    finally:
        frames.set_library_roots([])
    assert {(a.file, a.line) for a in skipped.allocations} == {(__file__, _line("# <- library call"))}
    assert [a.bytes for a in skipped.allocations] == [a.bytes for a in inside.allocations] == [4000, 4000]
    assert run().allocations[0].file == str(library / "ops.py")  # the default is back


def test_a_deprecated_torch_function_is_blamed_on_the_line_that_called_it() -> None:
    # torch wraps dist.all_gather_into_tensor and dist.reduce_scatter_tensor in typing_extensions'
    # @deprecated, an installed package: its wrapper's frame is not the user's line
    import warnings

    from typing_extensions import deprecated

    relu = deprecated("use something else")(torch.nn.functional.relu)  # torch's Python function
    x = torch.randn(1000)
    with warnings.catch_warnings(), memtrim.track() as trace:
        warnings.simplefilter("ignore")
        relu(x)  # <- deprecated call
    (made,) = [a for a in trace.allocations if not a.preexisting]
    assert (made.file, made.line) == (__file__, _line("# <- deprecated call"))


def test_site_packages_lists_existing_folders() -> None:
    folders = frames.site_packages()
    assert folders and all(Path(f).is_dir() for f in folders)
    assert any(Path(torch.__file__).is_relative_to(f) for f in folders) or not any(
        "site-packages" in p for p in sys.path
    )


def test_regions_over_fresh_functions_hold_no_code_object() -> None:
    # 2000 regions, each over a function compiled afresh (as exec'd or generated code is): every code
    # object goes with its function, and a reused id never names the earlier one's file.
    x = torch.randn(10)
    codes: list[weakref.ref[object]] = []
    kinds_before = len(frames._kinds)
    for i in range(2000):
        namespace: dict[str, object] = {}
        exec(compile(f"def fresh(x):\n    return x * {i + 2}\n", f"<fresh {i}>", "exec"), namespace)
        fresh = namespace.pop("fresh")
        with memtrim.capture.record() as log:
            fresh(x)  # type: ignore[operator]
        (made,) = [a for a in log.allocations if not a.preexisting]
        assert (made.file, made.line, made.function) == (f"<fresh {i}>", 2, "fresh")
        codes.append(weakref.ref(fresh.__code__))  # type: ignore[attr-defined]
        del fresh, namespace, log, made
    gc.collect()
    assert sum(ref() is not None for ref in codes) == 0
    assert len(frames._kinds) - kinds_before < 50


def test_code_kinds_torch_engine_stdlib_user() -> None:
    assert frames._classify(torch.nn.Module.zero_grad.__code__) == frames.INTERNAL
    assert frames._classify(torch.autograd.backward.__code__) == frames.ENGINE
    assert frames._classify(copy.deepcopy.__code__) == frames.INTERNAL
    assert frames._classify(_line.__code__) == frames.USER
