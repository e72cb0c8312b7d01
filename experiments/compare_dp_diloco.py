r"""Data-parallel vs DiLoCo at equal tokens: final eval loss and bytes.

Trains the config's model twice on the same data, batch and step count --
once data-parallel, once with DiLoCo (4 workers, H = --config.outer.sync_every)
-- and prints a markdown table of final eval loss and cross-worker bytes
(read from the compiled programs).

  python -m experiments.compare_dp_diloco --config=configs/diloco_lm.py \
    --workdir=/tmp/compare [--config.num_steps=300]
"""

import json
import os

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _runs

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/diloco_lm.py',
                                          'Config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Parent of the run dirs.')
_METHODS = flags.DEFINE_list('methods', ['data_parallel', 'diloco'],
                             'Methods to compare.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8,
                                    'Virtual CPU devices.')
flags.mark_flag_as_required('workdir')


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  import ml_collections  # pylint: disable=g-import-not-at-top
  from loc_opt import train  # pylint: disable=g-import-not-at-top
  from loc_opt.train import metrics  # pylint: disable=g-import-not-at-top

  rows = []
  for method in _METHODS.value:
    c = ml_collections.ConfigDict(_CONFIG.value.to_dict())
    c.outer.method = method
    s = train.train_and_evaluate(c, os.path.join(_WORKDIR.value, method))
    s.pop('state')
    rows.append(s)
  c = _CONFIG.value
  tokens = c.num_steps * c.batch_size * c.data.seq_len
  print(f'\n{c.num_steps} steps x {c.batch_size} x {c.data.seq_len} = '
        f'{tokens:,} tokens, {c.mesh.workers} workers x '
        f'{c.mesh.data * c.mesh.fsdp * c.mesh.tensor} devices, '
        f'H = {c.outer.sync_every}\n')
  print('| method | final eval loss | cross-worker bytes | syncs |')
  print('|---|---|---|---|')
  for r in rows:
    print(f'| {r["method"]} | {r["final_eval_loss"]:.4f} | '
          f'{metrics.format_bytes(r["cross_worker_bytes"])} '
          f'({r["cross_worker_bytes"]:,} B) | {r["syncs"]} |')
  with open(os.path.join(_WORKDIR.value, 'comparison.json'), 'w') as f:
    json.dump(rows, f, indent=2, default=str)


if __name__ == '__main__':
  app.run(main)
