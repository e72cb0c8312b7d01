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
import pytest  # noqa: E402

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
  for item in items:  # `-m "not slow"` (make test-fast) leaves them out
    if item.module.__name__.startswith(_LONG_RUNS):
      item.add_marker(pytest.mark.slow)
  items.sort(key=lambda item: not item.get_closest_marker('slow'))


# CPU seconds per test (`--cpu-durations=N`): the process's own and its
# finished subprocesses' user + system time over setup, call and teardown.
# Unlike pytest's --durations (wall time) it hardly moves when the machine
# is busy, so it tells where the suite's time goes on any machine.


def pytest_addoption(parser):
  parser.addoption('--cpu-durations', type=int, default=None, metavar='N',
                   help='show the N tests that used the most CPU seconds '
                   '(0: all) and the total')


def _cpu_seconds() -> float:
  import resource  # pylint: disable=g-import-not-at-top
  own = resource.getrusage(resource.RUSAGE_SELF)
  kids = resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  del nextitem
  if item.config.getoption('cpu_durations') is None:
    yield
    return
  start = _cpu_seconds()
  item.user_properties.append(('cpu_start', start))
  yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  if item.config.getoption('cpu_durations') is None:
    return
  report = outcome.get_result()
  starts = [v for k, v in item.user_properties if k == 'cpu_start']
  if starts and call.when == 'teardown':
    report.user_properties.append(('cpu_s', _cpu_seconds() - starts[-1]))


_CPU = {}


def pytest_runtest_logreport(report):
  for key, value in getattr(report, 'user_properties', ()):
    if key == 'cpu_s' and report.when == 'teardown':
      _CPU[report.nodeid] = value


def pytest_terminal_summary(terminalreporter, exitstatus, config):
  del exitstatus
  n = config.getoption('cpu_durations')
  if n is None or not _CPU:
    return
  ranked = sorted(_CPU.items(), key=lambda kv: -kv[1])
  total = sum(_CPU.values())
  terminalreporter.section(f'CPU seconds per test (total {total:.0f} s)')
  for nodeid, seconds in ranked[:n or None]:
    terminalreporter.write_line(f'{seconds:8.1f}  {nodeid}')
  modules = {}
  for nodeid, seconds in _CPU.items():
    module = nodeid.split('::')[0]
    modules[module] = modules.get(module, 0.0) + seconds
  terminalreporter.section('CPU seconds per module')
  for module, seconds in sorted(modules.items(), key=lambda kv: -kv[1]):
    terminalreporter.write_line(f'{seconds:8.1f}  {module}')
