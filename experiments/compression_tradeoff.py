r"""Final eval loss against cross-worker bytes, with and without compression.

Trains the config's LM at equal tokens (same data, batch and steps) with

* data parallelism: the GSPMD fp32 all-reduce, the per-worker fp32 mean the
  compressed runs build on, and every-step compressed means of the gradients
  (int8, PowerSGD rank 4, top-k 1% with error feedback);
* DiLoCo (H = --config.outer.sync_every): fp32, int8, fp4 (e3m0) and top-k
  3% with 2-bit values and error feedback on the pseudo-gradients;

reads each run's cross-worker bytes from its compiled programs, and writes a
markdown table (``compression_tradeoff.md``), the results file
(``compression_tradeoff.json``: summaries, configs, provenance) and a
plot of loss against bytes (``loss_vs_bytes.png``) to --workdir; table and
plot come from ``experiments._compress_tables``, which
``experiments.tables`` renders the docs' copies with from the results file.

  python -m experiments.compression_tradeoff --workdir=/tmp/compression \
    [--runs=dp,dp_int8,...] [--config.num_steps=300]
"""

import os

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _compress_tables
from experiments import _runs

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/diloco_lm.py',
                                          'Config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Parent of the run dirs.')
_RUNS = flags.DEFINE_list('runs', None, 'Subset of the runs (default: all).')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8,
                                    'Virtual CPU devices.')
flags.mark_flag_as_required('workdir')

_CDP = 'compressed_data_parallel'
# name -> (label, family, overrides of the config's `outer` section)
RUNS = {
    'dp': ('data-parallel, fp32 (GSPMD all-reduce)', 'data-parallel',
           {'method': 'data_parallel'}),
    # The fp32 reference of the compressed runs: each worker's gradient is
    # averaged with the same per-worker collective the codecs use (spread
    # over the worker's devices), so the ratios below are the codecs' alone.
    'dp_none': ('data-parallel, fp32 per-worker mean', 'data-parallel',
                {'method': _CDP, 'codec': 'none'}),
    'dp_int8': ('data-parallel, int8', 'data-parallel',
                {'method': _CDP, 'codec': 'int8'}),
    'dp_powersgd': ('data-parallel, PowerSGD r=4', 'data-parallel',
                    {'method': _CDP, 'codec': 'powersgd',
                     'codec_kwargs': {'rank': 4}}),
    'dp_topk': ('data-parallel, top-1% + EF', 'data-parallel',
                {'method': _CDP, 'codec': 'topk',
                 'codec_kwargs': {'density': 0.01, 'chunk': 4096},
                 'error_feedback': 'ef'}),
    'diloco': ('DiLoCo, fp32', 'DiLoCo', {'method': 'diloco'}),
    'diloco_int8': ('DiLoCo, int8', 'DiLoCo',
                    {'method': 'diloco', 'codec': 'int8'}),
    'diloco_fp4': ('DiLoCo, fp4 e3m0', 'DiLoCo',
                   {'method': 'diloco', 'codec': 'fp4_e3m0'}),
    'diloco_topk2bit': ('DiLoCo, top-3% 2-bit + EF', 'DiLoCo',
                        {'method': 'diloco', 'codec': 'topk',
                         'codec_kwargs': {'density': 0.03, 'chunk': 4096,
                                          'value_codec': 'two_bit'},
                         'error_feedback': 'ef'}),
}


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  import ml_collections  # pylint: disable=g-import-not-at-top
  from loc_opt.train import metrics  # pylint: disable=g-import-not-at-top

  names = _runs.chosen(_RUNS.value, RUNS)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  rows = []
  for name in names:
    label, family, overrides = RUNS[name]
    c = ml_collections.ConfigDict(_CONFIG.value.to_dict())
    for key, value in overrides.items():
      c.outer[key] = value
    s = _runs.run(c, os.path.join(_WORKDIR.value, name), label)
    s.update(name=name, label=label, family=family)
    rows.append(s)
    print(f'{label}: loss {s["final_eval_loss"]:.4f}, '
          f'{metrics.format_bytes(s["cross_worker_bytes"])}', flush=True)

  # What the results file will hold, as experiments.tables renders it.
  data = {'results': rows, 'runs': _runs.RUNS}
  _runs.write(_WORKDIR.value, 'compression_tradeoff',
              _compress_tables.compression_tradeoff_main(data), rows)
  _compress_tables.compression_figure(
      data, os.path.join(_WORKDIR.value, 'loss_vs_bytes.png'))


if __name__ == '__main__':
  app.run(main)
