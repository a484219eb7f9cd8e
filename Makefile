# `make demo` and `make test` do all set-up on a fresh machine (Python >= 3.10 with venv).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PARITY := $(VENV)/bin/parity
STAMP  := $(VENV)/.installed
OUT    := build

.PHONY: install demo test bench clean

install: $(STAMP)

# torch: the CPU build from local disk when none is importable (a plain `torch` pulls a
# multi-GB CUDA build); then triton and the project with its test extras, editable.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,triton]'
	touch $@

# The gate on the default suite (ci), with the HTML report.
demo: $(STAMP)
	$(PARITY) gate --no-progress --jobs 2 --json $(OUT)/demo.jsonl --html $(OUT)/report.html --md $(OUT)/report.md
	@echo "HTML report: $(OUT)/report.html"

# Self-tests and property tests (derandomized), then the gate on the ci suite.
test: $(STAMP)
	PARITY_PROFILE=ci $(PY) -m pytest -q -p no:cacheprovider
	$(PARITY) gate --suite ci --no-progress -q --jobs 2 --json $(OUT)/ci.jsonl --junit $(OUT)/ci.xml --html $(OUT)/ci.html

bench: $(STAMP)
	$(PY) -m pytest -q benchmarks --benchmark-only -p no:cacheprovider

clean:
	rm -rf $(OUT) .pytest_cache .hypothesis
