"""Issue 13's acceptance corpus: correct rewrites pass in every dtype, layout and seed; wrong ones fail
with a message naming what is wrong. The rewrites themselves are in ``verify_corpus.py``."""

from __future__ import annotations

from typing import Any

import pytest
from verify_corpus import CORRECT, WRONG

from memtrim.verify import verify

QUIET: dict[str, Any] = {"memory": False, "progress": False}


def _inputs(spec: Any) -> Any:
    return spec() if spec.__code__.co_argcount == 0 else spec


def test_the_corpus_is_as_large_as_the_issue_asks() -> None:
    assert len(CORRECT) >= 20 and len(WRONG) >= 20


@pytest.mark.parametrize("name", CORRECT)
def test_correct_rewrite_passes_in_every_dtype_layout_and_seed(name: str) -> None:
    reference, candidate, inputs = CORRECT[name]
    r = verify(reference, candidate, _inputs(inputs), **QUIET)  # fp64/fp32/fp16/bf16 x 4 layouts x 3 seeds
    r.assert_ok()
    assert len(r.cases) == 48 and not r.failures
    for c in r.cases:  # an update written into an expanded (stride-0) input is rejected by torch itself
        assert c.status == "passed" or (c.case.layout == "expanded" and "reference rejects" in c.note), c
    assert not any("could not be derived" in n for n in r.notes)  # judged per element everywhere


@pytest.mark.parametrize("name", WRONG)
def test_wrong_rewrite_fails_naming_what_is_wrong(name: str) -> None:
    reference, candidate, inputs, needle, kwargs = WRONG[name]
    r = verify(reference, candidate, _inputs(inputs), seeds=(0,), **QUIET, **kwargs)
    assert not r.passed and r.failures
    first = r.failures[0]
    assert needle in first.message, first.message
    assert f"(case {first.case})" in first.message
