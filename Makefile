# `make demo` trains the demo GPT with Muon on Megatron-FSDP; `make test` runs the whole suite
# (the GPU tests, which skip without CUDA and say why, then the gloo suite on CPU, whose summary is
# the last line: CI reads it; `make test-gpu`: the GPU tests alone);
# `make bench` measures the optimizer step (benchmarks/results/latest.json and .png); `make
# bench-demo` times the demo's iterations as megatron.training does, ours beside megatron-core's
# Muon on DDP and Adam (benchmarks/results/demo.json); `make scale`
# estimates it for 8B/70B/DeepSeek-V3 shapes at W=8..1024 from the real planning code and rates
# measured here (SCALE_ARGS="--rates benchmarks/rates/h100.json" for the H100's).
# Both create or refresh .venv (Python >= 3.12) whenever setup.py changes.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
NPROC ?= 2
DEMO_ARGS ?=
SCALE_ARGS ?=

PYTHON ?= $(shell for p in python3.12 python3.13 python3.14 python3 python; do \
	if command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; \
	then echo $$p; break; fi; done)

.PHONY: venv demo test test-gpu bench bench-demo scale clean

$(VENV)/.installed: setup.py
	@if [ -z "$(PYTHON)" ]; then \
		echo "error: megatron-muon needs Python >= 3.12 (megatron-core and emerging-optimizers require it)."; \
		echo "Install one (e.g. 'pyenv install 3.12' or your distribution's python3.12) and run make again."; \
		exit 1; fi
	@[ -x $(PY) ] && $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 12))' || { rm -rf $(VENV); $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) examples/pretrain_gpt.py $(DEMO_ARGS)

test: venv
	$(PY) -m pytest -q -rs tests_gpu
	$(PY) -m pytest -q tests

test-gpu: venv
	$(PY) -m pytest -q -rs tests_gpu

bench: venv
	$(PY) benchmarks/bench_muon_step.py

bench-demo: venv
	$(PY) benchmarks/bench_demo.py

scale: venv
	$(PY) benchmarks/scale_model.py $(SCALE_ARGS)

clean:
	rm -rf $(VENV) *.egg-info
