# Entry points: `make demo` (set up, then run the default experiment),
# `make test` (set up, then run the test suite) and `make docs` (set up with
# the docs extra, then build the HTML docs). All are idempotent.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs
WORKDIR ?= workdirs/demo

.PHONY: setup demo test test-fast docs clean overlap-gpu

setup: $(STAMP)

$(STAMP): pyproject.toml tools/find_python.sh
	@PYBIN=$$(tools/find_python.sh) || exit 1; \
	if [ ! -x $(PY) ] || ! $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then \
	  echo "creating $(VENV) with $$PYBIN"; rm -rf $(VENV); "$$PYBIN" -m venv $(VENV) || exit 1; \
	fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,plot]'  # test includes the train extra
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/loc-opt-train --config=diloco_lm --workdir=$(WORKDIR)

# What XLA's GPU compiler schedules while each sync is in flight, compiled for
# 4 H100s without a GPU (docs/overlap.md). JAX's CUDA plugin goes into a venv
# of its own, as in the project's one it would make the launcher take the
# GPU defaults; same versions of jax, flax, optax as the project's.
CUDA_VENV ?= .venv-cuda
overlap-gpu: setup
	test -x $(CUDA_VENV)/bin/python || $(PY) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/pip install -q $$($(PY) -c 'import importlib.metadata as m; \
	  print(" ".join(f"{p}=={m.version(p)}" for p in ("flax", "optax", "ml_collections", "absl-py")))') \
	  "jax[cuda13]==$$($(PY) -c 'import jax; print(jax.__version__)')"
	JAX_PLATFORMS=cpu PYTHONPATH=. $(CUDA_VENV)/bin/python -m experiments.overlap_gpu \
	  --workdir=$(WORKDIR)/overlap_gpu --target_config=experiments/reference/h100_target_config.pbtxt

# Two pytest processes (pytest-xdist): the suite is mostly XLA compiles,
# which run one per process. TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests

# A subset for iteration, not what CI runs: leaves out the end-to-end runs
# of the trainer, the notebooks and the plots (marked slow in tests/conftest.py).
test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m 'not slow' tests

# The docs toolchain (Sphinx, MyST-NB, the theme) is installed here only, so
# `make test` does not need it.
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[docs]'
	@touch $(DOCS_STAMP)

# HTML in docs/_build/html, built from scratch; any warning fails the build.
# The notebooks in colabs/ are rendered as stored, not executed.
docs: $(DOCS_STAMP)
	rm -rf docs/_build
	$(PY) -m sphinx -b html -W --keep-going -q -j auto docs docs/_build/html

clean:
	rm -rf $(VENV) workdirs docs/_build
