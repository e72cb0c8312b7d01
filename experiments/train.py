r"""Trains a model from an ml_collections config.

  python -m experiments.train --config=configs/diloco_lm.py --workdir=DIR \
    [--config.outer.sync_every=50] [--cpu_devices=8]

Resumes from the latest checkpoint in DIR if there is one.
"""

import os

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Checkpoints and metrics.')
_CPU_DEVICES = flags.DEFINE_integer(
    'cpu_devices', 8,
    'Virtual devices to create when JAX runs on the CPU (ignored on GPU/TPU).')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # Quiet JAX's backend probing.
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_num_cpu_devices', _CPU_DEVICES.value)
  from loc_opt import train  # pylint: disable=g-import-not-at-top
  summary = train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  print(train.format_summary(summary))
  print(f'metrics: {os.path.join(_WORKDIR.value, "metrics.jsonl")}')


if __name__ == '__main__':
  app.run(main)
