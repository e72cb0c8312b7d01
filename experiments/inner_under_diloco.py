r"""Inner optimizers under DiLoCo at equal compute: AdamW vs SPAM vs SWAN.

Every run is DiLoCo on the 4-worker x 2-device mesh with the same model,
data, steps, batch, sync period and outer optimizer (Nesterov, lr 0.7,
momentum 0.9); only the inner optimizer changes. Same steps and tokens, so
equal compute up to the optimizers' own cost per step (reported as train
time). A data-parallel AdamW run with the same tokens is the reference.

Writes ``inner_under_diloco.md`` and ``.json`` to ``--workdir``.

  python -m experiments.inner_under_diloco --workdir=/tmp/inner_diloco \
    [--config=configs/inner_schedules_lm.py] [--sync_every=25]
"""

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
_OPTIMIZERS = flags.DEFINE_list('optimizers', ['adamw', 'spam', 'swan'],
                                'Names in loc_opt.inner.OPTIMIZERS.')
_SYNC_EVERY = flags.DEFINE_integer('sync_every', 25, 'DiLoCo H.')
_REFERENCE = flags.DEFINE_bool('data_parallel_reference', True,
                               'Also train data-parallel AdamW.')

# Per optimizer: its arguments besides the learning-rate schedule, and its
# peak learning rate (None: the config's). AdamW and SPAM share the config's
# betas and weight decay. SWAN's matrix update has unit singular values; with
# rescale=True it is scaled to the standardized gradient's norm, so its
# entries have Adam-like size and the same peak rate applies (its non-matrix
# leaves use the built-in Adam fallback, with b2 0.95 like the AdamW). SPAM
# keeps its other defaults (threshold 5000, reset interval 500 > the run,
# post-reset warmup 150).
SETTINGS = {
    'adamw': ({'b1': 0.9, 'b2': 0.95, 'weight_decay': 0.1}, None),
    'spam': ({'b1': 0.9, 'b2': 0.95, 'weight_decay': 0.1}, None),
    'swan': ({'adam_b2': 0.95, 'weight_decay': 0.1, 'rescale': True,
              'whitening': 'quintic'}, None),
}


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  _runs.require_optimizers(_OPTIMIZERS.value)
  wd = _WORKDIR.value
  base = _runs.variant(_CONFIG.value, outer__method='diloco',
                       outer__sync_every=_SYNC_EVERY.value)
  runs = {}
  for name in _OPTIMIZERS.value:
    kwargs, lr = SETTINGS.get(name, ({}, None))
    overrides = {'optimizer__name': name, 'optimizer__kwargs': kwargs}
    if lr is not None:
      overrides['optimizer__learning_rate'] = lr
    runs[name] = _runs.run(_runs.variant(base, **overrides),
                           os.path.join(wd, name), f'diloco + {name}')
    runs[name]['settings'] = {'kwargs': kwargs, 'learning_rate': lr or
                              base.optimizer.learning_rate}
  if _REFERENCE.value:
    runs['data-parallel adamw'] = _runs.run(
        _runs.variant(_CONFIG.value, outer__method='data_parallel'),
        os.path.join(wd, 'data_parallel_adamw'), 'data-parallel adamw')

  _runs.write(wd, 'inner_under_diloco', _train_tables.inner_under_diloco_main(
      _train_tables.as_written(runs, _runs.RUNS, sys.argv)), runs)


if __name__ == '__main__':
  app.run(main)
