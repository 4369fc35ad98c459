# vit-pipeline: `make test` and `make demo` set up .venv on first use.
#
# torch is installed first and pinned, so GPU users pick their build:
#   make test TORCH_VERSION=2.13.0 TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
PYTHON          ?= python3
TORCH_VERSION   ?= 2.13.0
TORCH_INDEX_URL ?=
DEEPSPEED_VERSION ?= 0.19.8
# test-only: timm's hybrids are what the hybrid ResNet+ViT is checked against (the torchvision
# of the same release as TORCH_VERSION)
TIMM_VERSION    ?= 1.0.31
TORCHVISION_VERSION ?= 0.28.0
PYTEST_ARGS     ?=
# `make test` and `make test-fast` run on this many pytest workers (pytest-xdist), each test file on
# one worker (its module fixtures built once); the suites leave a core idle half the time otherwise.
# Files go out longest first (tests/conftest.py; xdist's own reordering by test count is off).
# 0: one process. The e2e scenarios always run one at a time (clusters, kills, timings).
TEST_WORKERS    ?= 2
XDIST           = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
DEMO_ARGS       ?=

VENV  := .venv
BIN   := $(VENV)/bin
# DeepSpeed's JIT-built CPU ops live in the venv, not in the user-wide ~/.cache/torch_extensions:
# a build is keyed by its include paths, so two checkouts sharing that cache rebuild each other's
# ops (about a minute, inside whichever run loads one first). vitp/train/engine.py uses this
# folder whenever it exists.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch-extensions
# pytest keeps the test modules it rewrote (assertion messages) as bytecode only where Python may
# write bytecode: with PYTHONDONTWRITEBYTECODE set, as on some machines, every run rewrites all of
# them again (5 of `make test-fast`'s 10 s of collection on each worker). Empty = writing allowed.
export PYTHONDONTWRITEBYTECODE :=
# One stamp per torch build: another TORCH_VERSION or TORCH_INDEX_URL (a CUDA wheel index) installs again.
STAMP := $(VENV)/.installed-$(TORCH_VERSION)$(if $(TORCH_INDEX_URL),-$(subst /,_,$(subst :,_,$(TORCH_INDEX_URL))),)
TORCH_INDEX := $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL),)

.PHONY: install browser test test-fast test-e2e test-long test-all demo soak clean

define WARM_DS_OPS
import vitp.train.engine  # where (the venv) and with which ninja the ops are built, as every run does
from deepspeed.accelerator import get_accelerator
acc = get_accelerator()
if acc.device_name() == "cpu":
    for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
        acc.create_op_builder(name).load(verbose=False)
endef
export WARM_DS_OPS

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)" $(TORCH_INDEX)
	echo "torch==$(TORCH_VERSION)" > $(VENV)/constraints.txt
	# DeepSpeed ships only an sdist whose build imports torch: build it against the
	# torch installed above instead of letting pip fetch another one. Ops are JIT-built.
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q --no-build-isolation \
		-c $(VENV)/constraints.txt "deepspeed==$(DEEPSPEED_VERSION)"
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt -e ".[dev,demo]"
	# DeepSpeed's CPU ops (Adam for optimizer offload, shared-memory collectives) are JIT-built on
	# first use, about a minute on 2 cores: built now, into torch's extension cache, not in a run.
	$(BIN)/python -c "$$WARM_DS_OPS"
	# timm and torchvision go into their own folder that only the timm tests put on sys.path
	# (tests/timm_compat.py): the venv itself stays without torchvision, which other packages
	# would import whenever it is present.
	$(BIN)/python -m pip install -q --upgrade --no-deps --target $(VENV)/timm-pkgs \
		"timm==$(TIMM_VERSION)" "torchvision==$(TORCHVISION_VERSION)"
	rm -f $(VENV)/.installed-*  # the stamp of the torch build this replaced
	touch $(STAMP)

# The MLflow UI test drives Debian's headless chromium (no browser can be downloaded at run time);
# where apt is missing it is left to the test, which fails and says how to install one.
browser:
	@command -v chromium >/dev/null || ! command -v apt-get >/dev/null || \
		{ apt-get update -q && apt-get install -y -q chromium; } || \
		{ sudo apt-get update -q && sudo apt-get install -y -q chromium; }

# The default suite; the multi-minute end-to-end scenarios run in test-e2e, and the tests marked
# long (left out of both to fit CI's budgets: tests/tiers.py) in test-long.
test: $(STAMP)
	$(BIN)/python -m pytest -m "not gpu and not e2e and not long" $(XDIST) $(PYTEST_ARGS)

# The inner loop (about 66 s on 2 cores, docs/testing.md): config, model, data decoding, storage,
# tracking on SQLite, CLI parsing; no Ray (tests using a Ray fixture are marked `ray` by
# tests/conftest.py), nothing marked slow (tests on the real MLflow server are, by the same hook,
# and tests that wait out a store cut-off in real time).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not gpu and not e2e and not slow and not ray and not long" $(XDIST) $(PYTEST_ARGS)

test-e2e: $(STAMP)
	$(BIN)/python -m pytest -m "e2e and not gpu and not long" --timeout=600 $(PYTEST_ARGS)

# The tests marked long (about 30 minutes on 2 cores, docs/testing.md): the unit-level ones on the xdist workers,
# then the end-to-end ones one at a time. Run before resolving work that touches what they test.
test-long: $(STAMP) browser
	$(BIN)/python -m pytest -m "long and not gpu and not e2e" $(XDIST) $(PYTEST_ARGS)
	$(BIN)/python -m pytest -m "long and not gpu and e2e" $(PYTEST_ARGS)

test-all: $(STAMP) browser
	$(BIN)/python -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/vitp demo $(DEMO_ARGS)

# The chaos soak (a benchmark, not CI): faults at random while pre-training and a sweep run on a
# three-node local cluster, then the invariants; e.g. make soak SOAK_ARGS="--minutes 20 --seed 1"
soak: $(STAMP)
	$(BIN)/python benchmarks/soak.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
