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

import collections
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _runs
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

# Rows of the table, in order: name -> what it holds.
CATEGORIES = {
    'dense matmuls': 'the linear layers, embedding and head: forward, '
                     'input and weight gradients',
    'attention matmuls': 'scores, softmax fused in, values; forward and '
                         'backward',
    'attention, other': 'RoPE, heads-major transposes, the mask',
    'RMSNorm': 'forward and backward, outside the matmuls',
    'GELU': 'forward and backward',
    'embedding, head, loss': 'one-hot, cross-entropy, outside the matmuls',
    'optimizer and guard': 'AdamW, clipping, the non-finite check and skip',
    'other': 'residual adds, weight-gradient transposes, copies',
}
_SCOPES = (('attention_core', 'attention, other'), ('rms_norm', 'RMSNorm'),
           ('gelu', 'GELU'), ('optimizer', 'optimizer and guard'),
           ('non_finite_guard', 'optimizer and guard'),
           ('embed', 'embedding, head, loss'),
           ('head', 'embedding, head, loss'),
           ('loss', 'embedding, head, loss'))
_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = (.*)$', re.M)
_COMPUTATION = re.compile(r'^(?:ENTRY )?%([\w.\-]+) [^\n]*\{\n(.*?)\n\}',
                          re.S | re.M)
_SHAPE = re.compile(r'^\(?[a-z]+\d*\[([\d,]*)\]')


def _dims(text: str) -> list[int]:
  return [int(x) for x in text.split(',') if x]


def _dot_flops(body: str, shapes: dict[str, list[int]]) -> int:
  """FLOPs of the dots in ``body`` (instructions' text; 2 per
  multiply-add), their operands' dimensions looked up in ``shapes``."""
  total = 0
  for m in _INSTRUCTION.finditer(body):
    dot = re.match(r'\S+\[([\d,]*)\]\S* dot\(%([\w.\-]+), %[\w.\-]+\)(.*)',
                   m.group(2))
    if not dot:
      continue
    lhs = shapes.get(dot.group(2))
    contracting = re.search(r'lhs_contracting_dims=\{([\d,]*)\}',
                            dot.group(3))
    if lhs is None or contracting is None:
      raise ValueError(f'cannot read the shapes of dot {m.group(1)}')
    k = 1
    for i in _dims(contracting.group(1)):
      k *= lhs[i]
    n = 1
    for d in _dims(dot.group(1)):
      n *= d
    total += 2 * n * k
  return total


def _in_scope(scope: str, op_name: str) -> bool:
  """Whether JAX's name stack ``op_name`` passes through named scope
  ``scope`` (``.../jvp(scope)/...`` or ``.../scope/...``)."""
  return re.search(rf'(^|[/(]){re.escape(scope)}([/)]|$)', op_name) is not None


def categorize(hlo: str, op_ms: dict[str, float]) -> dict[str, dict]:
  """``{category: {'ms', 'gflop', 'ops'}}`` of the ops of compiled module
  text ``hlo``, given each op's time (``op_ms``: instruction name -> ms).

  Names in ``op_ms`` that are no instruction of ``hlo`` (the runtime's own
  events) are left out; see :data:`CATEGORIES` for the rows.
  """
  bodies = {m.group(1): m.group(2) for m in _COMPUTATION.finditer(hlo)}
  # Instruction names are unique in a module: every one's dimensions.
  shapes = {}
  for m in _INSTRUCTION.finditer(hlo):
    shape = _SHAPE.match(m.group(2))
    if shape:
      shapes[m.group(1)] = _dims(shape.group(1))
  rows = {c: {'ms': 0.0, 'gflop': 0.0, 'ops': 0} for c in CATEGORIES}
  for m in _INSTRUCTION.finditer(hlo):
    name, rest = m.group(1), m.group(2)
    if name not in op_ms:
      continue
    called = re.search(r'calls=%([\w.\-]+)', rest)
    body = (bodies.get(called.group(1), '') if called
            else f'%{name} = {rest}')
    flops = _dot_flops(body, shapes)
    op_name = re.search(r'op_name="([^"]*)"', rest)
    stack = op_name.group(1) if op_name else ''
    if flops:
      category = ('attention matmuls' if _in_scope('attention_core', stack)
                  else 'dense matmuls')
    else:
      category = next((c for s, c in _SCOPES if _in_scope(s, stack)),
                      'other')
    row = rows[category]
    row['ms'] += op_ms[name]
    row['gflop'] += flops / 1e9
    row['ops'] += 1
  return rows


def shared_times(intervals: list[tuple[int, int, str]]) -> dict[str, float]:
  """Nanoseconds of each name over ``(start_ns, end_ns, name)`` intervals,
  the time in which several overlap shared equally among them.

  On one core, ops that XLA runs at the same time on two threads take
  turns; their durations overlap and would count the same time twice.
  The shares add up to the time in which any op ran.
  """
  edges = sorted({t for start, end, _ in intervals for t in (start, end)})
  index = {t: i for i, t in enumerate(edges)}
  # Active names per elementary segment, by a sweep over the edges.
  starts, ends = collections.defaultdict(list), collections.defaultdict(list)
  for start, end, name in intervals:
    if end > start:
      starts[index[start]].append(name)
      ends[index[end]].append(name)
  active = collections.Counter()
  out = collections.Counter()
  for i, t in enumerate(edges[:-1]):
    for name in ends[i]:
      active[name] -= 1
    for name in starts[i]:
      active[name] += 1
    running = sum(active.values())
    if running:
      span = edges[i + 1] - t
      for name, count in active.items():
        if count:
          out[name] += span * count / running
  return dict(out)


def _op_times(step, state, batch, steps: int, names: set[str]
              ) -> tuple[dict, float, Any]:
  """(instruction name -> ms per step, wall ms per traced step, state) from
  a trace of ``steps`` steps: the ops among ``names`` on XLA's threads,
  overlapping time shared (:func:`shared_times`)."""
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
           for name, ns in shared_times(intervals).items()}
  return op_ms, wall_ms, state


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
  from loc_opt.train import experiment as exp_lib  # pylint: disable=g-import-not-at-top
  layers, d_model = _runs.LM_SIZES[size]
  config = cfg_lib.with_overrides(config, {
      'model.num_layers': layers, 'model.d_model': d_model,
      'mesh.simulate_workers': True, 'mesh.data': 1,
      'outer.method': 'diloco', 'outer.sync_every': 10})
  exp = exp_lib.build_experiment(config)
  step = exp.programs.steps[exp.plan.inner]
  state = exp.init_state()
  batch = exp_lib.train_batch(exp, exp_lib.load_data(config), 0)
  times = []
  for i in range(steps + 2):  # two untimed
    t = time.perf_counter()
    state, loss = step(state, batch)
    loss.block_until_ready()
    if i >= 2:
      times.append(time.perf_counter() - t)
  out = {'size': size, 'cpus': len(os.sched_getaffinity(0)),
         'median_step_ms': statistics.median(times) * 1e3,
         'tokens': config.batch_size * config.data.seq_len,
         'num_params': exp.model.num_params}
  if cpus == 'one':
    hlo = step.as_text()
    names = {m.group(1) for m in _INSTRUCTION.finditer(hlo)}
    op_ms, out['traced_step_ms'], state = _op_times(step, state, batch,
                                                    steps, names)
    out['categories'] = categorize(hlo, op_ms)
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
  unknown = [s for s in _SIZES.value if s not in _runs.LM_SIZES]
  if unknown:
    raise app.UsageError(f'unknown --sizes {unknown}; known: '
                         f'{list(_runs.LM_SIZES)}')
  results = {'sizes': {}, 'steps': _STEPS.value,
             'categories': CATEGORIES, 'host_cpus': os.cpu_count()}
  for size in _SIZES.value:
    one = _run_child(size, 'one')
    every = _run_child(size, 'all')
    one['all_cpus_median_step_ms'] = every['median_step_ms']
    one['all_cpus'] = every['cpus']
    results['sizes'][size] = one
  _runs.write(_WORKDIR.value, 'profile_step',
              tables.profile_step_main({'results': results}), results)


if __name__ == '__main__':
  app.run(main)
