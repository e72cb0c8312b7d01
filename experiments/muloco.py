r"""MuLoCo against its baselines at equal tokens, loss against bits sent.

Trains the reference LM (4 workers x 2 devices, configs/muloco_lm.py) with

* data parallelism with AdamW and with Muon (+ AdamW on embeddings, head,
  norms), the every-step baselines;
* DiLoCo with AdamW inside (outer lr 0.7, momentum 0.9, H = 30, fp32);
* MuLoCo (Muon inside, outer lr 0.7, momentum 0.6, H = 30) with fp32
  pseudo-gradients, and with the row-wise statistical quantizer at 8, 4 and
  2 bits and the row-wise min/max linear quantizer at 2 bits, each with
  error feedback (decay 0.9) and without; norms, embedding and head are
  sent in fp32 in every compressed run (the paper's skip masks);

and reports per run the final eval loss, the total cross-worker bytes read
from the compiled programs, the bytes one worker sends per sync and the
bits per parameter per sync.

  python -m experiments.muloco --workdir=/tmp/muloco \
    [--runs=dp_adamw,muloco_2bit_ef,...] [--config.num_steps=300]

Each run has its own directory under --workdir and resumes from its
checkpoints (a finished run is read back, not retrained). Writes
``muloco.md`` and ``muloco.json`` to --workdir.

Reference: Thérien, Huang, Rish, Belilovsky, *MuLoCo: Muon is a practical
inner optimizer for DiLoCo*, 2025 (arXiv 2505.23725).
"""

import copy
import os

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _compress_tables
from experiments import _runs

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/muloco_lm.py',
                                          'Config file (MuLoCo).')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Parent of the run dirs.')
_RUNS = flags.DEFINE_list('runs', None, 'Subset of the runs (default: all).')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')
flags.mark_flag_as_required('workdir')

# AdamW as configs/diloco_lm.py sets it (the DP-AdamW and DiLoCo inner
# optimizer).
ADAMW = {
    'optimizer__name': 'adamw',
    'optimizer__learning_rate': 3e-3,
    'optimizer__schedule_kwargs': {'warmup_steps': 0.1, 'end_value': 3e-4},
    'optimizer__kwargs': {'b1': 0.9, 'b2': 0.95, 'weight_decay': 0.1},
}
PLAIN = {'outer__codec': 'none', 'outer__codec_kwargs': {},
         'outer__error_feedback': 'none', 'outer__ef_decay': 1.0,
         'outer__compress_skip': ()}


def _compressed(codec, bits, ef):
  return {'outer__codec': codec, 'outer__codec_kwargs': {'bits': bits},
          'outer__error_feedback': 'ef' if ef else 'none',
          'outer__ef_decay': 0.9 if ef else 1.0}


def _runs_table():
  """name -> (label, overrides of the MuLoCo config, '__' for '.')."""
  runs = {
      'dp_adamw': ('DP AdamW', {**ADAMW, **PLAIN,
                                'outer__method': 'data_parallel'}),
      'dp_muon': ('DP Muon', {**PLAIN, 'outer__method': 'data_parallel'}),
      'diloco_adamw': ('DiLoCo AdamW (fp32)', {
          **ADAMW, **PLAIN, 'outer__momentum': 0.9}),
      'muloco_32bit': ('MuLoCo fp32', dict(PLAIN)),
  }
  for bits in (8, 4, 2):
    for ef in (True, False):
      runs[f'muloco_{bits}bit{"_ef" if ef else ""}'] = (
          f'MuLoCo {bits}-bit statistical{", EF 0.9" if ef else ""}',
          _compressed('statistical', bits, ef))
  for ef in (True, False):
    runs[f'muloco_2bit_linear{"_ef" if ef else ""}'] = (
        f'MuLoCo 2-bit linear{", EF 0.9" if ef else ""}',
        _compressed('row_linear', 2, ef))
  return runs


RUNS = _runs_table()


def _row(name, label, summary, config, num_params):
  syncs = summary.get('syncs') or 0
  if config.outer.method == 'data_parallel':
    syncs = summary['step']  # every step sends the gradient
  per_sync = (summary['cross_worker_bytes'] / max(syncs, 1)
              / config.mesh.workers)
  return {'name': name, 'label': label,
          'final_eval_loss': summary['final_eval_loss'],
          'steps': summary['step'], 'syncs': syncs,
          'cross_worker_bytes': summary['cross_worker_bytes'],
          'bytes_per_worker_per_sync': per_sync,
          'bits_per_param_per_sync': 8 * per_sync / num_params,
          'curve': summary['curve']}


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  from loc_opt import models  # pylint: disable=g-import-not-at-top

  names = _runs.chosen(_RUNS.value, RUNS)
  base = copy.deepcopy(_CONFIG.value)
  base.progress = False
  num_params = models.build_model(base.model).num_params
  rows = []
  for name in names:
    label, overrides = RUNS[name]
    config = _runs.variant(base, **overrides)
    summary = _runs.run(config, os.path.join(_WORKDIR.value, name), label)
    rows.append(_row(name, label, summary, config, num_params))

  # What the results file will hold, as experiments.tables renders it.
  markdown = _compress_tables.muloco_main({'results': rows,
                                           'runs': _runs.RUNS})
  _runs.write(_WORKDIR.value, 'muloco', markdown, rows)


if __name__ == '__main__':
  app.run(main)
