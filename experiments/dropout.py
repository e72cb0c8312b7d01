r"""Worker dropout on the reference LM: syncs that a worker misses.

Trains the config's LM (4 workers x 2 devices) with DiLoCo and Streaming
DiLoCo, each once with every worker at every sync and once with the
``faults`` section's dropout: at ``--drop_fraction`` of the syncs (at least;
drawn from the seed) one worker, drawn too, misses the sync. The absent
worker's pseudo-gradient is left out of the mean, which is over the present
workers, and it rejoins from the new anchor (``loc_opt.train.faults``).
Reports the final eval loss of each run and the relative change that
dropout causes.

  python -m experiments.dropout --workdir=/tmp/dropout \
    [--runs=diloco,diloco_drop,...] [--drop_fraction=0.25] \
    [--config.num_steps=300]

Each run lives in its own directory under --workdir and resumes from its
checkpoints (a finished run is read back, not retrained). Writes
``dropout.md`` and ``dropout.json`` to --workdir.
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _fault_tables
from experiments import _runs

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/diloco_lm.py',
                                          'Config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Parent of the run dirs.')
_RUNS = flags.DEFINE_list('runs', None, 'Subset of the runs (default: all).')
_FRACTION = flags.DEFINE_float('drop_fraction', 0.25,
                               'Fraction of syncs that lose one worker.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')
flags.mark_flag_as_required('workdir')

# name -> (label, method, drops?); Streaming DiLoCo with 2 fragments (the
# reference H = 50 is not a multiple of the config's 3).
RUNS = {
    'diloco': ('DiLoCo, every worker', 'diloco', False),
    'diloco_drop': ('DiLoCo, 1 of M absent', 'diloco', True),
    'streaming': ('Streaming DiLoCo (P=2), every worker', 'streaming_diloco',
                  False),
    'streaming_drop': ('Streaming DiLoCo (P=2), 1 of M absent',
                       'streaming_diloco', True),
}
_FRAGMENTS = 2


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  names = _runs.chosen(_RUNS.value, RUNS)
  config = _CONFIG.value
  results = {}
  for name in names:
    label, method, drops = RUNS[name]
    overrides = {'outer__method': method,
                 'faults__drop_fraction': _FRACTION.value if drops else 0.0}
    if method == 'streaming_diloco':
      overrides['outer__streaming_diloco__num_fragments'] = _FRAGMENTS
    run_config = _runs.variant(config, **overrides)
    summary = _runs.run(run_config, f'{_WORKDIR.value}/{name}', label)
    results[name] = {k: summary[k] for k in (
        'final_eval_loss', 'final_train_loss', 'syncs', 'left_out',
        'cross_worker_bytes', 'curve')}
  numbers = {'config': config.to_dict(), 'drop_fraction': _FRACTION.value,
             'runs': results}
  _runs.write(_WORKDIR.value, 'dropout', _fault_tables.dropout_main(
      {'runs': _runs.RUNS, 'results': numbers}), numbers)


if __name__ == '__main__':
  app.run(main)
