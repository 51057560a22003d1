# `make demo` trains the demo GPT with Muon on Megatron-FSDP; `make test` runs the whole suite
# (the GPU tests, which skip without CUDA and say why, then the gloo suite on CPU, whose summary is
# the last line, after its 20 slowest tests: CI reads it; `make test-gpu`: the GPU tests alone);
# `make test-fast` runs the gloo
# suite without the tests marked e2e (the demo, torchrun, Megatron-LM-style scripts) or slow (5 s
# or more on 2 cores), in under 3 minutes on 2 cores;
# `make bench` measures the optimizer step (benchmarks/results/latest.json and .png), each
# rank's peak memory in a train step (benchmarks/results/memory.json and .png) and Gram against
# standard Newton-Schulz (benchmarks/results/gram.json); `make
# bench-demo` times the demo's iterations as megatron.training does, ours beside megatron-core's
# Muon on DDP and Adam (benchmarks/results/demo.json); `make scale`
# estimates it, and the memory per rank, for 8B/70B/DeepSeek-V3/Kimi K2 shapes at W=8..2048 from
# the real planning code and rates
# measured here (SCALE_ARGS="--rates benchmarks/rates/h100.json" for the H100's; with
# benchmarks/scale_tables.py's SCALE_RUN, `python -m benchmarks.scale_tables` then writes
# docs/scale-model.md's tables from it). `make sweep`
# runs every flag of benchmarks/sweep.py's table on Megatron-FSDP against Megatron DDP and writes
# benchmarks/results/sweep.json and docs/flags.md's table (the main suite runs a subset).
# Both create or refresh .venv (Python >= 3.12) whenever setup.py, the ranges
# (megatron_muon/compat/supported_versions.py) or constraints/newest.txt change, at the newest
# release of each dependency range that CI tests (constraints/newest.txt).
# `make test-lowest` runs the tests of what the lowest releases change (LOWEST_TESTS below: the
# compat layer and each path that calls upstream, at W <= 2) at the lowest ones
# (constraints/lowest.txt), in .venv-lowest.
# `make test-bridge` trains through Megatron-Bridge's own loop (tests_bridge/), in .venv-bridge
# (constraints/bridge.txt). `make test-automodel` builds and steps ours as NeMo Automodel's recipe
# does (tests/integrations/test_automodel.py, skipped elsewhere), in .venv-automodel
# (constraints/automodel.txt). `make test-megatron-main MEGATRON_LM=<a Megatron-LM checkout>`
# runs the suite on megatron-core built from that checkout (docs/compatibility.md; not in CI).
SHELL := /bin/bash
VENV := .venv
LOWEST_VENV := .venv-lowest
BRIDGE_VENV := .venv-bridge
AUTOMODEL_VENV := .venv-automodel
MAIN_VENV := .venv-megatron-main
MEGATRON_LM ?=
EMERGING_OPTIMIZERS ?=
PY := $(VENV)/bin/python
RANGES := megatron_muon/compat/supported_versions.py
# make test-lowest: what the lowest releases change, which is the upstream code megatron-muon
# calls. The compat layer's tests (upstream's names and patches, the fixes each decided by a probe
# of the installed code, the CPU layer, Newton-Schulz's precision) and megatron-core's adaptive
# Muon as repaired; then every path that calls upstream: the step on Megatron-FSDP (numerics),
# megatron-core's GPT and Muon (factory), Gram Newton-Schulz in emerging-optimizers' frame and
# against gram-newton-schulz's torch path, DCP checkpoints (resharded too), the standalone
# megatron-fsdp (standalone), torch's fake process group, gloo's collectives (exchange, and the
# flag sweep's rows), and megatron.training (one demo run). Not the plan (pure Python), and not a
# case parametrized at W=4 (--largest-world-size 2): it makes the upstream calls of its W=2 case.
LOWEST_TESTS := tests/compat tests/core/test_adaptive_muon.py tests/core/test_numerics.py \
	tests/core/test_gram_newton_schulz.py \
	tests/integrations/test_factory.py tests/chain/test_checkpoint.py \
	tests/integrations/test_standalone.py tests/test_fake_pg.py tests/distribution/test_exchange.py \
	tests/e2e/test_flag_sweep.py tests/e2e/test_e2e_training.py::test_muon_on_megatron_fsdp_loss_falls
NPROC ?= 2
COMMA := ,
DEMO_ARGS ?=
SCALE_ARGS ?=

PYTHON ?= $(shell for p in python3.12 python3.13 python3.14 python3 python; do \
	if command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; \
	then echo $$p; break; fi; done)

.PHONY: venv demo test test-fast test-lowest test-bridge test-automodel test-megatron-main test-gpu carry-over \
	bench bench-demo scale sweep clean

# uv installs every venv: it keeps one copy of each wheel in its cache (~/.cache/uv) and links
# it into each venv, so torch's CUDA build (about 6 GB with its nvidia-* wheels), which the main,
# Bridge and Automodel venvs all hold at constraints/newest.txt's version, is downloaded and
# unpacked once, not once a venv (pip took about 2 minutes a venv for what uv links in seconds).
# uv itself lives in a venv of its own ($(UV_VENV)): the project's venvs hold what they held
# when pip built them.
UV_VENV := .venv-uv
UV := $(UV_VENV)/bin/uv

define need_python
	@if [ -z "$(PYTHON)" ]; then \
		echo "error: megatron-muon needs Python >= 3.12 (megatron-core and emerging-optimizers require it)."; \
		echo "Install one (e.g. 'pyenv install 3.12' or your distribution's python3.12) and run make again."; \
		exit 1; fi
endef

# A new uv first prunes its cache of the entries nothing reaches any more (older downloads of a
# wheel: 12 GiB of them once): CI's disk ran out once, in its first minute ("No space left on
# device" unpacking torch).
$(UV):
	$(need_python)
	rm -rf $(UV_VENV) && $(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install -q uv
	$(UV) cache prune

# $(1): the venv's folder; $(2): the constraints files that pin what goes in; $(3): what to
# install (pip's arguments). uv reads no pip configuration, so no global cap on torch that a
# machine's pip may have applies: the venv gets the files' versions wherever it is built. It
# compiles the bytecode, as pip does at install: where PYTHONDONTWRITEBYTECODE is set (this
# project's machines have it), every fresh interpreter would otherwise compile each module it
# imports from source, every time (20 s for one that imports megatron_muon, 5 s with bytecode).
define uv_install
	$(UV) pip install -q --compile-bytecode --python $(1)/bin/python $(foreach file,$(2),-c $(file)) $(3)
endef

# A venv of Python's own (with pip, the newest, as its user expects), then uv_install.
define make_venv
	$(need_python)
	@[ -x $(1)/bin/python ] && $(1)/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 12))' || { rm -rf $(1); $(PYTHON) -m venv $(1); }
	$(call uv_install,$(1),$(2),--upgrade pip $(3))
endef

# gram-newton-schulz without its dependencies: the tests hold our Gram Newton-Schulz to its torch
# path, which needs none of its GPU kernels' packages (quack, CUTLASS DSL).
$(VENV)/.installed: setup.py $(RANGES) constraints/newest.txt | $(UV)
	$(call make_venv,$(VENV),constraints/newest.txt,-e '.[test$(COMMA)fsdp]')
	$(call uv_install,$(VENV),constraints/newest.txt,--no-deps gram-newton-schulz)
	touch $@

$(LOWEST_VENV)/.installed: setup.py $(RANGES) constraints/lowest.txt | $(UV)
	$(call make_venv,$(LOWEST_VENV),constraints/lowest.txt,-e '.[test$(COMMA)fsdp]')
	$(call uv_install,$(LOWEST_VENV),constraints/lowest.txt,--no-deps gram-newton-schulz)
	touch $@

# Bridge's wheel without its dependencies (GPU builds, hundreds of packages), then what its
# training loop imports.
$(BRIDGE_VENV)/.installed: setup.py $(RANGES) constraints/newest.txt \
		constraints/bridge.txt | $(UV)
	$(call make_venv,$(BRIDGE_VENV),constraints/newest.txt,-e '.[test]')
	$(call uv_install,$(BRIDGE_VENV),constraints/bridge.txt,--no-deps megatron-bridge)
	$(call uv_install,$(BRIDGE_VENV),constraints/newest.txt constraints/bridge.txt,\
		$$(grep -v '^#\|megatron-bridge' constraints/bridge.txt | cut -d= -f1))
	touch $@

# Automodel's wheel without its dependencies (GPU kernels among them), then what its recipes'
# optimizer, distributed and config code imports, at the versions it pins.
$(AUTOMODEL_VENV)/.installed: setup.py $(RANGES) constraints/newest.txt \
		constraints/automodel.txt | $(UV)
	$(call make_venv,$(AUTOMODEL_VENV),constraints/newest.txt,-e '.[test]')
	$(call uv_install,$(AUTOMODEL_VENV),constraints/automodel.txt,\
		$$(grep -v '^#\|nemo-automodel' constraints/automodel.txt | cut -d= -f1))
	$(call uv_install,$(AUTOMODEL_VENV),constraints/automodel.txt,--no-deps nemo-automodel)
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) examples/pretrain_gpt.py $(DEMO_ARGS)

test: venv
	$(PY) -m pytest -q -rs tests_gpu
	$(PY) -m pytest -q --durations 20 tests

test-fast: venv
	$(PY) -m pytest -q -m "not e2e and not slow" tests

test-lowest: $(LOWEST_VENV)/.installed
	$(LOWEST_VENV)/bin/python -m pytest -q --durations 20 --largest-world-size 2 $(LOWEST_TESTS)

test-bridge: $(BRIDGE_VENV)/.installed
	$(BRIDGE_VENV)/bin/python -m pytest -q --durations 20 tests_bridge

test-automodel: $(AUTOMODEL_VENV)/.installed
	$(AUTOMODEL_VENV)/bin/python -m pytest -q --durations 20 tests/integrations/test_automodel.py

# megatron-core and the standalone megatron-fsdp built from $(MEGATRON_LM)'s source (a Megatron-LM
# checkout, e.g. main), emerging-optimizers from $(EMERGING_OPTIMIZERS) if given, else the
# version constraints/newest.txt pins; torch as newest.txt. Rebuilt on every run (the checkouts
# change); megatron-muon goes in without its own ranges (a source megatron-core may be outside).
test-megatron-main:
	@if [ -z "$(MEGATRON_LM)" ] || [ ! -f "$(MEGATRON_LM)/megatron/core/package_info.py" ]; then \
		echo "error: MEGATRON_LM=<a Megatron-LM checkout> is required, e.g." \
			"git clone https://github.com/NVIDIA/Megatron-LM && make test-megatron-main" \
			"MEGATRON_LM=Megatron-LM (docs/compatibility.md)"; exit 1; fi
	rm -rf $(MAIN_VENV) && $(PYTHON) -m venv $(MAIN_VENV)
	$(MAIN_VENV)/bin/python -m pip install -q --upgrade pip setuptools pybind11 wheel
	PIP_CONSTRAINT=constraints/megatron-main.txt $(MAIN_VENV)/bin/python -m pip install -q \
		torch einops numpy packaging absl-py pytest matplotlib transformers
	$(MAIN_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation \
		"$(abspath $(MEGATRON_LM))" "$(abspath $(MEGATRON_LM))/megatron/core/distributed/fsdp/src" \
		$(if $(EMERGING_OPTIMIZERS),"$(abspath $(EMERGING_OPTIMIZERS))",$$(grep \
		'^emerging-optimizers' constraints/newest.txt))
	$(MAIN_VENV)/bin/python -m pip install -q --no-deps -e .
	$(MAIN_VENV)/bin/python -m pip list 2>/dev/null | grep -E '^(torch|megatron|emerging)'
	$(MAIN_VENV)/bin/python -m pytest -q tests

test-gpu: venv
	$(PY) -m pytest -q -rs --durations 15 tests_gpu

bench: venv
	$(PY) benchmarks/bench_muon_step.py
	$(PY) benchmarks/bench_memory.py
	$(PY) benchmarks/bench_gram.py

bench-demo: venv
	$(PY) benchmarks/bench_demo.py

scale: venv
	$(PY) benchmarks/scale_model.py $(SCALE_ARGS)

sweep: venv
	SWEEP=all $(PY) -m pytest -q tests/e2e/test_flag_sweep.py

carry-over: venv
	CARRY_OVER=all $(PY) -m pytest -q tests/e2e/test_carry_over.py

clean:
	rm -rf $(UV_VENV) $(VENV) $(LOWEST_VENV) $(BRIDGE_VENV) $(AUTOMODEL_VENV) $(MAIN_VENV) *.egg-info
