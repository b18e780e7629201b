# One venv for everything. On CPU machines torch==2.13.0 installs the CPU build that lies on disk;
# triton is pinned to the GPU machine's version so the interpreter and the GPU run one compiler.
VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
TRITON ?= triton==3.6.0
PY     := $(VENV)/bin/python
K3     := $(VENV)/bin/k3

.PHONY: setup test test-slow test-gpu train lint clean
.DEFAULT_GOAL := help

help:
	@echo "make train   set up the venv and train k3-toy (AttnRes block) on the stdlib corpus, 400 steps"
	@echo "make test    set up the venv and run the test suite (Triton kernels via the CPU interpreter)"
	@echo "make lint    ruff"

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" "$(TRITON)"
	$(PY) -m pip install -q -e ".[dev,plot,wandb,eval]"
	touch $@

# TRITON_INTERPRET must be set before Python starts: @triton.jit decides at import time.
# both cores (pytest-xdist); the slow tier (sm_90 compiles, multi-process, compile, long interpreter cases) runs in CI after it
test: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n 2 -m "not gpu and not slow"

test-slow: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n 2 -m "slow and not gpu"

test-gpu: setup
	$(PY) -m pytest -q

# k3-toy on a 400-step schedule (the preset's is 1000 steps; it is also the GPU benchmark): ~4 min on an idle 2-core CPU
train: setup
	$(K3) train --preset k3-toy --attnres block --steps 400

lint: setup
	$(VENV)/bin/ruff check k3cli tests

clean:
	rm -rf $(VENV) .pytest_cache
