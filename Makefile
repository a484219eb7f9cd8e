# `make demo` and `make test` do all set-up on a fresh machine (Python >= 3.10 with venv).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PARITY := $(VENV)/bin/parity
STAMP  := $(VENV)/.installed
OUT    := build
LIBGGML := $(CURDIR)/$(OUT)/ggml

.PHONY: install demo test bench ggml clean

install: $(STAMP)

# torch: the CPU build from local disk when none is importable (a plain `torch` pulls a
# multi-GB CUDA build); then triton and the project with its test extras, editable.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,triton]'
	touch $@

# The gate on the default suite (ci), with the HTML report (and the libggml peer, built once).
demo: $(STAMP) $(OUT)/ggml/.built
	KERNEL_PARITY_LIBGGML=$(LIBGGML) $(PARITY) gate --no-progress --jobs 2 --json $(OUT)/demo.jsonl --html $(OUT)/report.html --md $(OUT)/report.md
	@echo "HTML report: $(OUT)/report.html"

# Each pytest worker on one thread (NumPy's BLAS, torch's intra-op pool): two workers on two cores, not four
# threads fighting for them (property_tests gemm + mla: 97 s -> 75 s). The gate's workers set the same themselves.
ONE_THREAD := OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1

# Self-tests and property tests (derandomized), then the gate on the ci suite, with the libggml peer
# built first (cached in build/ggml): its tests and gate cases run, they do not skip; headless Chromium
# (Debian's `chromium`) is installed when missing, for the report's browser test. A skip whose reason is
# not that the machine lacks a GPU (or cannot install Chromium) fails `make test` (PARITY_STRICT_SKIPS).
# --no-loadscope-reorder: the workers take the files slowest first (conftest.py's SLOW_FILES), not by test count.
test: $(STAMP) $(OUT)/ggml/.built
	command -v chromium >/dev/null || command -v chromium-browser >/dev/null || { timeout 120 apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -q --no-install-recommends chromium; } || \
	  echo "chromium could not be installed: the browser test will skip saying so"
	KERNEL_PARITY_LIBGGML=$(LIBGGML) PARITY_STRICT_SKIPS=1 PARITY_PROFILE=ci $(ONE_THREAD) $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --durations=25
	KERNEL_PARITY_LIBGGML=$(LIBGGML) $(PARITY) gate --suite ci --no-progress -q --jobs 2 --json $(OUT)/ci.jsonl --junit $(OUT)/ci.xml --html $(OUT)/ci.html

bench: $(STAMP)
	$(PY) -m pytest -q benchmarks --benchmark-only -p no:cacheprovider

# libggml (llama.cpp's ggml, CPU backend) for the `ggml` plugin backend: built from the llama.cpp
# sources vendored in the llama-cpp-python sdist (cmake and a C/C++ compiler; a few minutes on 2
# cores). Then: KERNEL_PARITY_LIBGGML=$(OUT)/ggml .venv/bin/parity run --backend ggml ...
GGML_SDIST ?= llama-cpp-python==0.3.36
$(OUT)/ggml/.built:
	$(MAKE) ggml
	touch $@

ggml: $(STAMP)
	rm -rf $(OUT)/ggml-src && mkdir -p $(OUT)/ggml-src
	$(PY) -m pip download -q --no-deps --no-binary :all: $(GGML_SDIST) -d $(OUT)/ggml-src
	tar -xzf $(OUT)/ggml-src/*.tar.gz -C $(OUT)/ggml-src
	cd $(OUT)/ggml-src/*/vendor/llama.cpp/ggml && touch -a ggml.pc.in && \
	  cmake -S . -B $(CURDIR)/$(OUT)/ggml -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX2=ON \
	    -DGGML_FMA=ON -DGGML_F16C=ON -DBUILD_SHARED_LIBS=ON -DGGML_OPENMP=OFF -DGGML_BUILD_TESTS=OFF \
	    -DGGML_BUILD_EXAMPLES=OFF >/dev/null && cmake --build $(CURDIR)/$(OUT)/ggml -j2 >/dev/null
	@echo "export KERNEL_PARITY_LIBGGML=$(CURDIR)/$(OUT)/ggml"

clean:
	rm -rf $(OUT) .pytest_cache .hypothesis
