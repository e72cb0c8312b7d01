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

import copy
import os

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _frontier_tables
from experiments import _runs

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/diloco_lm.py',
                                          'Config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Parent of the run dirs.')
_RUNS = flags.DEFINE_list('runs', None, 'Subset of the runs (default: all).')
_NUM_STEPS = flags.DEFINE_integer('num_steps', 2400, 'Steps of every run.')
_TUNE = flags.DEFINE_bool('tune', False, 'Also run every run\'s other knob '
                          'values (its best counts).')
_DP_LR = flags.DEFINE_float(
    'dp_lr', 1.2e-2, 'Data-parallel\'s peak learning rate (the best of the '
    'claims study at this budget).')
_INNER_LR = flags.DEFINE_float(
    'inner_lr', 3e-3, 'The inner (AdamW) peak learning rate of the other '
    'methods (DiLoCo M = 4\'s in the claims study).')
_MERGE_ONLY = flags.DEFINE_bool('merge_only', False, 'Train nothing: write '
                                'the results of the finished runs.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 4, 'Virtual CPU devices '
                                    '(one per worker).')
flags.mark_flag_as_required('workdir')

_FP4 = {'outer__codec': 'fp4_e3m0', 'outer__codec_kwargs': {
    'block_size': None}}


def _diloco(h, codec=None):
  fields = {'outer__method': 'diloco', 'outer__sync_every': h}
  fields.update(codec or {})
  return fields


# name -> (family, label, overrides ('__' for '.'), (knob field, values:
# the default first)). Family: the point's method in the figure.
RUNS = {
    'dp': ('data-parallel', 'data-parallel, fp32',
           {'outer__method': 'data_parallel'}, None),
    'diloco_h30_fp32': ('DiLoCo', 'DiLoCo H=30, fp32', _diloco(30),
                        ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h100_fp32': ('DiLoCo', 'DiLoCo H=100, fp32', _diloco(100),
                         ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h300_fp32': ('DiLoCo', 'DiLoCo H=300, fp32', _diloco(300),
                         ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h100_fp4': ('DiLoCo', 'DiLoCo H=100, fp4', _diloco(100, _FP4),
                        ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h300_2bit': ('DiLoCo', 'DiLoCo H=300, 2-bit',
                         _diloco(300, {'outer__codec': 'two_bit'}),
                         ('outer__learning_rate', (0.7, 0.4))),
    'streaming_h100_fp4': ('Streaming DiLoCo',
                           'Streaming DiLoCo H=100, P=3, tau=1, fp4',
                           {'outer__method': 'streaming_diloco',
                            'outer__sync_every': 100, **_FP4},
                           ('outer__learning_rate', (0.7, 0.4))),
    'sparseloco_h30': ('SparseLoCo', 'SparseLoCo H=30 (top-128 per 64x64)',
                       {'outer__method': 'sparseloco',
                        'outer__sync_every': 30},
                       ('outer__sparseloco__topk', (128, 32))),
    'muloco2bit_h30': ('DiLoCo + MuLoCo codec',
                       'DiLoCo H=30, 2-bit statistical + EF 0.9',
                       _diloco(30, {'outer__codec': 'statistical',
                                    'outer__codec_kwargs': {'bits': 2},
                                    'outer__error_feedback': 'ef',
                                    'outer__ef_decay': 0.9}),
                       ('outer__learning_rate', (0.7, 0.4))),
    'noloco_h30': ('NoLoCo', 'NoLoCo H=30', {'outer__method': 'noloco',
                                             'outer__sync_every': 30},
                   ('outer__learning_rate', (0.7, 0.4))),
    'demo': ('DeMo', 'DeMo (every step, top-32 of 64x64 DCT)',
             {'outer__method': 'demo'}, ('outer__demo__topk', (32, 8))),
    'diloco_h30_int8': ('DiLoCo', 'DiLoCo H=30, int8',
                        _diloco(30, {'outer__codec': 'int8'}),
                        ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h30_fp4': ('DiLoCo', 'DiLoCo H=30, fp4', _diloco(30, _FP4),
                       ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h30_2bit': ('DiLoCo', 'DiLoCo H=30, 2-bit',
                        _diloco(30, {'outer__codec': 'two_bit'}),
                        ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h100_int8': ('DiLoCo', 'DiLoCo H=100, int8',
                         _diloco(100, {'outer__codec': 'int8'}),
                         ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h100_2bit': ('DiLoCo', 'DiLoCo H=100, 2-bit',
                         _diloco(100, {'outer__codec': 'two_bit'}),
                         ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h300_int8': ('DiLoCo', 'DiLoCo H=300, int8',
                         _diloco(300, {'outer__codec': 'int8'}),
                         ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h300_fp4': ('DiLoCo', 'DiLoCo H=300, fp4', _diloco(300, _FP4),
                        ('outer__learning_rate', (0.7, 0.4))),
}


def points(names, tune: bool) -> list[tuple[str, object]]:
  """``(run, knob value)`` in the order they run: each run at its default,
  then (``tune``) each run's other values."""
  out = [(n, RUNS[n][3][1][0] if RUNS[n][3] else None) for n in names]
  if tune:
    out += [(n, v) for n in names if RUNS[n][3]
            for v in RUNS[n][3][1][1:]]
  return out


def run_dir_name(name: str, value) -> str:
  """The run directory: the run's name, with the knob value where it is
  not the default."""
  knob = RUNS[name][3]
  return name if knob is None or value == knob[1][0] else f'{name}_{value:g}'


def config_of(base, name: str, value, *, num_steps: int, dp_lr: float,
              inner_lr: float, devices: int):
  """The config of run ``name`` at knob ``value``: M = 4 workers over
  ``devices`` devices, ``num_steps`` steps, the base config's model."""
  _, _, overrides, knob = RUNS[name]
  fields = {'num_steps': num_steps, 'mesh__workers': 4,
            'mesh__data': devices // 4, 'mesh__fsdp': 1, 'mesh__tensor': 1,
            'eval_every': max(num_steps // 6, 1),
            'checkpoint_every': max(num_steps // 6, 1),
            'optimizer__learning_rate': (
                dp_lr if overrides['outer__method'] == 'data_parallel'
                else inner_lr)}
  fields.update(overrides)
  if knob is not None:
    fields[knob[0]] = value
  return _runs.variant(base, **fields)


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  names = _runs.chosen(_RUNS.value, RUNS)
  base = copy.deepcopy(_CONFIG.value)
  base.progress = False
  todo = points(names, _TUNE.value)
  rows = []

  def finished(run_dir):
    return os.path.exists(os.path.join(run_dir, 'summary.json'))

  def write():
    left = [run_dir_name(n, v) for n, v in todo
            if run_dir_name(n, v) not in {r['name'] for r in rows}]
    setup = {'num_steps': _NUM_STEPS.value, 'batch_size': base.batch_size,
             'seq_len': base.data.seq_len, 'workers': 4,
             'dp_lr': _DP_LR.value, 'inner_lr': _INNER_LR.value,
             'outer_momentum': base.outer.momentum, 'tune': _TUNE.value}
    results = _frontier_tables.results(rows, setup, left)
    _runs.write(_WORKDIR.value, 'frontier',
                _frontier_tables.frontier_main({'results': results}),
                results)

  for name, value in todo:
    run_dir = os.path.join(_WORKDIR.value, run_dir_name(name, value))
    if _MERGE_ONLY.value and not finished(run_dir):
      continue
    c = config_of(base, name, value, num_steps=_NUM_STEPS.value,
                  dp_lr=_DP_LR.value, inner_lr=_INNER_LR.value,
                  devices=_CPU_DEVICES.value)
    family, label, _, knob = RUNS[name]
    if knob is not None:
      label += f' ({knob[0].split("__")[-1]} {value:g})'
    s = _runs.run(c, run_dir, label)
    rows.append({'name': run_dir_name(name, value), 'run': name,
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
