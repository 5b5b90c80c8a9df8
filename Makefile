# Two commands do all the set-up on a fresh machine:
#   make demo   - a real two-worker training run through a real stella-ps
#   make test   - the test suite (everything; what CI runs)
# and, once set up:
#   make test-fast   - the suite without the long training runs (pytest -m "not slow")
#   make bench-quick - loopback benchmarks, a few minutes, no root needed
#   make docker-test - the docker/README.md walk-through on one machine: images (built when changed),
#                      three sites, shaped links, training, metrics, restarts, refused keys, clean stops
#                      (needs a Docker engine; says why it did not run where none is reachable)
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
NATIVE := $(wildcard native/*.c native/*.h native/isa/*.c native/cdefs/*.h) native/build_cffi.py

# The images install only from this wheelhouse (no index inside a build): the project's
# wheel, built for the portable x86-64 level $(NATIVE_ARCH) (docker/README.md), and its
# dependencies with the CPU torch wheel. Copy it to a site without internet as it is.
WHEELHOUSE ?= docker/wheelhouse
NATIVE_ARCH ?= x86-64-v2

.PHONY: demo example test test-fast lint install bench-quick clean wheelhouse docker-images docker-test

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

# one of examples/ (docs/integrations.md) through its one command: a local stella-ps and two workers,
# e.g. make example NAME=hf_trainer
NAME ?= plain_loop
example: $(STAMP)
	$(PY) examples/$(NAME).py

# lint: ruff over everything Python, mypy over client/, server/ and bench/ (strict on the wire schema and
# the server's policy modules); configured in pyproject.toml; part of `make test`
lint: $(STAMP)
	$(VENV)/bin/ruff check client server bench tests docker examples
	$(VENV)/bin/mypy

# the suite runs on TEST_WORKERS pytest-xdist processes (TEST_WORKERS=0: in one): its tests mostly
# wait (servers starting, steps, timeouts), and conftest.py keeps the slow-link test bed's (shaped
# links, cuts, sleeps: a core mostly idle) on one worker, one at a time, and the tests of a
# module-scoped fixture together; three workers keep the 2-core development machine's cores busy
# (the whole suite: 540 s against 606 s with two, 2026-12-02)
TEST_WORKERS ?= 3
PYTEST_XDIST := -n $(TEST_WORKERS) --dist loadgroup

test: lint
	$(PY) -m pytest -q $(PYTEST_XDIST) tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_XDIST) tests

bench-quick: $(STAMP)
	$(PY) -m bench.pipeline --quick
	$(PY) -m bench.stella_e2e --workload digits --steps 50

wheelhouse: $(WHEELHOUSE)/.complete

$(WHEELHOUSE)/.complete: pyproject.toml setup.py $(NATIVE) $(wildcard client/stella/*.py server/stella_ps/*.py)
	rm -rf $(WHEELHOUSE) build/wheel && mkdir -p $(WHEELHOUSE)
	STELLA_NATIVE_ARCH=$(NATIVE_ARCH) $(PY) -m pip wheel --no-deps --no-build-isolation -w $(WHEELHOUSE) .
	$(PY) -m pip wheel -w $(WHEELHOUSE) "$$(ls $(WHEELHOUSE)/stella-*.whl)[worker,demo]" "torch==$(TORCH_VERSION)"
	@touch $@

# the server and CPU worker images from the wheelhouse, on the base image made with
# debootstrap when no registry is reachable (docker/make-base-image.sh)
docker-images: wheelhouse
	$(PY) docker/lab.py images

docker-test: $(STAMP)
	$(PY) docker/lab.py test

clean:
	rm -rf build *.egg-info client/stella/_native*.so client/stella/_native.c \
	  server/stella_ps/_kernel*.so server/stella_ps/_kernel.c
