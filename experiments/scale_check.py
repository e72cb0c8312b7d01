r"""Compile-only scale check of a config's train steps on its mesh.

Builds the experiment of ``--config`` with abstract parameters (nothing is
materialized), compiles the inner step and the first sync step, and prints
one Markdown row per step: parameters, per-device argument and temporary
memory (``compiled.memory_analysis()``), within-worker bytes against ideal
FSDP + Megatron (``loc_opt.parallel.ideal``), cross-worker bytes per worker
against the fp32 parameter bytes (DiLoCo's sync), and compile time.

  python -m experiments.scale_check --config=configs/scale_lm.py:1b \
    [--config.mesh.fsdp=2 --config.mesh.tensor=2] [--workdir=DIR]
  python -m experiments.scale_check --table=scale_1b --workdir=DIR
  python -m experiments.scale_check --table=scale_sync --workdir=DIR

On a machine without accelerators it uses ``--cpu_devices`` virtual CPU
devices. ``--table=scale_1b`` / ``scale_8b`` measures the rows of
docs/sharding.md's tables instead (:data:`PRESETS`). With --workdir, writes
``NAME.md`` and the results file ``NAME.json`` (rows, configs, provenance)
there, NAME the table or ``scale_check``.
"""

import json
import math
import time

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _runs

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')
_WORKDIR = flags.DEFINE_string(
    'workdir', '', 'Also write the results file scale_check.json here.')
_SYNC = flags.DEFINE_bool('sync', True, 'Also compile the first sync step.')

HEADER = ('| mesh (w x d x f x t) | step | params | arg MiB/dev | temp MiB/dev '
          '| within-worker MiB | vs ideal | cross-worker MiB/worker '
          '| vs fp32 params | compile s |')


def _layout(config, num_params, backend: str | None = None):
  """The worker's ideal layout; its activation all-reduces at the width
  ``backend`` reduces in (``None``: at the activations' own width)."""
  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  m, model = config.mesh, config.model
  act_bytes = 2 if str(model.dtype) == 'bfloat16' else 4
  return parallel.ideal.WorkerLayout(
      data=m.data, fsdp=m.fsdp, tensor=m.tensor,
      param_bytes=4 * num_params, rows=config.batch_size // m.workers,
      length=config.data.seq_len, d_model=model.d_model,
      num_layers=model.num_layers, act_bytes=act_bytes,
      reduce_bytes=(parallel.ideal.reduce_width(act_bytes, backend)
                    if backend else None))


def _row(config, exp, phase, label) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  start = time.perf_counter()
  compiled = exp.programs.steps[phase]
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  report = parallel.collective_bytes(compiled, exp.mesh)
  within = parallel.ideal.unrolled_bytes(report, cross_worker=False)
  cross = parallel.ideal.unrolled_bytes(report, cross_worker=True)
  workers = config.mesh.workers
  ideal, ideal_act = (
      workers * parallel.ideal.inner_step_bytes(
          _layout(config, exp.model.num_params, backend))
      for backend in (jax.default_backend(), None))
  m = config.mesh
  return {
      'mesh': f'{m.workers}x{m.data}x{m.fsdp}x{m.tensor}',
      'step': label, 'params': exp.model.num_params,
      'argument_bytes': memory.argument_size_in_bytes,
      'temp_bytes': memory.temp_size_in_bytes,
      'within_worker_bytes': within,
      'ideal_within_worker_bytes': ideal,
      # Activation all-reduces at the activations' width (bfloat16 on GPUs
      # and TPUs), where ideal has them at this backend's.
      'ideal_act_width_within_worker_bytes': ideal_act,
      'cross_worker_bytes_per_worker': cross / workers,
      'param_bytes': 4 * exp.model.num_params,
      'compile_seconds': seconds,
  }


def _markdown(row: dict) -> str:
  mib = lambda b: f'{b / 2**20:,.0f}'
  ratio = lambda a, b: f'{a / b:.2f}x' if b else '-'
  within = row['within_worker_bytes']
  cross = row['cross_worker_bytes_per_worker']
  return (f"| {row['mesh']} | {row['step']} | {row['params'] / 1e6:,.1f}M "
          f"| {mib(row['argument_bytes'])} | {mib(row['temp_bytes'])} "
          f"| {mib(row['within_worker_bytes'])} "
          f"| {ratio(within, row['ideal_within_worker_bytes'])} "
          f"| {mib(cross)} | {ratio(cross, row['param_bytes'])} "
          f"| {row['compile_seconds']:.1f} |")


# The tables of docs/sharding.md (--table=NAME, no --config): per table,
# rows of (code label, scale_lm.py size, config overrides, compile the sync
# step too).
_SCAN_REMAT = {'model.scan_layers': True, 'model.remat': 'full'}
_TENSOR = {'mesh.fsdp': 2, 'mesh.tensor': 2}
_FULL_TP = {'model.remat': 'full_tp'}
PRESETS = {
    'scale_1b': (
        ('unrolled', '1b', {}, True),
        ('unrolled', '1b', _TENSOR, False),
        ('scan + remat `full`', '1b', _SCAN_REMAT, True),
        ('scan, no remat', '1b', {'model.scan_layers': True}, False),
    ),
    'scale_8b': (
        ('scan + remat `full`', '8b', _SCAN_REMAT, True),
        ('scan + remat `full`', '8b', {**_SCAN_REMAT, **_TENSOR}, False),
        ('unrolled, no remat', '8b', {}, False),
    ),
    # The sync step beside the inner step (issue 46's targets: temporary
    # memory at most 1.25x the inner step's, within-worker bytes at most
    # 1.2x ideal), ~1B and ~8B, on both meshes; scanned, full remat, and
    # on the tensor mesh also remat 'full_tp' (no all-reduce recomputed).
    'scale_sync': (
        ('~1B', '1b', _SCAN_REMAT, True),
        ('~1B', '1b', {**_SCAN_REMAT, **_TENSOR}, True),
        ('~1B, `full_tp`', '1b', {**_SCAN_REMAT, **_TENSOR, **_FULL_TP},
         True),
        ('~8B', '8b', _SCAN_REMAT, True),
        ('~8B', '8b', {**_SCAN_REMAT, **_TENSOR}, True),
        ('~8B, `full_tp`', '8b', {**_SCAN_REMAT, **_TENSOR, **_FULL_TP},
         True),
    ),
}

# A Mixture-of-Experts LM of about 1B parameters (0.86B: 12 blocks of 8
# top-2 experts of width 4096 at d_model 1024, about 0.25B active per
# token); its experts split over fsdp (the 'expert' axis rule), then
# also its expert MLPs over tensor (docs/moe.md).
_MOE = {'model.d_model': 1024, 'model.num_layers': 12, 'model.d_ff': 4096,
        'model.num_heads': 8, 'model.moe.num_experts': 8,
        'model.moe.top_k': 2, **_SCAN_REMAT}
_XLA = {'model.moe.dispatch': 'xla'}
PRESETS['scale_moe'] = (
    ('experts x fsdp, all-to-all', '1b', _MOE, True),
    ('experts x fsdp, xla', '1b', {**_MOE, **_XLA}, False),
    ('experts x fsdp, tensor, all-to-all', '1b', {**_MOE, **_TENSOR},
     False),
    ('experts x fsdp, tensor, xla', '1b', {**_MOE, **_TENSOR, **_XLA},
     False),
)

_TABLE = flags.DEFINE_enum(
    'table', None, list(PRESETS),
    'Measure the rows of this docs table (PRESETS) instead of --config, '
    'into the results file NAME.json.')


def _measure(config, sync: bool, code: str) -> list[dict]:
  """The inner (and first sync) step's rows of ``config``."""
  from loc_opt.train import experiment  # pylint: disable=g-import-not-at-top
  exp = experiment.build_experiment(config)
  phases = [(exp.plan.inner, 'inner')]
  syncs = [p for p in exp.plan.phases(config.num_steps) if exp.plan.is_sync(p)]
  if sync and syncs:
    phases.append((syncs[0], 'sync'))
  print(f"# {code}: {config.model.d_model} wide, {config.model.num_layers} "
        f"layers, {math.prod(config.mesh.values())} devices\n{HEADER}\n"
        + '|---' * (HEADER.count('|') - 1) + '|', flush=True)
  rows = []
  for phase, label in phases:
    rows.append({'code': code, **_row(config, exp, phase, label)})
    print(_markdown(rows[-1]), flush=True)
  return rows


def main(argv):
  del argv
  if _TABLE.value and _CONFIG.value is not None:
    raise app.UsageError('--table measures its own configs; drop --config')
  if not _TABLE.value and _CONFIG.value is None:
    raise app.UsageError(f'give --config or --table (one of {list(PRESETS)})')
  _runs.setup(_CPU_DEVICES.value)
  from configs import scale_lm  # pylint: disable=g-import-not-at-top
  from loc_opt.train import config as cfg_lib  # pylint: disable=g-import-not-at-top
  from loc_opt.train import programs  # pylint: disable=g-import-not-at-top
  # Compile each phase on first use here, so that each is timed alone.
  programs.EAGER_COMPILE_PHASES = 0
  if _TABLE.value:
    variants = [(code, cfg_lib.with_overrides(scale_lm.get_config(size),
                                              overrides), sync)
                for code, size, overrides, sync in PRESETS[_TABLE.value]]
  else:
    variants = [('config', _CONFIG.value, _SYNC.value)]
  rows = []
  for code, config, sync in variants:
    rows += _measure(config, sync, code)
  if _WORKDIR.value:
    from experiments import tables  # pylint: disable=g-import-not-at-top
    name = _TABLE.value or 'scale_check'
    results = {'rows': rows}
    renderer = 'scale_sync' if name == 'scale_sync' else 'scale_check'
    _runs.write(_WORKDIR.value, name,
                tables.render(renderer, 'main', {'results': results}),
                results, configs=[
                    json.loads(json.dumps(c.to_dict(), default=str))
                    for _, c, _ in variants])


if __name__ == '__main__':
  app.run(main)
