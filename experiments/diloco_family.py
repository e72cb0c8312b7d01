r"""The DiLoCo family side by side at equal tokens on the reference LM.

Trains the config's LM (4 workers x 2 devices) with data parallelism,
DiLoCo, Streaming DiLoCo (fp32 and fp4 e3m0 outer gradients), Eager updates,
NoLoCo, DeMo, SparseLoCo, DES-LOC, MT-DAO, EDiT, CO2, and asynchronous local
SGD and Decoupled DiLoCo with one 2x-slower worker, all at the same sync period H where they have
one, and reports per run

* the final eval loss (each method's evaluation weights: the anchor / outer
  parameters; NoLoCo and Eager evaluate each worker's own outer parameters);
* total and peak cross-worker bytes, read from the compiled programs;
* simulated wall-clock and compute utilization at 1 and 100 Gbit/s
  (``loc_opt.parallel.wallclock``), for this model and projected to a
  larger one (``--projected_params``, ``--projected_step_time``).

The asynchronous runs process the same number of tokens as the others:
their slow worker takes a step every other tick, so it runs
``ceil(num_steps * M / sum(speeds))`` ticks. DiLoCo is also clocked with
the same slow worker (synchronous methods wait for it; the numbers are
DiLoCo's).

  python -m experiments.diloco_family --workdir=/tmp/diloco_family \
    [--runs=dp,diloco,...] [--config.num_steps=300]

Writes ``diloco_family.md``, the results file ``diloco_family.json``
(numbers, every run's config and provenance; ``docs/results/`` holds the
published one) and ``loss_vs_time.png`` to --workdir. The table and the
figure are drawn by ``experiments.tables`` from the results file.
"""

import copy
import math
import os

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _runs
from experiments import tables

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/diloco_lm.py',
                                          'Config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Parent of the run dirs.')
_RUNS = flags.DEFINE_list('runs', None, 'Subset of the runs (default: all).')
_SYNC_EVERY = flags.DEFINE_integer('sync_every', 30,
                                   'H of every method that has one.')
_STRAGGLER = flags.DEFINE_float('straggler_speed', 0.5,
                                'Relative speed of the slow worker.')
_PROJECTED_PARAMS = flags.DEFINE_float(
    'projected_params', 1e9, 'Model size the bytes are projected to.')
_PROJECTED_STEP = flags.DEFINE_float(
    'projected_step_time', 1.0, 'Step time (s) of the projected model.')
_REUSE = flags.DEFINE_bool(
    'reuse_finished', False,
    'Read the summary of a run dir that already holds a finished run of the '
    'same method and length instead of training (e.g. after adding runs or '
    'config fields that do not change the old runs); its bytes and loss are '
    'those it recorded.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')
flags.mark_flag_as_required('workdir')

# name -> (label, overrides with '__' for nested fields)
RUNS = {
    'dp': ('data-parallel', {'outer__method': 'data_parallel'}),
    'diloco': ('DiLoCo', {'outer__method': 'diloco'}),
    'streaming': ('Streaming DiLoCo (P=3, tau=1)',
                  {'outer__method': 'streaming_diloco'}),
    'streaming_fp4': ('Streaming DiLoCo + fp4 e3m0',
                      {'outer__method': 'streaming_diloco',
                       'outer__codec': 'fp4_e3m0',
                       'outer__codec_kwargs': {'block_size': None}}),
    # Eager updates with its own outer step (outer.eager_diloco in the
    # config, chosen by experiments.outer_sweep) and with DiLoCo's shared
    # one, at M = 4 and M = 2, beside DiLoCo at M = 2.
    'eager': ('Eager updates', {'outer__method': 'eager_diloco'}),
    'eager_shared': ('Eager updates, DiLoCo\'s outer step',
                     {'outer__method': 'eager_diloco',
                      'outer__eager_diloco__learning_rate': None,
                      'outer__eager_diloco__momentum': None}),
    'diloco_m2': ('DiLoCo, M=2', {'outer__method': 'diloco',
                                  'mesh__workers': 2, 'mesh__data': 4}),
    'eager_m2': ('Eager updates, M=2', {'outer__method': 'eager_diloco',
                                        'mesh__workers': 2, 'mesh__data': 4}),
    'eager_m2_shared': ('Eager updates, M=2, DiLoCo\'s outer step',
                        {'outer__method': 'eager_diloco',
                         'outer__eager_diloco__learning_rate': None,
                         'outer__eager_diloco__momentum': None,
                         'mesh__workers': 2, 'mesh__data': 4}),
    'eager_naive': ('Eager ablation: naive one-round delay',
                    {'outer__method': 'eager_diloco',
                     'outer__eager_diloco__naive': True,
                     'outer__eager_diloco__learning_rate': None,
                     'outer__eager_diloco__momentum': None}),
    'noloco': ('NoLoCo', {'outer__method': 'noloco'}),
    'demo': ('DeMo (every step)', {'outer__method': 'demo'}),
    'sparseloco': ('SparseLoCo', {'outer__method': 'sparseloco'}),
    'desloc': ('DES-LOC', {'outer__method': 'desloc'}),
    'mt_dao': ('MT-DAO', {'outer__method': 'mt_dao',
                          'optimizer__name': 'multi_timescale_adam',
                          'optimizer__kwargs': {
                              'slow_betas': (0.99,), 'slow_weights': (0.8,),
                              'b2': 0.95, 'weight_decay': 0.1}}),
    'edit': ('EDiT (penalty: drop, weight, clip)',
             {'outer__method': 'edit_diloco',
              'outer__edit_diloco__warmup_syncs': 3,
              'outer__edit_diloco__clip_norm': None}),
    'co2': ('CO2 (one-round-stale outer step)', {'outer__method': 'co2'}),
    'async': ('async local SGD (2x straggler, DN + DyLU)',
              {'outer__method': 'async_local_sgd'}),
    'decoupled': ('Decoupled DiLoCo (2x straggler, P=3, K=1 + grace)',
                  {'outer__method': 'decoupled_diloco',
                   'outer__decoupled_diloco__num_fragments': 3}),
}


def _config(base, name, sync_every, straggler):
  label, overrides = RUNS[name]
  c = _runs.variant(base, outer__sync_every=sync_every, **overrides)
  if c.outer.method == 'eager_diloco':  # the outer step it ran with
    from loc_opt.train import config as cfg_lib  # pylint: disable=g-import-not-at-top
    lr, mom = cfg_lib.outer_step(c, 'eager_diloco')
    label += f' (outer lr {lr:g}, momentum {mom:g})'
  if name in ('async', 'decoupled'):
    speeds = (1.0,) * (c.mesh.workers - 1) + (straggler,)
    c.wallclock.worker_speeds = speeds
    # Equal tokens: the slow worker takes fewer steps per tick.
    c.num_steps = math.ceil(base.num_steps * c.mesh.workers / sum(speeds))
  return label, c


def _clock(exp, gbps, *, step_time, model_params=0, speeds=None):
  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  from loc_opt.train import simulated_time  # pylint: disable=g-import-not-at-top,line-too-long
  c = exp.config.wallclock
  return simulated_time.simulate_run(
      exp, parallel.Link(gbps, c.latency_s), step_time_s=step_time,
      model_params=model_params, speeds=speeds)


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  from loc_opt import train  # pylint: disable=g-import-not-at-top
  from loc_opt.train import metrics  # pylint: disable=g-import-not-at-top

  names = _runs.chosen(_RUNS.value, RUNS)
  base = copy.deepcopy(_CONFIG.value)
  base.progress = False
  h, straggler = _SYNC_EVERY.value, _STRAGGLER.value
  proj_params, proj_step = _PROJECTED_PARAMS.value, _PROJECTED_STEP.value
  step_time = base.wallclock.step_time_s
  speeds_slow = (1.0,) * (base.mesh.workers - 1) + (straggler,)
  rows = []
  for name in names:
    label, c = _config(base, name, h, straggler)
    run_dir = os.path.join(_WORKDIR.value, name)
    summary = _runs.read_back(c, run_dir, label) if _REUSE.value else None
    if summary is None:
      summary = _runs.run(c, run_dir, label)
    exp = train.get_experiment(c)
    row = {'name': name, 'label': label,
           'final_eval_loss': summary['final_eval_loss'],
           'steps': summary['step'],
           'cross_worker_bytes': summary['cross_worker_bytes'],
           'peak_bytes_per_step': summary['peak_bytes_per_step'],
           'bytes_per_phase': summary['bytes_per_phase'],
           'curve': summary['curve']}
    variants = [(label, None)]
    if name == 'diloco':
      variants.append(('DiLoCo, 2x straggler (waits)', speeds_slow))
    for vlabel, speeds in variants:
      r = dict(row, label=vlabel)
      for gbps in (1.0, 100.0):
        clock = _clock(exp, gbps, step_time=step_time, speeds=speeds)
        proj = _clock(exp, gbps, step_time=proj_step,
                      model_params=proj_params, speeds=speeds)
        tag = f'{gbps:g}gbps'
        r[f'{tag}_s'] = clock.total_s
        r[f'{tag}_util'] = clock.utilization
        r[f'projected_{tag}_s'] = proj.total_s
        r[f'projected_{tag}_util'] = proj.utilization
      rows.append(r)
    print(f'  bytes {metrics.format_bytes(row["cross_worker_bytes"])}, '
          f'peak/step {metrics.format_bytes(row["peak_bytes_per_step"])}',
          flush=True)
    # The results file after every run, so a long sweep cut short still
    # has the finished rows (``pending`` names the others).
    results = {
        'setup': {'num_steps': base.num_steps,
                  'batch_size': base.batch_size,
                  'seq_len': base.data.seq_len, 'workers': base.mesh.workers,
                  'devices_per_worker': (base.mesh.data * base.mesh.fsdp
                                         * base.mesh.tensor),
                  'sync_every': h, 'straggler_speed': straggler,
                  'num_params': exp.model.num_params,
                  'step_time_s': step_time, 'projected_params': proj_params,
                  'projected_step_time_s': proj_step,
                  'latency_s': base.wallclock.latency_s},
        'rows': rows, 'pending': names[names.index(name) + 1:]}
    _runs.write(_WORKDIR.value, 'diloco_family',
                tables.render('diloco_family', 'main', {'results': results}),
                results)
  tables.diloco_family_figure({'results': results},
                              os.path.join(_WORKDIR.value,
                                           'loss_vs_time.png'))


if __name__ == '__main__':
  app.run(main)
