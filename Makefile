# Two commands do all the set-up on a fresh machine:
#   make demo   - a real two-worker training run through a real stella-ps
#   make test   - the test suite (everything; what CI runs)
# and, once set up:
#   make test-fast   - the suite without the long training runs (pytest -m "not slow")
#   make bench-quick - loopback benchmarks, a few minutes, no root needed
# Both create .venv, install the dependencies and build the C kernels.
# A torch that is already importable (from the venv or, through
# --system-site-packages, from the interpreter that creates it) is kept, so a
# CUDA build stays; otherwise the CPU build torch==$(TORCH_VERSION) is installed.

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stella-installed
# Production modules: stella._native (client) and stella_ps._kernel (server).
# native/bench/ is compiled on first use by bench/_native_bench.py (into build/).
NATIVE := $(wildcard native/*.c native/*.h native/cdefs/*.h) native/build_cffi.py

.PHONY: demo test test-fast lint install bench-quick clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv --system-site-packages $(VENV)

$(STAMP): $(PY) pyproject.toml setup.py $(NATIVE)
	@$(PY) -c "import torch" 2>/dev/null && echo "using installed torch $$($(PY) -c 'import torch; print(torch.__version__)')" \
	  || $(PY) -m pip install "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -e ".[dev]"
	@touch $@

demo: $(STAMP)
	$(VENV)/bin/stella demo

# lint: ruff and mypy over client/ and server/ (configured in pyproject.toml); part of `make test`
lint: $(STAMP)
	$(VENV)/bin/ruff check client server
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

bench-quick: $(STAMP)
	$(PY) -m bench.pipeline --quick
	$(PY) -m bench.stella_e2e --workload digits --steps 50

clean:
	rm -rf build *.egg-info client/stella/_native*.so client/stella/_native.c \
	  server/stella_ps/_kernel*.so server/stella_ps/_kernel.c
