# Two commands do all the set-up on a fresh machine:
#   make demo   - a real two-worker training run through a real stella-ps
#   make test   - the test suite
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

.PHONY: demo test install clean

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

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf build *.egg-info client/stella/_native*.so client/stella/_native.c \
	  server/stella_ps/_kernel*.so server/stella_ps/_kernel.c
