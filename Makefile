# `make demo` and `make test` do all set-up on a fresh machine: they create .venv when missing
# and install memtrim with its dev tools (torch pinned through constraints.txt).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.memtrim-installed

.PHONY: demo test lint typecheck unit verify-paths bench browser images clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/memtrim demo
	$(BIN)/memtrim demo gpt
	$(BIN)/memtrim fit --budget 160MiB -m memtrim.cases.gpt_train

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP) browser
	$(BIN)/python -m pytest

# verify's rounding budgets must hold for torch's AVX2 and scalar kernels too, not only this CPU's best
# path: the verify tests again under each (a CPU without AVX-512 or AVX2 runs the best it has).
verify-paths: $(STAMP)
	ATEN_CPU_CAPABILITY=avx2 $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_verify_*.py
	ATEN_CPU_CAPABILITY=default $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_verify_*.py

# The HTML report is tested in headless Chromium (Debian's package). Installed when missing and when
# this machine can (root and apt); otherwise the browser tests say why they are skipped.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
	      || echo "make: could not install chromium; the browser tests will be skipped"; \
	    else echo "make: no chromium and no root apt-get; the browser tests will be skipped"; fi; }

# README pictures from real runs: docs/report.png (the HTML report in Chromium) and docs/timeline.png
images: $(STAMP) browser
	$(BIN)/python docs/make_images.py

test: lint typecheck unit verify-paths

bench: $(STAMP)
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/recorder_cost.py
	$(BIN)/python bench/heads.py
	$(BIN)/python bench/gsq.py
	$(BIN)/python bench/verify.py
	$(BIN)/python bench/fixes.py
	$(BIN)/python bench/diagnose.py
	$(BIN)/python bench/views.py
	$(BIN)/python bench/doctor_gpt2.py
	$(BIN)/python bench/doctor_fsdp.py
	$(BIN)/python bench/doctor_tp.py
	$(BIN)/python bench/doctor_ddp.py
	$(BIN)/python bench/fit.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
