r"""Outer momentum (and learning rate) sweep of the DiLoCo family.

Why: with the outer step DiLoCo uses (Nesterov, lr 0.7, momentum 0.9),
Eager updates applies (M-1)/M of each outer gradient one round late, and a
linearized analysis puts the spectral radius of that delayed recursion above
1 at M = 4 (issue 17). This sweep trains both methods on the reference LM at
M = 2 and M = 4 workers (the 8 devices split as M x 8/M) over a grid of outer
momenta and learning rates, at equal tokens and equal tuning effort (the
same grid for both), and reports each run's final eval loss and the best
setting per method and M. The per-method default of ``outer.eager_diloco``
in ``configs/diloco_lm.py`` is read from this table.

The same sweep of the other methods whose outer step is their own (CO2,
whose outer step also lands a round late, and NoLoCo's heavy-ball step)
writes another results file, read by their sections of the config:

  python -m experiments.outer_sweep --workdir=/tmp/outer_sweep_own \
    --results_name=outer_sweep_own --methods=co2,noloco --workers=4 \
    --momenta=0.9,0.5,0.3,0.1

  python -m experiments.outer_sweep --workdir=/tmp/outer_sweep \
    [--methods=eager_diloco,diloco] [--workers=2,4] \
    [--momenta=0.9,0.7,0.5,0.3,0.1,0.0] [--learning_rates=0.7] \
    [--sync_every=30]

At the claims study's budget (claim 4 of docs/claims.md: Eager updates
against the naive one-round delay and tuned DiLoCo at M = 2; the ~0.2M LM,
1,000 steps, workers stacked on one device), a local search of Eager's outer
step from DiLoCo's best, the naive delay at its default, at Eager's best
and around its own best (a local minimum of the points run), and three
seeds of Eager's best and of DiLoCo's:

  python -m experiments.outer_sweep --workdir=DIR \
    --results_name=outer_sweep_budget --size=0.2M --search=local \
    --methods=eager_diloco --workers=2 --learning_rates=1.0,0.7,0.4 \
    --momenta=0.5,0.3,0.9,0.0 --best_seeds=3 \
    --also=eager_naive@0.7:0.9,eager_naive@eager_diloco,diloco@1.0:0.5:3,\
eager_naive@0.7:0.0,eager_naive@0.4:0.3,eager_naive@0.4:0.0,\
eager_naive@0.4:0.5,eager_naive@0.2:0.3 \
    --simulate_workers --cpu_devices=1 --config.mesh.workers=1 \
    --config.mesh.data=1 --config.num_steps=1000 \
    --config.optimizer.learning_rate=1.2e-2 --config.eval_every=166 \
    --config.checkpoint_every=166

Every run sets ``outer.learning_rate`` / ``outer.momentum``; a method's own
section values are cleared where the method falls back to those
(``outer.eager_diloco``) and set to the grid point where it does not
(``outer.co2``'s learning rate and momentum, ``outer.noloco``'s momentum),
so the grid point is what runs. Finished runs
are read back and an interrupted one resumes, so the command can be rerun;
the results file ``outer_sweep.json`` is rewritten after every run.
"""

import copy
import itertools
import os

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _claims
from experiments import _outer_sweep
from experiments import _runs
from experiments import tables

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/diloco_lm.py',
                                          'Config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Parent of the run dirs.')
_METHODS = flags.DEFINE_list(
    'methods', ['eager_diloco', 'diloco'],
    'Methods to tune: outer.method values, or eager_naive (Eager updates\' '
    'naive one-round delay).')
_WORKERS = flags.DEFINE_list('workers', ['2', '4'], 'Worker counts M.')
_MOMENTA = flags.DEFINE_list(
    'momenta', ['0.9', '0.7', '0.5', '0.3', '0.1', '0.0'], 'Outer momenta.')
_LRS = flags.DEFINE_list('learning_rates', ['0.7'], 'Outer learning rates.')
_SYNC_EVERY = flags.DEFINE_integer('sync_every', 30, 'H.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')
_SIZE = flags.DEFINE_enum(
    'size', None, list(_claims.SIZES),
    'The model size of the claims study (experiments._claims.SIZES) instead '
    'of the config\'s model.')
_SEARCH = flags.DEFINE_enum(
    'search', 'grid', ['grid', 'local'],
    'grid: every (lr, momentum); local: a pattern search from the first '
    'values of --learning_rates and --momenta (experiments._claims.'
    'local_search), per method and M.')
_BEST_SEEDS = flags.DEFINE_integer(
    'best_seeds', 1, 'Seeds (0 .. N-1) of each tuned method\'s best setting '
    'per M (the search runs seed 0).')
_ALSO = flags.DEFINE_list(
    'also', [], 'Settings run besides the search, per M: METHOD@LR:MOMENTUM'
    '[:SEEDS] or METHOD@TUNED[:SEEDS] (the best setting of TUNED, one of '
    '--methods); SEEDS: seeds 0 .. SEEDS-1 (default 1).')
_SIMULATE = flags.DEFINE_bool(
    'simulate_workers', False, 'Stack the M workers on every device '
    '(mesh.simulate_workers: the same numerics, no bytes measured).')

_RESULTS_NAME = flags.DEFINE_enum(
    'results_name', 'outer_sweep',
    ['outer_sweep', 'outer_sweep_own', 'outer_sweep_budget'],
    'The results file (NAME.json) this sweep writes.')
flags.mark_flag_as_required('workdir')


def _floats(values, flag):
  try:
    return [float(v) for v in values]
  except ValueError as e:
    raise app.UsageError(f'--{flag} takes numbers, got {values}') from e


def _base():
  """The config every run starts from, and its device count."""
  base = copy.deepcopy(_CONFIG.value)
  base.progress = False
  base = _runs.variant(base, **_claims.size_fields(_SIZE.value))
  devices = base.mesh.workers * base.mesh.data * base.mesh.fsdp
  devices *= base.mesh.tensor
  return base, devices


class _Sweep:
  """Runs (or reads back) settings and rewrites the results after each."""

  def __init__(self, base, devices, setup, planned):
    self.base, self.devices, self.setup = base, devices, setup
    self.rows: list[dict] = []
    self.planned = list(planned)  # Names listed as pending until run.

  def config(self, method, m, lr, mom, seed):
    outer_method, overrides = _outer_sweep.method_of(method)
    c = _runs.outer_grid_point(self.base, outer_method, m, lr, mom,
                               _SYNC_EVERY.value)
    overrides = dict(overrides, seed=seed)
    if _SIMULATE.value:
      overrides.update(mesh__data=self.devices,
                       mesh__simulate_workers=m > 1)
    return _runs.variant(c, **overrides)

  def run(self, method, m, lr, mom, seed=0, role='search'):
    """The run's final eval loss (trained, resumed or read back)."""
    name = _outer_sweep.run_name(method, m, lr, mom, seed, _SIZE.value or '')
    for r in self.rows:
      if r['name'] == name:
        return r['final_eval_loss']
    label = (f'{_outer_sweep.LABELS.get(method, method)}, M={m}, lr {lr:g}, '
             f'mom {mom:g}, seed {seed}')
    s = _runs.run(self.config(method, m, lr, mom, seed),
                  os.path.join(_WORKDIR.value, name), label)
    self.setup.setdefault('num_params', s.get('num_params'))
    self.rows.append({'name': name, 'method': method, 'workers': m,
                      'learning_rate': lr, 'momentum': mom, 'seed': seed,
                      'role': role, 'final_eval_loss': s['final_eval_loss'],
                      'steps': s['step'], 'syncs': s['syncs'],
                      'curve': s['curve']['eval']})
    self.planned = [p for p in self.planned if p != name]
    results = {'setup': self.setup, 'rows': self.rows,
               'pending': self.planned}
    _runs.write(_WORKDIR.value, _RESULTS_NAME.value,
                tables.render(_RESULTS_NAME.value, 'main',
                              {'results': results}), results)
    return s['final_eval_loss']


def _tune(sweep, method, m, lrs, momenta):
  """Seed-0 losses of ``method`` at M = ``m`` over the search; the best
  setting."""
  losses = {}
  if _SEARCH.value == 'grid':
    for lr, mom in itertools.product(lrs, momenta):
      losses[(lr, mom)] = sweep.run(method, m, lr, mom)
  else:
    while wanted := _claims.local_search([lrs, momenta], losses):
      for lr, mom in wanted:
        losses[(lr, mom)] = sweep.run(method, m, lr, mom)
  return min(losses, key=losses.get)


def _check_workers(workers, devices, batch_size):
  for m in workers:
    fits = _SIMULATE.value or not devices % m
    if m < 1 or not fits or batch_size % m:
      raise app.UsageError(
          f'--workers={m} must divide the {devices} devices (or pass '
          f'--simulate_workers) and batch_size {batch_size}')


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  base, devices = _base()
  workers = [int(w) for w in _WORKERS.value]
  _check_workers(workers, devices, base.batch_size)
  momenta = _floats(_MOMENTA.value, 'momenta')
  lrs = _floats(_LRS.value, 'learning_rates')
  try:
    also = _outer_sweep.parse_also(_ALSO.value, _METHODS.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  setup = {'num_steps': base.num_steps, 'batch_size': base.batch_size,
           'seq_len': base.data.seq_len, 'sync_every': _SYNC_EVERY.value,
           'devices': devices, 'nesterov': base.outer.nesterov,
           'size': _SIZE.value, 'simulate_workers': _SIMULATE.value,
           'inner_learning_rate': base.optimizer.learning_rate,
           'schedule': base.optimizer.schedule,
           'eval_batches': base.eval_batches, 'search': _SEARCH.value,
           'learning_rates': lrs, 'momenta': momenta}
  planned = []
  if _SEARCH.value == 'grid':
    planned = [_outer_sweep.run_name(g[0], g[1], g[2], g[3], 0,
                                     _SIZE.value or '')
               for g in itertools.product(_METHODS.value, workers, lrs,
                                          momenta)]
  sweep = _Sweep(base, devices, setup, planned)
  for m in workers:
    best = {method: _tune(sweep, method, m, lrs, momenta)
            for method in _METHODS.value}
    for method, (lr, mom) in best.items():
      for seed in range(1, _BEST_SEEDS.value):
        sweep.run(method, m, lr, mom, seed, role='best_seeds')
    for method, setting, seeds in also:
      lr, mom = best[setting] if isinstance(setting, str) else setting
      for seed in range(seeds):
        sweep.run(method, m, lr, mom, seed, role='also')


if __name__ == '__main__':
  app.run(main)
