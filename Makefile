# One-word targets. `make test` and `make demo` work on a fresh machine: they create .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
EXTRAS := dev,eval,demo,deepspeed

.PHONY: install test test-fast lint demo bench clean

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

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
