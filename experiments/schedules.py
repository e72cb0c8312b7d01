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

``--size`` takes one of the claims study's LM sizes. ``--seeds`` repeats the
runs of ``--seed_runs`` (default: all but the constant main run, its WSM
merges and branches) at more seeds (model init and data order, shared by
every run of a seed); the tables give mean +- sample std over the seeds.
``--sf_lrs`` adds schedule-free runs at other peak rates (first seed).

Writes ``NAME.md`` (tables), ``NAME.json`` and ``NAME.png`` (eval-loss
curves; loss per budget; NAME is ``--results_name``) to ``--workdir``.
Finished runs in ``--workdir`` are read back instead of retrained.

  python -m experiments.schedules --workdir=/tmp/schedules \
    [--config=configs/inner_schedules_lm.py] [--config.num_steps=300]
  # The 0.2M LM at 1,000 steps of 32 x 128 bytes (docs/claims.md):
  python -m experiments.schedules --workdir=DIR --size=0.2M \
    --results_name=schedules_budget --config.num_steps=1000 \
    --config.batch_size=32 --config.data.seq_len=128 \
    --config.optimizer.learning_rate=0.024 --budgets=0.25,0.5,1.0 \
    --wsm_interval=50 --seeds=0,1,2 --cpu_devices=1 \
    --config.mesh.workers=1 --config.mesh.data=1
"""

import math
import os
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _claims
from experiments import _runs
from experiments import _train_tables
from experiments._schedules import chosen_runs
from experiments._schedules import parse_seeds
from experiments._schedules import RUNS
from experiments._schedules import SEEDABLE
from experiments._schedules import seed_dir
from experiments._schedules import SHAPES

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
_SIZE = flags.DEFINE_enum(
    'size', None, list(_claims.SIZES), "The LM's size, one of the claims "
    "study's (experiments/_claims.py SIZES); unset: the config's model.")
_SEEDS = flags.DEFINE_list(
    'seeds', ['0'], 'Seeds (model init and data order): the first runs '
    'everything, the others the runs of --seed_runs.')
_SEED_RUNS = flags.DEFINE_list(
    'seed_runs', list(SEEDABLE), 'Runs repeated at the seeds after the '
    f'first, of {", ".join(SEEDABLE)}.')
_RUNS = flags.DEFINE_list(
    'runs', list(RUNS), 'Runs of the first seed, in this order, of '
    f'{", ".join(RUNS)} (\'constant main\': the WSD main run, its WSM '
    'merges and branched decays).')
_SF_LRS = flags.DEFINE_list(
    'sf_lrs', [], 'Other peak learning rates of schedule-free AdamW (first '
    'seed only).')
_RESULTS_NAME = flags.DEFINE_enum(
    'results_name', 'schedules', ['schedules', 'schedules_budget'],
    'Name of the results file (schedules_budget: the 0.2M LM at 1,000 '
    'steps, docs/claims.md).')
flags.mark_flag_as_required('workdir')


def main(argv):
  del argv
  try:
    seeds, seed_runs = parse_seeds(_SEEDS.value, _SEED_RUNS.value)
    chosen = chosen_runs(_RUNS.value)
    sf_lrs = [float(v) for v in _SF_LRS.value]
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  _runs.setup(_CPU_DEVICES.value)
  base = _CONFIG.value
  base = _runs.variant(base, **_claims.size_fields(_SIZE.value))
  plan = _plan(base)
  wd = _WORKDIR.value
  first = seeds[0]
  config = _runs.variant(plan['base'], seed=first)
  runs, wsm, branches = {}, {}, {}
  for name in chosen:
    if name == 'constant main':
      wsm, branches = _main_run_parts(config, plan, wd, runs)
    else:
      runs.update(_seed_runs(config, plan, wd, [name], first))
  per_seed = {first: runs}
  for seed in seeds[1:]:  # Then the repeats, then the other rates.
    per_seed[seed] = _seed_runs(_runs.variant(plan['base'], seed=seed),
                                plan, wd, seed_runs, first)
  for lr in sf_lrs:
    name = f'schedule-free adamw lr {lr:g}'
    runs[name] = _one(_runs.variant(config, optimizer__learning_rate=lr),
                      plan, wd, 'schedule-free adamw', name)
  budgets = plan['budgets']
  results = {'runs': runs, 'wsm': wsm, 'branches': branches,
             'budgets': budgets, 'starts': plan['starts'],
             'seeds': seeds,
             'seed_losses': {n: {str(s): r[n]['final_eval_loss']
                                 for s, r in per_seed.items() if n in r}
                             for n in runs},
             'seed_wsds': {str(s): [r['wsd-s']['curve']['eval'][b]
                                    for b in budgets]
                           for s, r in per_seed.items() if 'wsd-s' in r}}
  data = _train_tables.as_written(results, _runs.RUNS, sys.argv)
  markdown = (_train_tables.schedules_main(data) + '\n'
              + _train_tables.schedules_budgets(data))
  _runs.write(wd, _RESULTS_NAME.value, markdown, results,
              setup={'size': _SIZE.value, 'seeds': seeds,
                     'seed_runs': seed_runs, 'sf_lrs': sf_lrs})
  cosines = {b: runs.get('cosine' if b == budgets[-1] else f'cosine {b}')
             for b in budgets}
  _plot(os.path.join(wd, f'{_RESULTS_NAME.value}.png'), runs, wsm,
        plan['total'], budgets, runs.get('wsd-s'), branches, cosines,
        plan['spent'])


def _plan(base) -> dict:
  """The steps every part shares: warmup, budgets, branch starts, the
  evaluation and checkpoint periods."""
  from loc_opt import schedules  # pylint: disable=g-import-not-at-top
  total = base.num_steps
  warmup = int(round(0.1 * total))
  budgets = [int(round(float(f) * total)) for f in _BUDGETS.value]
  if budgets[-1] != total or sorted(set(budgets)) != budgets:
    raise app.UsageError(f'--budgets must increase and end at 1.0, got '
                         f'{budgets}')
  peak = base.optimizer.learning_rate
  starts = [schedules.wsds_branch(peak, (), _DECAY.value, b,
                                  warmup_steps=warmup)[0] for b in budgets]
  every = math.gcd(*budgets, base.eval_every)
  return {'base': _runs.variant(base, eval_every=every), 'total': total,
          'warmup': warmup, 'budgets': budgets, 'starts': starts,
          'ckpt_every': math.gcd(_WSM_INTERVAL.value, *starts),
          'spent': max(starts) + sum(b - s for b, s in zip(budgets, starts))}


def _overrides(name: str, plan: dict) -> dict:
  """The config fields of run ``name`` (one of :data:`SEEDABLE`)."""
  warmup, decay = plan['warmup'], _DECAY.value
  if name in ('cosine', 'linear'):
    return {'optimizer__schedule': f'warmup_{name}',
            'optimizer__schedule_kwargs': {'warmup_steps': warmup,
                                           'end_value': 0.0}}
  if name.startswith('wsd ') and name[4:] in SHAPES:
    return {'optimizer__schedule': 'wsd', 'optimizer__schedule_kwargs': {
        'warmup_steps': warmup, 'decay_steps': decay,
        'decay_shape': name[4:], 'end_value': 0.0}}
  if name == 'schedule-free adamw':
    return {'optimizer__name': 'schedule_free_adamw',
            'optimizer__schedule': 'warmup_constant',
            'optimizer__schedule_kwargs': {'warmup_steps': warmup}}
  if name == 'wsd-s':
    return {'optimizer__schedule': 'wsds', 'optimizer__schedule_kwargs': {
        'decay_points': plan['budgets'], 'decay_steps': decay,
        'warmup_steps': warmup, 'end_value': 0.0}}
  b = int(name.split()[1])  # 'cosine <budget>'
  return {'num_steps': b, 'optimizer__schedule': 'warmup_cosine',
          'optimizer__schedule_kwargs': {'warmup_steps': int(round(0.1 * b)),
                                         'end_value': 0.0}}


def _one(config, plan, wd, kind, name, dirname=None):
  """Trains (or reads back) run ``name`` of schedule ``kind``."""
  return _runs.run(_runs.variant(config, **_overrides(kind, plan)),
                   os.path.join(wd, dirname or name.replace(' ', '_')),
                   name)


def _seed_runs(config, plan, wd, names, first) -> dict:
  """Runs ``names`` of :data:`SEEDABLE` at ``config``'s seed (``'cosine
  per budget'``: part 2's cosine runs for the budgets before the last);
  the first seed's runs keep the plain labels and directories."""
  seed = config.seed
  expanded = []
  for name in names:
    expanded += ([f'cosine {b}' for b in plan['budgets'][:-1]]
                 if name == 'cosine per budget' else [name])
  return {n: _one(config, plan, wd, n,
                  n if seed == first else f'{n} (seed {seed})',
                  seed_dir(n, seed, first)) for n in expanded}


def _main_run_parts(config, plan, wd, runs):
  """The constant WSD main run (into ``runs``), WSM merges of its last
  checkpoints and WSD decays branched off it."""
  from loc_opt import schedules  # pylint: disable=g-import-not-at-top
  from loc_opt import train  # pylint: disable=g-import-not-at-top
  total, warmup, ckpt = plan['total'], plan['warmup'], plan['ckpt_every']
  main_config = _runs.variant(
      config, optimizer__schedule='warmup_constant',
      optimizer__schedule_kwargs={'warmup_steps': warmup},
      checkpoint_every=ckpt, keep_checkpoints=total // ckpt + 1)
  main_dir = os.path.join(wd, 'constant_main')
  runs['constant (wsd main)'] = _runs.run(main_config, main_dir,
                                          'constant (wsd main)')
  k, interval = _WSM_K.value, _WSM_INTERVAL.value
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
  branches = {}
  for b, start in zip(plan['budgets'], plan['starts']):
    branch = _runs.variant(
        config, num_steps=b, optimizer__schedule='wsd',
        optimizer__schedule_kwargs={'warmup_steps': warmup,
                                    'decay_steps': b - start,
                                    'end_value': 0.0})
    s = train.branch_and_evaluate(
        branch, os.path.join(wd, f'wsd_branch_{b}'), from_workdir=main_dir,
        from_step=start)
    s.pop('state', None)
    branches[b] = {'start': start, 'final_eval_loss': s['final_eval_loss']}
    print(f'wsd branch {start}->{b:<22} steps {b - start:>4}  final eval '
          f'loss {s["final_eval_loss"]:.4f}', flush=True)
  return wsm, branches


def _plot(path, runs, wsm, total, budgets, wsds, branches, cosines, spent):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
  names = ['cosine', 'linear'] + [f'wsd {s}' for s in SHAPES] + [
      'schedule-free adamw', 'constant (wsd main)', 'wsd-s']
  for name in (n for n in names if n in runs):
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
  if wsds:
    ev = wsds['curve']['eval']
    ax2.plot(budgets, [ev[b] for b in budgets], marker='o',
             label=f'wsd-s, one run ({total} steps)')
  if branches:
    ax2.plot(budgets, [branches[b]['final_eval_loss'] for b in budgets],
             marker='s', label=f'wsd, branched decays ({spent} steps)')
  if all(cosines.values()):
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
