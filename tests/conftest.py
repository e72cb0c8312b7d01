"""Test setup: 8 virtual CPU devices, set before any JAX backend use.

The suite is almost all XLA compiles of small programs, so it compiles
with ``jax_disable_most_optimizations`` (XLA's backend optimization level 0
and no expensive LLVM passes): about a third less CPU time per compile.
XLA's HLO passes (SPMD partitioning, collective placement) still run, so
the collectives and bytes that the tests read from compiled programs are
those of a default build; numerics comparisons run both sides under the
same setting. Subprocesses (the multi-process and preemption tests)
inherit it through the environment. Set ``JAX_DISABLE_MOST_OPTIMIZATIONS=0``
to run the suite with default optimization.

Many tests compile the same programs (the tiny trainer's steps, the same
transform on the same mesh), so the run shares one persistent XLA
compilation cache between all its processes (the xdist workers and the
subprocesses of the multi-process tests inherit its directory through the
environment): a program compiled once is read back by every later test.
The cache is keyed by the HLO, the compile options and the versions, so a
hit is the same executable; the directory is new for each run and removed
at its end. Set ``JAX_COMPILATION_CACHE_DIR`` to keep one across runs.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('JAX_DISABLE_MOST_OPTIMIZATIONS', '1')
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:  # the first process
  _CACHE = tempfile.mkdtemp(prefix='loc_opt_tests_xla_cache_')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _CACHE
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '-1')

import jax  # noqa: E402

jax.config.update('jax_num_cpu_devices', 8)


# Modules whose tests run the trainer or notebooks end to end.
_LONG_RUNS = ('tests.train.', 'tests.test_colabs', 'tests.test_plot')


def pytest_collection_modifyitems(config, items):
  """Modules that run the trainer end to end go first.

  pytest-xdist hands tests out in collection order, so the minute-long runs
  start early and the many short tests fill in at the end, instead of one
  process finishing a long run alone while the other idles. Each module's
  tests stay together (module fixtures are built once) and in file order.
  """
  del config
  items.sort(key=lambda item: not (
      item.module.__name__.startswith(_LONG_RUNS) or
      item.get_closest_marker('slow')))
