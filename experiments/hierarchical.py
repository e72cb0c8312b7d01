r"""Hierarchical DiLoCo against flat DiLoCo at equal cross-group bytes.

Trains the config's LM (4 workers x 2 devices) with flat DiLoCo at H = 30
and H = 60, and with hierarchical DiLoCo over 2 groups of 2 workers (groups
sync every H1 = 30 steps, groups merge every H2 = 60 steps;
``loc_opt.outer.hierarchical_diloco``). DiLoCo at H = 60 sends the same
bytes between groups as the hierarchy (one all-reduce every 60 steps); H =
30 sends twice as many. For each run the compiled programs give the bytes
that cross groups and those that stay inside them, and the wall-clock model
plays them on a machine with fast links inside a group and slow links
between groups (``loc_opt.train.hierarchy.two_level_seconds``).

  python -m experiments.hierarchical --workdir=/tmp/hierarchical \
    [--runs=flat_h30,flat_h60,hier_30_60,hier_15_60,hier_30_60_int8_stat2] \
    [--slow_gbps=1] [--fast_gbps=100] [--config.num_steps=300]

Each run lives in its own directory under --workdir and resumes from its
checkpoints (a finished run is read back, not retrained). Writes
``hierarchical.md`` and ``hierarchical.json`` to --workdir.
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _fault_tables
from experiments import _runs

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/diloco_lm.py',
                                          'Config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Parent of the run dirs.')
_RUNS = flags.DEFINE_list('runs', None, 'Subset of the runs (default: '
                          'flat_h30, flat_h60, hier_30_60).')
_SLOW = flags.DEFINE_float('slow_gbps', 1.0, 'Link between groups, Gbit/s.')
_FAST = flags.DEFINE_float('fast_gbps', 100.0, 'Links inside a group.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')
flags.mark_flag_as_required('workdir')

GROUP_SIZE = 2
# Codecs of the compressed hierarchical run: int8 inside groups, 2-bit
# statistical with error feedback between them (MuLoCo's 2-bit setting).
_CODECS = {'outer__hierarchical_diloco__group_codec': 'int8',
           'outer__codec': 'statistical',
           'outer__codec_kwargs': {'bits': 2},
           'outer__error_feedback': 'ef'}
# name -> (label, method, H (= H1), H2 / H1[, config overrides])
RUNS = {
    'flat_h30': ('DiLoCo, H=30', 'diloco', 30, None),
    'flat_h60': ('DiLoCo, H=60', 'diloco', 60, None),
    'hier_30_60': ('Hierarchical, H1=30, H2=60', 'hierarchical_diloco', 30,
                   2),
    'hier_15_60': ('Hierarchical, H1=15, H2=60', 'hierarchical_diloco', 15,
                   4),
    'hier_30_60_int8_stat2': (
        'Hierarchical 30/60, int8 in, 2-bit stat. + EF between',
        'hierarchical_diloco', 30, 2, _CODECS),
}
DEFAULT_RUNS = ('flat_h30', 'flat_h60', 'hier_30_60')


def _traffic(config) -> dict[str, float]:
  """Bytes inside and between groups over the run, and the two-link
  wall-clock, from the run's compiled programs."""
  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  from loc_opt.train import experiment as exp_lib  # pylint: disable=g-import-not-at-top
  from loc_opt.train import hierarchy  # pylint: disable=g-import-not-at-top
  exp = exp_lib.get_experiment(config)
  wc = config.wallclock
  fast = parallel.Link(_FAST.value, wc.latency_s)
  slow = parallel.Link(_SLOW.value, wc.latency_s)
  phases = list(exp.plan.walk(0, config.num_steps))
  reports = {}
  for phase in set(phases):
    exp.programs.steps[phase]  # compiles it  # pylint: disable=pointless-statement
    reports[phase] = exp.programs.steps.reports[phase]
  m = config.mesh.workers
  between = sum(reports[p].cross_group_bytes(GROUP_SIZE) for p in phases)
  total = sum(reports[p].cross_worker_bytes for p in phases)
  seconds = {p: hierarchy.two_level_seconds(r, GROUP_SIZE, fast, slow)
             for p, r in reports.items()}
  clock = parallel.simulate_wallclock([seconds[p] for p in phases],
                                      step_time_s=wc.step_time_s)
  return {'between_groups_mb_per_worker': between / m / 1e6,
          'within_groups_mb_per_worker': (total - between) / m / 1e6,
          'seconds': clock.total_s, 'utilization': clock.utilization}


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  names = _runs.chosen(_RUNS.value or list(DEFAULT_RUNS), RUNS)
  config = _CONFIG.value
  results = {}
  for name in names:
    label, method, h, period, *extra = RUNS[name]
    overrides = {'outer__method': method, 'outer__sync_every': h,
                 **(extra[0] if extra else {})}
    if period is not None:
      overrides['outer__hierarchical_diloco__group_size'] = GROUP_SIZE
      overrides['outer__hierarchical_diloco__global_period'] = period
    run_config = _runs.variant(config, **overrides)
    summary = _runs.run(run_config, f'{_WORKDIR.value}/{name}', label)
    results[name] = {k: summary[k] for k in (
        'final_eval_loss', 'final_train_loss', 'syncs', 'curve')}
    results[name].update(_traffic(run_config))
  numbers = {'config': config.to_dict(), 'group_size': GROUP_SIZE,
             'fast_gbps': _FAST.value, 'slow_gbps': _SLOW.value,
             'runs': results}
  _runs.write(_WORKDIR.value, 'hierarchical', _fault_tables.hierarchical_main(
      {'runs': _runs.RUNS, 'results': numbers}), numbers)


if __name__ == '__main__':
  app.run(main)
