r"""Step time and training throughput on this machine.

Two parts (``--parts``, both by default):

* ``step_time``: the DiLoCo inner step against a plain data-parallel step.
  Both programs are compiled from the same config (model, optimizer, mesh,
  batch); only ``outer.method`` differs. Steps are timed one at a time
  (``block_until_ready``), alternating blocks of the two programs so that
  machine noise hits both alike, and the medians are compared.
* ``throughput``: tokens per second through the launcher's own path
  (``python -m experiments.train``, its ``perf/tokens_per_s``, which counts
  ``batch_size * seq_len`` tokens per step and excludes compilation,
  evaluation and checkpoints) at the three sizes of issue 20 (459k, 853k and
  1.48M parameters; 4 workers, H = 10, fp32, AdamW inside, Nesterov outside),
  and at the 853k size under each CPU lever in :data:`LEVERS` (meshes, XLA:CPU
  flags, model layout). Each run is a child process of its own (XLA flags
  are read when the backend starts), ``--throughput_steps`` steps long; the
  figure is the median over its logged windows of 10 steps (each with one
  sync step), the first window left out.

  With ``--exogym_python`` (a Python with torch and exogym installed, see
  ``experiments/reference/exogym_throughput.py``) the PyTorch simulator
  exogym runs the same model size, batch, H and optimizers right after each
  loc_opt run, so both are measured on the same machine in the same minutes.
  ``--repeats=R`` runs the sizes part R rounds (per size: loc_opt, exogym,
  the stacked layout, the stacked layout in 2 local processes of one core
  each, ``--local_processes=2``) and reports each figure's median over the
  rounds and the ratios round by round: single runs spread by 5-20% here.

  python -m experiments.benchmark_step_time --config=configs/diloco_lm.py \
    [--steps=60] [--repeats=3] [--workdir=/tmp/step_time] \
    [--exogym_python=/tmp/torchenv/bin/python]
"""

import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _runs
from experiments import _train_tables

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/diloco_lm.py',
                                          'Config file.')
_STEPS = flags.DEFINE_integer('steps', 60, 'Timed steps per program.')
_BLOCK = flags.DEFINE_integer('block', 5, 'Steps per alternating block.')
_WORKDIR = flags.DEFINE_string(
    'workdir', '', 'Write the results file benchmark_step_time.json here.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8,
                                    'Virtual CPU devices.')
_PARTS = flags.DEFINE_list('parts', ['step_time', 'throughput'],
                           'Which parts to run: step_time, throughput.')
_THROUGHPUT_STEPS = flags.DEFINE_integer(
    'throughput_steps', 60, 'Steps of each throughput run (a multiple of 10, '
    '>= 30).')
_LEVERS = flags.DEFINE_list(
    'levers', None, 'Levers to measure at the 853k size (default: all of '
    'LEVERS; an empty value measures none).')
_REPEATS = flags.DEFINE_integer(
    'repeats', 1, 'Rounds of the sizes part: each round runs, per size, '
    'loc_opt, exogym, the stacked layout and the stacked layout in 2 '
    'processes in turn; the tables give the '
    'median of the rounds (the machine drifts by 10-20% over minutes).')
_STACKED = flags.DEFINE_boolean(
    'stacked', True, 'Also run each size with the 4 workers stacked on one '
    'CPU device (STACKED_ARGS), right after exogym.')
_PROCESSES = flags.DEFINE_boolean(
    'processes', True, 'Also run each size with the 4 workers stacked 2 '
    'per process in 2 processes (PROCESSES_ARGS), last in each round.')
_EXOGYM_PYTHON = flags.DEFINE_string(
    'exogym_python', os.environ.get('EXOGYM_PYTHON', ''),
    'A Python with torch and exogym: also measure '
    'exogym at each size (experiments/reference/exogym_throughput.py).')

SIZES = _runs.LM_SIZES


def _size_args(label: str) -> tuple[str, ...]:
  layers, d_model = SIZES[label]
  return (f'--config.model.num_layers={layers}',
          f'--config.model.d_model={d_model}')

# What each throughput run overrides in the given config (the issue's
# setting: H = 10; no evaluation, one checkpoint at the end).
THROUGHPUT_OVERRIDES = (
    '--config.outer.method=diloco', '--config.outer.sync_every=10',
    '--config.eval_every=0', '--config.checkpoint_every=0',
    '--config.log_every=10', '--config.progress=False',
    "--config.logging.backends=('jsonl',)")
# CPU levers tried at the 853k size: name -> (XLA_FLAGS, extra arguments).
LEVERS = {
    'default (4 workers x 2 devices, 8 devices)': ('', ()),
    'freed host memory not kept (reuse_host_memory=off)': (
        '', ('--reuse_host_memory=off',)),
    'one malloc arena at 8 devices (reuse_host_memory=one_arena)': (
        '', ('--reuse_host_memory=one_arena',)),
    'mesh 4 x 1 (4 devices)': ('', ('--config.mesh.data=1',
                                    '--cpu_devices=4')),
    'mesh 4 x 4 (16 devices)': ('', ('--config.mesh.data=4',
                                     '--cpu_devices=16')),
    'workers stacked on 1 device (mesh.simulate_workers)': (
        '', ('--config.mesh.simulate_workers=True', '--config.mesh.data=1',
             '--cpu_devices=1')),
    'workers stacked in 2 processes of 1 device (local_processes=2)': (
        '', ('--config.mesh.simulate_workers=True', '--config.mesh.data=1',
             '--cpu_devices=1', '--local_processes=2')),
    'workers stacked on 2 devices (mesh.simulate_workers, data 2)': (
        '', ('--config.mesh.simulate_workers=True', '--config.mesh.data=2',
             '--cpu_devices=2')),
    "weight gradients by JAX's rule (model.weight_grad=xla)": (
        '', ('--config.model.weight_grad=xla',)),
    "norms, GELU and RoPE by JAX's rules (model.backward=xla)": (
        '', ('--config.model.backward=xla',)),
    'blocks under lax.scan': ('', ('--config.model.scan_layers=True',)),
    'jax.nn.dot_product_attention (xla)': (
        '', ('--config.model.attention=xla',)),
    'attention queries in 2 blocks (model.causal_blocks=2)': (
        '', ('--config.model.causal_blocks=2',)),
    'XLA:CPU oneDNN': ('--xla_cpu_use_onednn=true', ()),
    'XLA:CPU XNNPACK': ('--xla_cpu_use_xnnpack=true', ()),
    'XLA:CPU without YNNPACK fusions': (
        '--xla_cpu_experimental_ynn_fusion_type=', ()),
}
LEVER_SIZE = '853k'
# The sizes' second layout: the workers stacked on one CPU device
# (mesh.simulate_workers), the fastest of the layouts in LEVERS here.
STACKED_ARGS = ('--config.mesh.simulate_workers=True', '--config.mesh.data=1',
                '--cpu_devices=1')
# The third: the stacked workers in 2 processes of one core each (one group
# of one device per process, 2 workers on each; loc_opt.train.local_launch).
PROCESSES_ARGS = (*STACKED_ARGS, '--local_processes=2')
EXOGYM_SCRIPT = (pathlib.Path(__file__).resolve().parent / 'reference'
                 / 'exogym_throughput.py')


def _launcher_tokens_per_s(workdir: pathlib.Path, args, xla_flags: str
                           ) -> dict:
  """Runs ``experiments.train`` with ``args`` in a child process and returns
  the median of its logged ``perf/tokens_per_s`` (first window left out)."""
  shutil.rmtree(workdir, ignore_errors=True)
  workdir.mkdir(parents=True)
  env = dict(os.environ)
  env.pop('XLA_FLAGS', None)
  if xla_flags:
    env['XLA_FLAGS'] = xla_flags
  cmd = [sys.executable, '-m', 'experiments.train', f'--workdir={workdir}',
         *args]
  t = time.time()
  with open(workdir / 'train.log', 'w') as log:
    proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                          cwd=pathlib.Path(__file__).resolve().parent.parent,
                          check=False)
  if proc.returncode:
    raise RuntimeError(f'{" ".join(cmd)} failed ({proc.returncode}); see '
                       f'{workdir / "train.log"}')
  rows = [json.loads(line) for line in
          (workdir / 'metrics.jsonl').read_text().splitlines()]
  windows = [r['perf/tokens_per_s'] for r in rows
             if 'perf/tokens_per_s' in r][1:]
  summary = json.loads((workdir / 'summary.json').read_text())
  return {'tokens_per_s': statistics.median(windows),
          'windows_tokens_per_s': windows, 'xla_flags': xla_flags,
          'args': list(args), 'num_params': summary['num_params'],
          'compile_seconds': summary['compile_seconds'],
          'wall_seconds': time.time() - t}


def _exogym_tokens_per_s(python: str, label: str, steps: int) -> dict:
  """exogym's tokens/s at size ``label`` of :data:`SIZES`."""
  layers, d_model = SIZES[label]
  cmd = [python, str(EXOGYM_SCRIPT), f'--num_layers={layers}',
         f'--d_model={d_model}', f'--steps={steps}']
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if proc.returncode:
    raise RuntimeError(f'{" ".join(cmd)} failed: {proc.stderr[-2000:]}')
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _median_run(runs: list[dict]) -> dict:
  """The run of median tokens/s (the lower middle one of an even count),
  with every run's tokens/s in ``rounds_tokens_per_s``."""
  ordered = sorted(runs, key=lambda r: r['tokens_per_s'])
  row = dict(ordered[(len(ordered) - 1) // 2])
  row['rounds_tokens_per_s'] = [r['tokens_per_s'] for r in runs]
  return row


def throughput(config_path: str, steps: int, workdir: pathlib.Path,
               levers, exogym_python: str, stacked: bool = True,
               repeats: int = 1, processes: bool = True) -> dict:
  """The throughput part: ``repeats`` rounds of the sizes (per size the
  default layout, exogym, the stacked layout, the stacked layout in 2
  processes, in that order), then levers."""
  if repeats < 1:
    raise ValueError(f'--repeats must be >= 1, got {repeats}')
  if steps % 10 or steps < 30:
    raise ValueError(f'--throughput_steps must be a multiple of 10, >= 30, '
                     f'got {steps}')
  unknown = [k for k in levers if k not in LEVERS]
  if unknown:
    raise ValueError(f'unknown levers {unknown}; known: {sorted(LEVERS)}')
  base = (f'--config={config_path}', f'--config.num_steps={steps}',
          *THROUGHPUT_OVERRIDES)
  runs = {label: {'loc_opt': [], 'exogym': [], 'stacked': [],
                  'processes': []} for label in SIZES}
  layouts = {'stacked': STACKED_ARGS if stacked else None,
             'processes': PROCESSES_ARGS if processes else None}
  for r in range(repeats):
    for label in SIZES:
      run = runs[label]
      run['loc_opt'].append(_launcher_tokens_per_s(
          workdir / 'sizes' / label / str(r), (*base, *_size_args(label)),
          ''))
      if exogym_python:
        run['exogym'].append(_exogym_tokens_per_s(exogym_python, label,
                                                  steps))
      for key, args in layouts.items():
        if args is not None:
          run[key].append(_launcher_tokens_per_s(
              workdir / key / label / str(r),
              (*base, *_size_args(label), *args), ''))
      print(f'{label}, round {r + 1}: ' + ', '.join(
          f'{k} {v[-1]["tokens_per_s"]:,.0f} tok/s'
          for k, v in run.items() if v), flush=True)
  sizes = {}
  for label, run in runs.items():
    row = _median_run(run['loc_opt'])
    for key in ('exogym', 'stacked', 'processes'):
      if run[key]:
        row[key] = _median_run(run[key])
    sizes[label] = row
  lever_rows = {}
  for i, name in enumerate(levers):
    xla_flags, extra = LEVERS[name]
    lever_rows[name] = _launcher_tokens_per_s(
        workdir / 'levers' / str(i), (*base, *_size_args(LEVER_SIZE), *extra),
        xla_flags)
    print(f'{LEVER_SIZE}, {name}: '
          f'{lever_rows[name]["tokens_per_s"]:,.0f} tok/s', flush=True)
  return {'steps': steps, 'sync_every': 10, 'lever_size': LEVER_SIZE,
          'repeats': repeats, 'sizes': sizes, 'levers': lever_rows}


def step_time() -> dict:
  """The DiLoCo-inner vs data-parallel part."""
  _runs.setup(_CPU_DEVICES.value)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from loc_opt import train  # pylint: disable=g-import-not-at-top

  config = _CONFIG.value
  configs = {}
  for method in ('diloco', 'data_parallel'):
    c = ml_collections.ConfigDict(config.to_dict())
    c.outer.method = method
    configs[method] = c
  exps = {m: train.build_experiment(c) for m, c in configs.items()}
  rng = np.random.default_rng(0)
  m, b, t = config.mesh.workers, config.batch_size, config.data.seq_len
  tokens = rng.integers(0, 256, (m, b // m, t + 1), dtype=np.int32)
  batches = {'diloco': tokens, 'data_parallel': tokens.reshape(b, t + 1)}
  times = _runs.time_alternating(
      {k: (e.programs.steps[False], e.init_state(), batches[k])
       for k, e in exps.items()},
      rounds=max(1, _STEPS.value // _BLOCK.value), block=_BLOCK.value,
      warmup=3)
  med = {k: statistics.median(v) for k, v in times.items()}
  return {
      'median_step_s': med,
      'ratio_diloco_inner_over_dp': med['diloco'] / med['data_parallel'],
      'cross_worker_bytes_per_step': {
          k: e.programs.bytes_per_step[False] for k, e in exps.items()},
      'diloco_sync_step_bytes': exps['diloco'].programs.bytes_per_step[True],
      'steps_timed': len(times['diloco']),
      'devices': str(jax.devices()[0].platform) + f' x{jax.device_count()}',
      'num_params': exps['diloco'].model.num_params,
  }


def main(argv):
  del argv
  parts = set(_PARTS.value)
  if not parts or parts - {'step_time', 'throughput'}:
    raise app.UsageError(f'--parts takes step_time and/or throughput, got '
                         f'{_PARTS.value}')
  result = {}
  if 'step_time' in parts:
    result['step_time'] = step_time()
  if 'throughput' in parts:
    levers = list(LEVERS) if _LEVERS.value is None else _LEVERS.value
    result['throughput'] = throughput(
        config_flags.get_config_filename(flags.FLAGS['config']),
        _THROUGHPUT_STEPS.value,
        pathlib.Path(_WORKDIR.value or '/tmp/step_time') / 'throughput',
        levers, _EXOGYM_PYTHON.value, _STACKED.value, _REPEATS.value,
        _PROCESSES.value)
  markdown = _train_tables.benchmark_step_time_all({'results': result})
  if _WORKDIR.value:
    _runs.write(_WORKDIR.value, 'benchmark_step_time', markdown, result)
  else:
    print(markdown)

if __name__ == '__main__':
  app.run(main)
