r"""The bytes-at-quality frontier: final eval loss against cross-worker bytes.

At one budget (the 0.5M LM, M = 4 workers, ``--num_steps`` x 32 x 128
bytes: 2,400 steps are 21 tokens per parameter) this trains data-parallel
and the low-communication methods that trade bytes for loss:

* DiLoCo at H in {30, 100, 300} with fp32, int8, fp4 (e3m0) and 2-bit
  outer payloads (``outer.codec``);
* Streaming DiLoCo (P = 3 fragments, tau = 1 step of overlap, fp4);
* SparseLoCo (tile top-k, 2-bit values, error feedback);
* MuLoCo's 2-bit statistical codec with error feedback (decay 0.9) on
  DiLoCo's pseudo-gradients (the codec of Thérien et al., 2025, with the
  AdamW inner optimizer of the other rows, not Muon);
* NoLoCo (no all-reduce) and DeMo (every step);

each with its key knob (:data:`RUNS`: the outer learning rate, top-k) at
its default and, with ``--tune``, at the other values (its best counts).
Bytes are read from each run's compiled programs, so the workers are real
devices (``--cpu_devices=4``, one worker each). The results file
``frontier.json`` holds every run, the Pareto front and, for data-parallel's
loss, the largest reduction of cross-worker bytes within 2% and within 5%
of it (:mod:`experiments._frontier_tables` renders them; ``experiments.
tables`` draws ``docs/figures/frontier.png``).

  python -m experiments.frontier --workdir=/work/frontier [--tune] \
    [--runs=dp,diloco_h30_fp32,...] [--num_steps=2400]

Every run resumes from its last checkpoint and a finished run is read back,
so the command can be stopped and rerun at any time; the results file is
rewritten after every run with the runs still to do listed (``pending``).
The runs go in :data:`RUNS`' order (the most telling first: data-parallel,
DiLoCo fp32 and its cheapest payloads, then the other methods, then the
tuning).
"""

import os

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _claims
from experiments import _frontier_tables
from experiments import _runs
from experiments._frontier_runs import config_of
from experiments._frontier_runs import points
from experiments._frontier_runs import run_dir_name
from experiments._frontier_runs import RUNS

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/diloco_lm.py',
                                          'Config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Parent of the run dirs.')
_RUNS = flags.DEFINE_list('runs', None, 'Subset of the runs (default: all).')
_NUM_STEPS = flags.DEFINE_integer('num_steps', 2400, 'Steps of every run.')
_SIZE = flags.DEFINE_enum(
    'size', '0.5M', list(_claims.SIZES), 'The LM size (the claims study\'s '
    'sizes; 2,400 steps at 0.5M and 1,000 at 0.2M are about 21 tokens per '
    'parameter).')
_TUNE = flags.DEFINE_bool('tune', False, 'Also run every run\'s other knob '
                          'values (its best counts).')
_DP_LR = flags.DEFINE_float(
    'dp_lr', 1.2e-2, 'Data-parallel\'s peak learning rate (the best of the '
    'claims study at this budget).')
_INNER_LR = flags.DEFINE_float(
    'inner_lr', 3e-3, 'The inner (AdamW) peak learning rate of the other '
    'methods (DiLoCo M = 4\'s in the claims study).')
_OUTER_LRS = flags.DEFINE_list(
    'outer_lrs', None, 'The outer learning rates of the runs whose knob is '
    'the outer learning rate, the default first (default: 0.7, 0.4).')
_RESULTS_NAME = flags.DEFINE_enum(
    'results_name', 'frontier', ['frontier', 'frontier_459k'],
    'The results file: frontier (0.2M) or frontier_459k (the 0.5M LM).')
_MERGE_ONLY = flags.DEFINE_bool('merge_only', False, 'Train nothing: write '
                                'the results of the finished runs.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 4, 'Virtual CPU devices '
                                    '(one per worker).')
flags.mark_flag_as_required('workdir')


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  names = _runs.chosen(_RUNS.value, RUNS)
  base = _runs.variant(_CONFIG.value, **_claims.size_fields(_SIZE.value))
  base.progress = False
  outer_lrs = [float(v) for v in _OUTER_LRS.value or []]
  if any(v <= 0 for v in outer_lrs):
    raise app.UsageError(f'--outer_lrs must be positive, got {outer_lrs}')
  todo = points(names, _TUNE.value, outer_lrs)
  rows = []

  def finished(run_dir):
    return os.path.exists(os.path.join(run_dir, 'summary.json'))

  def write():
    left = [run_dir_name(n, v, outer_lrs) for n, v in todo
            if run_dir_name(n, v, outer_lrs) not in {r['name'] for r in rows}]
    setup = {'size': _SIZE.value, 'num_steps': _NUM_STEPS.value, 'batch_size': base.batch_size,
             'seq_len': base.data.seq_len, 'workers': 4,
             'dp_lr': _DP_LR.value, 'inner_lr': _INNER_LR.value,
             'outer_momentum': base.outer.momentum, 'tune': _TUNE.value,
             'outer_lrs': outer_lrs or None}
    results = _frontier_tables.results(rows, setup, left)
    _runs.write(_WORKDIR.value, _RESULTS_NAME.value,
                _frontier_tables.frontier_main({'results': results}),
                results)

  for name, value in todo:
    run_dir = os.path.join(_WORKDIR.value,
                           run_dir_name(name, value, outer_lrs))
    if _MERGE_ONLY.value and not finished(run_dir):
      continue
    c = config_of(base, name, value, num_steps=_NUM_STEPS.value,
                  dp_lr=_DP_LR.value, inner_lr=_INNER_LR.value,
                  devices=_CPU_DEVICES.value)
    family, label, _, knob = RUNS[name]
    if knob is not None:
      label += f' ({knob[0].split("__")[-1]} {value:g})'
    s = _runs.read_back(c, run_dir, label) or _runs.run(c, run_dir, label)
    rows.append({'name': run_dir_name(name, value, outer_lrs), 'run': name,
                 'family': family, 'label': label, 'knob_value': value,
                 'final_eval_loss': s['final_eval_loss'],
                 'cross_worker_bytes': s['cross_worker_bytes'],
                 'data_parallel_cross_worker_bytes':
                     s['data_parallel_cross_worker_bytes'],
                 'syncs': s['syncs'], 'steps': s['step'],
                 'num_params': s['num_params'], 'curve': s['curve']['eval']})
    write()
  write()


if __name__ == '__main__':
  app.run(main)
