# Entry points: `make demo` (set up, then run the default experiment),
# `make test` (set up, then run the test suite) and `make docs` (set up with
# the docs extra, then build the HTML docs). All are idempotent.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs
WORKDIR ?= workdirs/demo

.PHONY: setup demo test docs clean

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
