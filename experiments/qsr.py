r"""QSR's growing sync period against a constant H at equal communication.

The Quadratic Synchronization Rule (Gu, Lyu, Arora, Zhang, Huang, "A
Quadratic Synchronization Rule for Distributed Deep Learning", ICLR 2024)
sets Local AdamW's sync period from the learning rate, ``H = max(H_base,
floor((alpha / lr_t)^2))``, so a run syncs often while the rate is high and
rarely as it decays. The claim: at the same number of syncs, this beats a
constant period. This study trains the reference LM with parameter averaging
(``configs/local_sgd_lm.py``, the paper's outer step: lr 1, no momentum, Adam
moments kept per worker) on M workers:

* constant ``H_base`` (the most syncs: the reference point);
* for each target sync count in ``--syncs``: QSR with the ``alpha`` that makes
  exactly that many syncs over the run (found by bisection on the config's
  own learning-rate schedule; rounds laid out as in the reference code, H
  frozen per round and ``H_base`` during warmup), and the constant period
  ``num_steps / syncs`` with the same count.

So each QSR run has a constant-H twin that moves the same bytes, and the
table reports both losses and their difference.

  python -m experiments.qsr --workdir=/tmp/qsr \
    [--num_steps=600] [--base_period=10] [--syncs=30,15] [--workers=4] \
    [--seeds=0,1,2]

Finished runs are read back and an interrupted one resumes; ``qsr.json`` is
rewritten after every run.
"""

import copy
import os

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _runs
from experiments import _claims
from experiments import tables

_CONFIG = config_flags.DEFINE_config_file(
    'config', 'configs/local_sgd_lm.py', 'Config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Parent of the run dirs.')
_BASE = flags.DEFINE_integer('base_period', 10, 'H_base of QSR, and the '
                             'constant period of the reference run.')
_SYNCS = flags.DEFINE_list('syncs', ['30', '15'],
                           'Sync counts of the QSR / constant-H pairs.')
_WORKERS = flags.DEFINE_integer('workers', 4, 'Workers M.')
_NUM_STEPS = flags.DEFINE_integer('num_steps', 600, 'Steps of every run.')
_SEEDS = flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds of every run.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')
flags.mark_flag_as_required('workdir')


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  base = copy.deepcopy(_CONFIG.value)
  base.progress = False
  base.num_steps = _NUM_STEPS.value
  base.eval_every = base.checkpoint_every = max(_NUM_STEPS.value // 6, 1)
  devices = (base.mesh.workers * base.mesh.data * base.mesh.fsdp
             * base.mesh.tensor)
  m = _WORKERS.value
  if m < 2 or devices % m or base.batch_size % m:
    raise app.UsageError(f'--workers={m} must be >= 2 and divide the '
                         f'{devices} devices and batch_size {base.batch_size}')
  steps, h0 = base.num_steps, _BASE.value
  if not 1 <= h0 <= steps:
    raise app.UsageError(f'--base_period={h0} must be in [1, num_steps]')
  try:
    targets = [int(s) for s in _SYNCS.value]
    seeds = [int(s) for s in _SEEDS.value]
  except ValueError as e:
    raise app.UsageError(f'--syncs and --seeds take integers: {e}') from e
  for n in targets:
    if steps % n or not 1 <= n < steps // h0:
      raise app.UsageError(
          f'--syncs={n} must divide num_steps {steps} (the constant twin '
          f'H = num_steps / syncs) and be fewer than {steps // h0}, the '
          f'syncs of H_base {h0}')
  base = _runs.variant(base, outer__sync_every=h0, mesh__workers=m,
                       mesh__data=devices // m, mesh__fsdp=1, mesh__tensor=1)
  # (name, rule, knob, pair, config); the reference run first.
  jobs = [(f'constant_h{h0}', 'constant', h0, None,
           _runs.variant(base, outer__sync_every=h0))]
  for n in targets:
    try:
      alpha = _claims.qsr_alpha_for(base, n)
    except ValueError as e:
      raise app.UsageError(f'--syncs={n}: {e}') from e
    jobs.append((f'qsr_{n}', 'qsr', alpha, n,
                 _claims.qsr_config(base, alpha)))
    jobs.append((f'constant_h{steps // n}', 'constant', steps // n, n,
                 _runs.variant(base, outer__sync_every=steps // n)))
  setup = {'num_steps': steps, 'batch_size': base.batch_size,
           'seq_len': base.data.seq_len, 'workers': m, 'devices': devices,
           'base_period': h0, 'method': base.outer.method,
           'optimizer': base.optimizer.name,
           'learning_rate': base.optimizer.learning_rate,
           'schedule': base.optimizer.schedule,
           'schedule_kwargs': dict(base.optimizer.schedule_kwargs)}
  runs = [(j, s) for s in seeds for j in jobs]
  rows = []
  for i, ((name, rule, knob, pair, c), seed) in enumerate(runs):
    c = _runs.variant(c, seed=seed)
    label = (f'QSR alpha {knob:.4g}' if rule == 'qsr' else f'H = {knob}')
    s = _runs.run(c, os.path.join(_WORKDIR.value, f'{name}_s{seed}'),
                  f'{label}, seed {seed}')
    expected = _claims.count_syncs(c)
    if s['syncs'] != expected:
      raise SystemExit(f'{label}: the run synced {s["syncs"]} times, its '
                       f'schedule says {expected}; the pairs would not move '
                       'equal bytes')
    rows.append({'name': name, 'rule': rule, 'knob': knob, 'pair': pair,
                 'seed': seed, 'expected_syncs': expected,
                 'syncs': s['syncs'], 'final_eval_loss': s['final_eval_loss'],
                 'cross_worker_bytes': s['cross_worker_bytes'],
                 'steps': s['step'], 'curve': s['curve']['eval']})
    results = {'setup': setup, 'rows': rows,
               'pending': [f'{j[0]}_s{sd}' for j, sd in runs[i + 1:]]}
    _runs.write(_WORKDIR.value, 'qsr',
                tables.render('qsr', 'main', {'results': results}), results)


if __name__ == '__main__':
  app.run(main)
