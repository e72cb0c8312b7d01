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

from experiments import _runs
from experiments import tables

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/diloco_lm.py',
                                          'Config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Parent of the run dirs.')
_METHODS = flags.DEFINE_list('methods', ['eager_diloco', 'diloco'],
                             'Methods (outer.method values) to sweep.')
_WORKERS = flags.DEFINE_list('workers', ['2', '4'], 'Worker counts M.')
_MOMENTA = flags.DEFINE_list(
    'momenta', ['0.9', '0.7', '0.5', '0.3', '0.1', '0.0'], 'Outer momenta.')
_LRS = flags.DEFINE_list('learning_rates', ['0.7'], 'Outer learning rates.')
_SYNC_EVERY = flags.DEFINE_integer('sync_every', 30, 'H.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')

_RESULTS_NAME = flags.DEFINE_enum(
    'results_name', 'outer_sweep', ['outer_sweep', 'outer_sweep_own'],
    'The results file (NAME.json) this sweep writes.')
flags.mark_flag_as_required('workdir')

LABELS = {'diloco': 'DiLoCo', 'eager_diloco': 'Eager updates', 'co2': 'CO2',
          'noloco': 'NoLoCo'}


def _floats(values, flag):
  try:
    return [float(v) for v in values]
  except ValueError as e:
    raise app.UsageError(f'--{flag} takes numbers, got {values}') from e


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  base = copy.deepcopy(_CONFIG.value)
  base.progress = False
  devices = base.mesh.workers * base.mesh.data * base.mesh.fsdp
  devices *= base.mesh.tensor
  workers = [int(w) for w in _WORKERS.value]
  for m in workers:
    if m < 1 or devices % m or base.batch_size % m:
      raise app.UsageError(
          f'--workers={m} must divide the {devices} devices and batch_size '
          f'{base.batch_size}')
  momenta = _floats(_MOMENTA.value, 'momenta')
  lrs = _floats(_LRS.value, 'learning_rates')
  grid = list(itertools.product(_METHODS.value, workers, lrs, momenta))
  setup = {'num_steps': base.num_steps, 'batch_size': base.batch_size,
           'seq_len': base.data.seq_len, 'sync_every': _SYNC_EVERY.value,
           'devices': devices, 'nesterov': base.outer.nesterov}
  rows = []
  for i, (method, m, lr, mom) in enumerate(grid):
    name = f'{method}_m{m}_lr{lr:g}_mom{mom:g}'
    c = _runs.outer_grid_point(base, method, m, lr, mom, _SYNC_EVERY.value)
    label = f'{LABELS.get(method, method)}, M={m}, lr {lr:g}, mom {mom:g}'
    s = _runs.run(c, os.path.join(_WORKDIR.value, name), label)
    rows.append({'name': name, 'method': method, 'workers': m,
                 'learning_rate': lr, 'momentum': mom,
                 'final_eval_loss': s['final_eval_loss'],
                 'steps': s['step'], 'syncs': s['syncs']})
    results = {'setup': setup, 'rows': rows,
               'pending': [f'{g[0]}_m{g[1]}_lr{g[2]:g}_mom{g[3]:g}'
                           for g in grid[i + 1:]]}
    _runs.write(_WORKDIR.value, _RESULTS_NAME.value,
                tables.render('outer_sweep', 'main', {'results': results}),
                results)


if __name__ == '__main__':
  app.run(main)
