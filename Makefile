# `make bench` runs the default benchmark on this machine; `make test` runs the suite.
# Both install what they need first.

PYTHON ?= python3
VENV ?= .venv
# Only used when no torch is importable: this is the CPU build that lies on the dev machines.
# A machine that already has torch (e.g. a CUDA image) keeps its own build.
TORCH_SPEC ?= torch==2.13.0

HAVE_TORCH := $(shell $(PYTHON) -c "import torch" >/dev/null 2>&1 && echo yes)
ifeq ($(HAVE_TORCH),yes)
PY := $(PYTHON)
else
PY := $(VENV)/bin/python
endif
STAMP := .stamp-install-$(subst /,_,$(PY))

# The frameworks the suite runs beside torch, each in its own cached environment, built before
# the suite. --cpu: a CPU build is enough, so a CUDA build already there is kept. OneFlow's
# (about 4 GB: `trainperf env list`) needs Python 3.8-3.10: where none is found it is skipped
# with a line saying so, and so are its tests.
TEST_ENVS ?= mxnet paddle jax tf oneflow

.PHONY: install envs slurm browser bench test clean gpu-check docs

CORE_STAMP := .stamp-core-$(subst /,_,$(PY))

# What `make bench` needs: trainperf, what it cannot run without (torch, numpy, rich, psutil),
# matplotlib for the report's plots and scipy for its intervals. Where those extras cannot be
# installed (a CUDA image without network) the report goes without them rather than failing.
$(CORE_STAMP): pyproject.toml
ifneq ($(HAVE_TORCH),yes)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)"
endif
	$(PY) -c "import setuptools" 2>/dev/null || $(PY) -m pip install setuptools
	$(PY) -m pip install --no-build-isolation -e ".[plot,stats]" || \
		$(PY) -m pip install --no-build-isolation -e .
	touch $@

# The suite's extras on top: pytest, matplotlib, the decoders, uv.
$(STAMP): $(CORE_STAMP)
	$(PY) -m pip install --no-build-isolation -e ".[test,plot,data]"
	touch $@

install: $(STAMP)

bench: $(CORE_STAMP)
	$(PY) -m trainperf.cli bench

envs: install
	$(PY) -m trainperf.cli env create $(TEST_ENVS) --cpu --where-possible

# `make gpu-check [PART=N] [GPUCHECK_OUT=DIR] [GPUCHECK_WORK=DIR]`: the offline GPU check (trainperf gpucheck); the
# CPU mode's tiny sizes where no GPU is usable. On a machine whose Python already has torch (a
# lent GPU machine, offline) trainperf goes in without its dependencies and without the network
# (pip install --no-deps --no-build-isolation -e .), and only where this checkout is not what
# that Python imports already; where even that fails, the source folder is put on the path.
GPUCHECK_ARGS = $(if $(PART),--part $(PART)) $(if $(GPUCHECK_OUT),--out $(GPUCHECK_OUT)) \
	$(if $(GPUCHECK_WORK),--work $(GPUCHECK_WORK))
SRC_IMPORTED = $(PY) -c "import os, sys, trainperf; sys.exit(os.path.realpath(trainperf.__file__) != os.path.realpath('src/trainperf/__init__.py'))"

ifeq ($(HAVE_TORCH),yes)
gpu-check:
	@$(SRC_IMPORTED) 2>/dev/null || $(PY) -m pip install --quiet --no-deps \
		--no-build-isolation -e . || echo "gpu-check: pip could not install trainperf; running it from src/"
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m trainperf.cli gpucheck $(GPUCHECK_ARGS)
else
gpu-check: install
	$(PY) -m trainperf.cli gpucheck $(GPUCHECK_ARGS)
endif

# Debian's slurm-wlm and munge for tests/test_slurm.py's single-host Slurm, installed here so
# apt's time is not the suite's. Best effort: where they cannot be installed (no root, no apt)
# that test skips and says why.
slurm: install
	-$(PY) tests/slurm_host.py install

# Debian's chromium for tests/test_compare.py's look at the history page in a real browser;
# best effort like Slurm.
browser: install
	-$(PY) tests/browser_host.py install

# Three test files at a time, even on 2 cores: much of the suite waits (on timeouts it tests,
# on shaped links, on processes starting and stopping): with two files at a time a fresh
# `make test` kept 161% of the two cores' 200% busy. A file's tests stay together in one
# process, so each module's shared runs are made once.
TEST_WORKERS ?= 3

test: envs slurm browser
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

# The documentation site, in strict mode as the suite builds it: into build/site/.
docs: install
	$(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) .stamp-install-* .stamp-core-* bench-results
