# `make demo` and `make test` do all set-up on a fresh machine: they create .venv when missing
# and install memtrim with its dev tools (torch pinned through constraints.txt).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.memtrim-installed

.PHONY: demo test lint typecheck unit bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/memtrim demo
	$(BIN)/memtrim demo gpt

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest

test: lint typecheck unit

bench: $(STAMP)
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/heads.py
	$(BIN)/python bench/gsq.py
	$(BIN)/python bench/verify.py
	$(BIN)/python bench/fixes.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
