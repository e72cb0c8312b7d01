r"""Where the CPU inner step's time goes, op by op, on one core.

For each model size of ``experiments.benchmark_step_time`` (issue 20's
459k, 853k and 1.48M LMs, ``_runs.LM_SIZES``: 4 workers, H = 10, fp32,
AdamW inside), a child process builds the launcher's inner step with the
workers stacked on one CPU device (``benchmark_step_time.STACKED_ARGS``,
its fastest layout),
times ``--steps`` steps, then traces ``--steps`` more with ``jax.profiler``
and adds up the time of every XLA op by what it computes. The child is
bound to one CPU (``os.sched_setaffinity`` before JAX starts), so XLA:CPU
runs one compute thread and the ops' times add up to the step (the rest,
``outside ops``, is dispatch, the profiler and the host). A second child
times the same step on all the CPUs.

What an op computes is read from the compiled HLO: a fusion holding a dot
is a matmul (its FLOPs from the dot's shapes), split into the attention's
(under the model's ``attention_core`` named scope, with the softmax XLA
fuses into them) and the dense layers' (every other); every other op goes
by the named scope of its metadata (``loc_opt.models.transformer`` and
``loc_opt.train.programs`` name the attention core, the norms, GELU, the
embedding, the head and loss, the optimizer update and the non-finite
guard; XLA fuses AdamW's arithmetic into the guard's select, so the two
are one row). A lone batched matmul of the MLP's shape, timed on the same
core, gives the kernel's rate to set the matmul rows beside.

  python -m experiments.profile_step --workdir=DIR [--sizes=853k,1.48M] \
    [--steps=10]
"""

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _profile
from experiments import _runs
from experiments import _train_tables
from experiments import tables

_SIZES = flags.DEFINE_list('sizes', list(_runs.LM_SIZES),
                           f'Model sizes, of {list(_runs.LM_SIZES)}.')
_STEPS = flags.DEFINE_integer('steps', 10,
                              'Steps timed, then as many profiled (>= 2).')
_WORKDIR = flags.DEFINE_string(
    'workdir', '/tmp/profile_step',
    'Write the results file profile_step.json here.')
_CONFIG = config_flags.DEFINE_config_file('config', 'configs/diloco_lm.py',
                                          'Config file.')
# Internal: the child process's size and CPUs ('one' or 'all').
_CHILD = flags.DEFINE_string('child', '', 'Internal: SIZE:one or SIZE:all.')


def _op_times(step, state, batch, steps: int, names: set[str]
              ) -> tuple[dict, float]:
  """(instruction name -> ms per step, wall ms per traced step) from
  a trace of ``steps`` steps: the ops among ``names`` on XLA's threads,
  overlapping time shared (``_profile.shared_times``)."""
  import jax  # pylint: disable=g-import-not-at-top
  intervals = []
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      t = time.perf_counter()
      for _ in range(steps):
        state, loss = step(state, batch)
        loss.block_until_ready()
      wall_ms = (time.perf_counter() - t) * 1e3 / steps
    path = next(pathlib.Path(trace_dir).rglob('*.xplane.pb'))
    data = jax.profiler.ProfileData.from_file(str(path))
    for plane in data.planes:
      for line in plane.lines:
        if line.name.startswith('tf_XLA'):
          intervals += [(e.start_ns, e.end_ns, e.name) for e in line.events
                        if e.name in names]
  op_ms = {name: ns / 1e6 / steps
           for name, ns in _profile.shared_times(intervals).items()}
  return op_ms, wall_ms


def _lone_matmul_gflops(d_model: int, d_ff: int, workers: int,
                        tokens: int) -> float:
  """GFLOP/s of a lone batched ``[W, N, d] x [W, d, f]`` matmul (the MLP's
  up projection, workers stacked), median of 30 runs."""
  import jax  # pylint: disable=g-import-not-at-top
  key = jax.random.PRNGKey(0)
  x = jax.random.normal(key, (workers, tokens, d_model))
  w = jax.random.normal(key, (workers, d_model, d_ff))
  f = jax.jit(lambda x, w: x @ w)
  f(x, w).block_until_ready()
  times = []
  for _ in range(30):
    t = time.perf_counter()
    f(x, w).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * workers * tokens * d_model * d_ff / statistics.median(times) / 1e9


def _child(size: str, cpus: str, config, steps: int) -> dict:
  """Builds, times (and on one CPU profiles) the stacked inner step."""
  if cpus == 'one':
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
  _runs.setup(1)
  from loc_opt.train import config as cfg_lib  # pylint: disable=g-import-not-at-top
  layers, d_model = _runs.LM_SIZES[size]
  config = cfg_lib.with_overrides(config, {
      'model.num_layers': layers, 'model.d_model': d_model,
      'mesh.simulate_workers': True, 'mesh.data': 1,
      'outer.method': 'diloco', 'outer.sync_every': 10})
  exp, (step, state, batch) = _runs.inner_step(config)
  times = _runs.time_alternating({'step': (step, state, batch)}, rounds=1,
                                 block=steps, warmup=2)['step']
  out = {'size': size, 'cpus': len(os.sched_getaffinity(0)),
         'median_step_ms': statistics.median(times) * 1e3,
         'tokens': config.batch_size * config.data.seq_len,
         'num_params': exp.model.num_params}
  if cpus == 'one':
    hlo = step.as_text()
    names = {m.group(1) for m in _profile.INSTRUCTION.finditer(hlo)}
    # The timed steps donated ``state``: the trace starts from a fresh one.
    op_ms, out['traced_step_ms'] = _op_times(
        step, exp.init_state(), batch, steps, names)
    out['categories'] = _profile.categorize(hlo, op_ms)
    out['lone_matmul_gflops'] = _lone_matmul_gflops(
        d_model, config.model.d_ff, config.mesh.workers,
        out['tokens'] // config.mesh.workers)
  return out


def _run_child(size: str, cpus: str) -> dict:
  config_file = config_flags.get_config_filename(flags.FLAGS['config'])
  overrides = [a for a in sys.argv[1:] if a.startswith('--config.')]
  cmd = [sys.executable, '-m', 'experiments.profile_step',
         f'--child={size}:{cpus}', f'--config={config_file}', *overrides,
         f'--steps={_STEPS.value}']
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                        cwd=tables.REPO, timeout=1800)
  if proc.returncode:
    raise RuntimeError(f'{" ".join(cmd)} failed: {proc.stderr[-3000:]}')
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv):
  del argv
  if _STEPS.value < 2:
    raise app.UsageError('--steps must be >= 2')
  if _CHILD.value:
    size, _, cpus = _CHILD.value.partition(':')
    print(json.dumps(_child(size, cpus, _CONFIG.value, _STEPS.value)))
    return
  if _CONFIG.value.model.name != 'transformer':
    raise app.UsageError(
        f'profile_step sizes the Transformer LM; the config\'s model is '
        f'{_CONFIG.value.model.name!r}')
  unknown = [s for s in _SIZES.value if s not in _runs.LM_SIZES]
  if unknown:
    raise app.UsageError(f'unknown --sizes {unknown}; known: '
                         f'{list(_runs.LM_SIZES)}')
  results = {'sizes': {}, 'steps': _STEPS.value,
             'categories': _profile.CATEGORIES, 'host_cpus': os.cpu_count()}
  for size in _SIZES.value:
    one = _run_child(size, 'one')
    every = _run_child(size, 'all')
    one['all_cpus_median_step_ms'] = every['median_step_ms']
    one['all_cpus'] = every['cpus']
    results['sizes'][size] = one
  _runs.write(_WORKDIR.value, 'profile_step',
              _train_tables.profile_step_main({'results': results}), results)


if __name__ == '__main__':
  app.run(main)
