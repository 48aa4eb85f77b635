# Fresh machine: `make demo` (the main job) or `make test` creates .venv, installs the pinned
# dependencies, builds the extension and runs. torch is installed first and pinned (2.13.0): it is the CPU
# wheel only where the package index serves it; from PyPI's wheels it pulls CUDA packages on Linux. There,
# install the CPU wheel first (`.venv/bin/pip install torch==2.13.0 --index-url
# https://download.pytorch.org/whl/cpu`, or set PIP_INDEX_URL / PIP_EXTRA_INDEX_URL), then `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEPS := $(VENV)/.deps-installed
BUILT := $(VENV)/.extension-built
BUILD_INPUTS := $(shell find csrc -name '*.cpp' -o -name '*.h') csrc/sources.txt setup.py pyproject.toml
# ccache, where installed, makes a rebuild after a one-file change take seconds instead of a minute.
CCACHE := $(shell command -v ccache 2>/dev/null)
BUILD_ENV := $(if $(CCACHE),CC="ccache gcc" CXX="ccache g++",)

.PHONY: demo test bench aot lint build clean gpu-check test-lower-bounds test-sanitize

demo: $(BUILT)
	$(BIN)/python -m sbd_kernels.cli demo

# One pytest process per core (tools/run_tests.py; TRITON_INTERPRET=1 in each).
test: $(BUILT)
	$(BIN)/python tools/run_tests.py

# The demo's JSON feeds the report's accuracy-vs-NFE plot.
bench: $(BUILT)
	mkdir -p bench/results
	$(BIN)/python -m sbd_kernels.cli demo --json bench/results/demo.json
	$(BIN)/python -m sbd_kernels.cli bench

aot: $(BUILT)
	$(BIN)/python -m sbd_kernels.aot

# On a machine with an NVIDIA GPU and a CUDA build of torch and triton already installed: no .venv, nothing
# downloaded. Builds the extension in place with $(PYTHON), then runs the tests on CUDA, the benchmarks on the
# GPU and writes bench/reference/<gpu>/ within 10 minutes on an H100 (`sbd gpu-check --dry-run`: the plan).
# GPU_CHECK_FLAGS="--budget 480" fits the check into less time (the build counts against it: --started-at);
# "--only tests,bench-sampling" runs those stages alone, sharing the budget.
GPU_CHECK_FLAGS ?=
# The clock starts before the CUDA check (importing torch and starting CUDA take seconds), so that --started-at
# puts everything before the check's own stages, its own start-up included, within its budget.
gpu-check:
	@start=$$(date +%s) && \
	$(PYTHON) -c "import sys, torch; torch.cuda.is_available() or sys.exit('make gpu-check: no NVIDIA GPU visible to torch ' + torch.__version__ + '; nothing was built or run')" && \
	env $(BUILD_ENV) $(PYTHON) setup.py -q build_ext --inplace && \
	$(PYTHON) -m sbd_kernels.cli gpu-check --started-at $$start $(GPU_CHECK_FLAGS)

lint: $(DEPS)
	$(BIN)/ruff check sbd_kernels tests bench tools
	$(BIN)/python tools/check_doc_refs.py

build: $(BUILT)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The code task's data: sources read as text, never imported, so their release's Python floor (3.11 for
# transformers 5.23) does not apply (--ignore-requires-python: `make test` on Python 3.10 installs them too).
$(DEPS): $(BIN)/python requirements-dev.txt requirements-corpus.txt
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps --ignore-requires-python --upgrade --target $(VENV)/sbd-code-corpus -r requirements-corpus.txt
	touch $@

# flock: one build at a time in this checkout (concurrent builds would overwrite each other's objects).
$(BUILT): $(DEPS) $(BUILD_INPUTS)
	flock build.lock env $(BUILD_ENV) $(BIN)/pip install -q --no-build-isolation --no-deps -e .
	touch $@

# The suite on the declared lower bounds (requirements-lower.txt; about 4 GB of downloads, not part of CI), in a
# copy of the checkout's tracked files under $(LOWER)/src: the extension is built in place, so it cannot share a
# folder with the .venv build. The code task's data goes beside it, as for .venv (its tests skip without it).
LOWER := .venv-lower
test-lower-bounds:
	test -x $(LOWER)/bin/python || $(PYTHON) -m venv $(LOWER)
	$(LOWER)/bin/pip install -q -r requirements-lower.txt
	$(LOWER)/bin/pip install -q --no-deps --ignore-requires-python --upgrade --target $(LOWER)/sbd-code-corpus -r requirements-corpus.txt
	rm -rf $(LOWER)/src && mkdir -p $(LOWER)/src
	git ls-files -z | tar --null -T - -cf - | tar -xf - -C $(LOWER)/src
	git -C $(LOWER)/src init -q && git -C $(LOWER)/src add -A
	cd $(LOWER)/src && ../bin/pip install -q --no-build-isolation --no-deps -e . && ../bin/python tools/run_tests.py

# The C++ kernels under AddressSanitizer and UndefinedBehaviorSanitizer (tools/sanitize.py): a sanitized build of
# the sources in build/sanitize/src, then the tests that call the kernels (5.2-5.5 minutes on 2 cores).
# SANITIZE_FLAGS=--quick runs the fuzz tests alone (CI, 2.3 minutes with the build).
SANITIZE_FLAGS ?=
test-sanitize: $(DEPS)
	$(BIN)/python tools/sanitize.py $(SANITIZE_FLAGS)

clean:
	rm -rf build sbd_kernels/_C*.so $(BUILT)
