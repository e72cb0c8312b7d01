# Two entry points: `make demo` (set up, then run the default experiment) and
# `make test` (set up, then run the test suite). Both are idempotent.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKDIR ?= workdirs/demo

.PHONY: setup demo test clean

setup: $(STAMP)

$(STAMP): pyproject.toml tools/find_python.sh
	@PYBIN=$$(tools/find_python.sh) || exit 1; \
	if [ ! -x $(PY) ] || ! $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then \
	  echo "creating $(VENV) with $$PYBIN"; rm -rf $(VENV); "$$PYBIN" -m venv $(VENV) || exit 1; \
	fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,plot]'
	@touch $(STAMP)

demo: setup
	$(PY) -m experiments.train --config=configs/diloco_lm.py --workdir=$(WORKDIR)

# Two pytest processes (pytest-xdist): the suite is mostly XLA compiles,
# which run one per process. TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests

clean:
	rm -rf $(VENV) workdirs
