"""Every docstring example in memtrim runs, and says what it shows."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import memtrim

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(memtrim.__path__, "memtrim.")
    if not info.name.endswith("__main__")  # importing one runs it
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples in {name} failed"
