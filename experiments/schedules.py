r"""Learning-rate schedules at equal steps, and one run for many budgets.

Part 1, equal steps (``num_steps`` each, same data, same peak rate, warmup
10%, every decay to 0): cosine, linear, WSD with each decay shape (decay over
the last ``--decay_fraction`` of the run), schedule-free AdamW (constant
rate after the warmup; evaluated at its average ``x``), and WSM: the
constant-rate WSD main run's last ``--wsm_k + 1`` checkpoints, every
``--wsm_interval`` steps, merged with ``wsm_coefficients`` of a decay shape
(a decay over the same ``k * interval`` steps).

Part 2, three budgets (``--budgets``, fractions of ``num_steps``):

* WSD-S: one run whose rate decays into every budget and resumes at the
  peak from the decayed weights (``'wsds'``, the decay being
  ``--decay_fraction`` of each segment).
* WSD with branched decays: decays branched off the constant main run's
  checkpoints (``loc_opt.train.branch_and_evaluate``), each over
  ``--decay_fraction`` of its budget.
* Cosine: a separate run per budget.

Writes ``schedules.md`` (tables), ``schedules.json`` and ``schedules.png``
(eval-loss curves; loss per budget) to ``--workdir``. Finished runs in
``--workdir`` are read back instead of retrained.

  python -m experiments.schedules --workdir=/tmp/schedules \
    [--config=configs/inner_schedules_lm.py] [--config.num_steps=300]
"""

import math
import os
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _runs
from experiments import _train_tables

_CONFIG = config_flags.DEFINE_config_file(
    'config', 'configs/inner_schedules_lm.py', 'Config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Parent of the run dirs.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')
_DECAY = flags.DEFINE_float('decay_fraction', 0.2,
                            'WSD / WSD-S decay length, fraction of the run '
                            '(or of each WSD-S segment).')
_BUDGETS = flags.DEFINE_list('budgets', ['0.3333333', '0.6666667', '1.0'],
                             'Budgets of part 2, fractions of num_steps.')
_WSM_K = flags.DEFINE_integer('wsm_k', 3, 'WSM merge intervals.')
_WSM_INTERVAL = flags.DEFINE_integer('wsm_interval', 20,
                                     'Steps between merged checkpoints.')
flags.mark_flag_as_required('workdir')

SHAPES = ('linear', 'cosine', '1-sqrt', '1-square')


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  from loc_opt import schedules  # pylint: disable=g-import-not-at-top
  from loc_opt import train  # pylint: disable=g-import-not-at-top

  base = _CONFIG.value
  wd = _WORKDIR.value
  total = base.num_steps
  warmup = int(round(0.1 * total))
  peak = base.optimizer.learning_rate
  budgets = [int(round(float(f) * total)) for f in _BUDGETS.value]
  if budgets[-1] != total or sorted(set(budgets)) != budgets:
    raise app.UsageError(f'--budgets must increase and end at 1.0, got '
                         f'{budgets}')
  interval, k = _WSM_INTERVAL.value, _WSM_K.value
  decay = _DECAY.value
  starts = [schedules.wsds_branch(peak, (), decay, b, warmup_steps=warmup)[0]
            for b in budgets]
  every = math.gcd(*budgets, base.eval_every)
  ckpt_every = math.gcd(interval, *starts)
  base = _runs.variant(base, eval_every=every)

  runs = {}

  def go(name, **overrides):
    runs[name] = _runs.run(_runs.variant(base, **overrides),
                           os.path.join(wd, name.replace(' ', '_')), name)
    return runs[name]

  # Part 1: equal steps.
  go('cosine', optimizer__schedule='warmup_cosine',
     optimizer__schedule_kwargs={'warmup_steps': warmup, 'end_value': 0.0})
  go('linear', optimizer__schedule='warmup_linear',
     optimizer__schedule_kwargs={'warmup_steps': warmup, 'end_value': 0.0})
  for shape in SHAPES:
    go(f'wsd {shape}', optimizer__schedule='wsd',
       optimizer__schedule_kwargs={
           'warmup_steps': warmup, 'decay_steps': decay,
           'decay_shape': shape, 'end_value': 0.0})
  go('schedule-free adamw', optimizer__name='schedule_free_adamw',
     optimizer__schedule='warmup_constant',
     optimizer__schedule_kwargs={'warmup_steps': warmup})
  main_config = _runs.variant(
      base, optimizer__schedule='warmup_constant',
      optimizer__schedule_kwargs={'warmup_steps': warmup},
      checkpoint_every=ckpt_every, keep_checkpoints=total // ckpt_every + 1)
  main_dir = os.path.join(wd, 'constant_main')
  runs['constant (wsd main)'] = _runs.run(main_config, main_dir,
                                          'constant (wsd main)')
  merge_steps = schedules.wsm_checkpoint_steps(total, k, interval)
  wsm = {}
  for shape in ('linear', '1-sqrt'):
    coeffs = schedules.wsm_coefficients(k, shape)
    merged = train.merge_and_evaluate(main_config, main_dir, merge_steps,
                                      coeffs)
    merged.pop('params')
    wsm[shape] = merged
    print(f'wsm {shape:<30} steps {total:>4}  merged eval loss '
          f'{merged["eval_loss"]:.4f}', flush=True)

  # Part 2: three budgets.
  wsds = go('wsd-s', optimizer__schedule='wsds', optimizer__schedule_kwargs={
      'decay_points': budgets, 'decay_steps': decay,
      'warmup_steps': warmup, 'end_value': 0.0})
  branches = {}
  for b, start in zip(budgets, starts):
    config = _runs.variant(
        base, num_steps=b, optimizer__schedule='wsd',
        optimizer__schedule_kwargs={'warmup_steps': warmup,
                                    'decay_steps': b - start,
                                    'end_value': 0.0})
    s = train.branch_and_evaluate(
        config, os.path.join(wd, f'wsd_branch_{b}'), from_workdir=main_dir,
        from_step=start)
    s.pop('state', None)
    branches[b] = {'start': start, 'final_eval_loss': s['final_eval_loss']}
    print(f'wsd branch {start}->{b:<22} steps {b - start:>4}  final eval '
          f'loss {s["final_eval_loss"]:.4f}', flush=True)
  cosines = {total: runs['cosine']}
  for b in budgets[:-1]:
    cosines[b] = go(f'cosine {b}', num_steps=b,
                    optimizer__schedule='warmup_cosine',
                    optimizer__schedule_kwargs={
                        'warmup_steps': int(round(0.1 * b)),
                        'end_value': 0.0})

  # Tables.
  results = {'runs': runs, 'wsm': wsm, 'branches': branches,
             'budgets': budgets, 'starts': starts}
  data = _train_tables.as_written(results, _runs.RUNS, sys.argv)
  markdown = (_train_tables.schedules_main(data) + '\n'
              + _train_tables.schedules_budgets(data))
  _runs.write(wd, 'schedules', markdown, results)
  spent = max(starts) + sum(b - s for b, s in zip(budgets, starts))
  _plot(os.path.join(wd, 'schedules.png'), runs, wsm, total, budgets, wsds,
        branches, cosines, spent)


def _plot(path, runs, wsm, total, budgets, wsds, branches, cosines, spent):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
  names = ['cosine', 'linear'] + [f'wsd {s}' for s in SHAPES] + [
      'schedule-free adamw', 'constant (wsd main)', 'wsd-s']
  for name in names:
    ev = runs[name]['curve']['eval']
    steps = sorted(s for s in ev if s >= total // 3)
    ax1.plot(steps, [ev[s] for s in steps], marker='.', label=name)
  for shape, merged in wsm.items():
    ax1.plot([total], [merged['eval_loss']], marker='*', markersize=12,
             linestyle='none', label=f'wsm {shape}')
  ax1.set_xlabel('step')
  ax1.set_ylabel('eval loss (nats/byte)')
  ax1.set_title(f'equal steps ({total})')
  ax1.legend(fontsize=7)
  ev = wsds['curve']['eval']
  ax2.plot(budgets, [ev[b] for b in budgets], marker='o',
           label=f'wsd-s, one run ({total} steps)')
  ax2.plot(budgets, [branches[b]['final_eval_loss'] for b in budgets],
           marker='s', label=f'wsd, branched decays ({spent} steps)')
  ax2.plot(budgets, [cosines[b]['final_eval_loss'] for b in budgets],
           marker='^', label=f'cosine per budget ({sum(budgets)} steps)')
  ax2.set_xlabel('budget (steps)')
  ax2.set_ylabel('eval loss at the budget')
  ax2.set_title('three budgets')
  ax2.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  print(f'wrote {path}')


if __name__ == '__main__':
  app.run(main)
