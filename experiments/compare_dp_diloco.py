r"""Data-parallel vs DiLoCo at equal tokens: final eval loss and bytes.

Trains the config's model on the same data, batch and step count
data-parallel and with DiLoCo (4 workers) at H = 10, 25 and 50, and at
H = 50 with int8 pseudo-gradients, and writes a markdown table of final eval
loss, cross-worker bytes (read from the compiled programs) and syncs, plus
the results file ``compare_dp_diloco.json`` (numbers, configs, provenance;
``docs/results/`` holds the published one).

  python -m experiments.compare_dp_diloco --workdir=/tmp/compare \
    [--runs=dp,diloco_h50] [--config.num_steps=300]

Finished runs are read back, so a second call only tabulates.
"""

import copy
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
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8,
                                    'Virtual CPU devices.')
flags.mark_flag_as_required('workdir')

# name -> (label, overrides with '__' for nested fields)
RUNS = {
    'dp': ('data-parallel', {'outer__method': 'data_parallel'}),
    'diloco_h10': ('DiLoCo', {'outer__method': 'diloco',
                              'outer__sync_every': 10}),
    'diloco_h25': ('DiLoCo', {'outer__method': 'diloco',
                              'outer__sync_every': 25}),
    'diloco_h50': ('DiLoCo', {'outer__method': 'diloco',
                              'outer__sync_every': 50}),
    'diloco_h50_int8': ('DiLoCo, int8 pseudo-gradients',
                        {'outer__method': 'diloco', 'outer__sync_every': 50,
                         'outer__codec': 'int8'}),
}


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  names = _runs.chosen(_RUNS.value, RUNS)
  base = copy.deepcopy(_CONFIG.value)
  base.progress = False
  rows = []
  setup = {'num_steps': base.num_steps, 'batch_size': base.batch_size,
           'seq_len': base.data.seq_len, 'workers': base.mesh.workers,
           'devices_per_worker': (base.mesh.data * base.mesh.fsdp
                                  * base.mesh.tensor),
           'outer_learning_rate': base.outer.learning_rate,
           'outer_momentum': base.outer.momentum}
  for i, name in enumerate(names):
    label, overrides = RUNS[name]
    c = _runs.variant(base, **overrides)
    s = _runs.run(c, os.path.join(_WORKDIR.value, name), label)
    rows.append({'name': name, 'label': label, 'method': c.outer.method,
                 'sync_every': (1 if c.outer.method == 'data_parallel'
                                else c.outer.sync_every),
                 'codec': c.outer.codec,
                 'final_eval_loss': s['final_eval_loss'],
                 'steps': s['step'], 'syncs': s['syncs'],
                 'cross_worker_bytes': s['cross_worker_bytes'],
                 'num_params': s['num_params']})
    # After every run, so a sweep cut short keeps its finished rows.
    results = {'setup': setup, 'rows': rows, 'pending': names[i + 1:]}
    _runs.write(_WORKDIR.value, 'compare_dp_diloco',
                tables.render('compare_dp_diloco', 'main',
                              {'results': results}), results)


if __name__ == '__main__':
  app.run(main)
