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

Longer runs of a smaller model (``--size``, a model of
``experiments._claims.SIZES``), with the workers stacked on one device
(``--simulate_workers``: the same numerics, no bytes measured) and the inner
peak lr picked first (``--peak_lrs``: the constant ``H_base`` run of the
first seed at each, the lowest final eval loss wins), into their own results
file:

  python -m experiments.qsr --workdir=/tmp/qsr_budget --size=0.2M \
    --num_steps=1000 --syncs=50,25 --peak_lrs=0.012,0.024 \
    --simulate_workers --cpu_devices=1 --config.mesh.workers=1 \
    --config.mesh.data=1 --results_name=qsr_budget

Finished runs are read back and an interrupted one resumes; the results file
is rewritten after every run.
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
_SIZE = flags.DEFINE_enum(
    'size', None, list(_claims.SIZES), 'A model size of the claims study '
    '(experiments._claims.SIZES) instead of the config\'s model.')
_SIMULATE = flags.DEFINE_bool(
    'simulate_workers', False, 'Stack the M workers on every device '
    '(mesh.simulate_workers: the same numerics, no bytes measured), e.g. on '
    'one device with --cpu_devices=1 --config.mesh.workers=1 '
    '--config.mesh.data=1.')
_PEAK_LRS = flags.DEFINE_list(
    'peak_lrs', [], 'Inner peak learning rates to try first: the constant '
    'H_base run of the first seed at each; the grid runs at the one with '
    'the lowest final eval loss (empty: the config\'s).')
# The results files this study writes (NAME.json): the short study, and
# longer runs of a smaller model (--size) with the inner lr picked first.
RESULTS_NAMES = ('qsr', 'qsr_budget')
_RESULTS_NAME = flags.DEFINE_enum(
    'results_name', 'qsr', RESULTS_NAMES,
    'The results file (NAME.json) this study writes.')
flags.mark_flag_as_required('workdir')


def _base_config():
  """The config every run varies: size, steps, H_base and the mesh."""
  base = copy.deepcopy(_CONFIG.value)
  base.progress = False
  base.num_steps = _NUM_STEPS.value
  base.eval_every = base.checkpoint_every = max(_NUM_STEPS.value // 6, 1)
  devices = (base.mesh.workers * base.mesh.data * base.mesh.fsdp
             * base.mesh.tensor)
  m, simulate = _WORKERS.value, _SIMULATE.value
  if m < 2 or (devices % m and not simulate) or base.batch_size % m:
    raise app.UsageError(
        f'--workers={m} must be >= 2 and divide batch_size '
        f'{base.batch_size} and (without --simulate_workers) the {devices} '
        'devices')
  if not 1 <= _BASE.value <= base.num_steps:
    raise app.UsageError(f'--base_period={_BASE.value} must be in '
                         '[1, num_steps]')
  base = _runs.variant(
      base, outer__sync_every=_BASE.value, mesh__workers=m,
      mesh__data=devices if simulate else devices // m,
      mesh__simulate_workers=simulate, mesh__fsdp=1, mesh__tensor=1,
      **_claims.size_fields(_SIZE.value))
  return base, devices


def _jobs(base, targets):
  """``(name, rule, knob, pair, config)`` per run of a seed, the constant
  H_base reference first, then each QSR run and its constant twin."""
  steps, h0 = base.num_steps, _BASE.value
  jobs = [(f'constant_h{h0}', 'constant', h0, None, base)]
  for n in targets:
    try:
      alpha = _claims.qsr_alpha_for(base, n)
    except ValueError as e:
      raise app.UsageError(f'--syncs={n}: {e}') from e
    jobs.append((f'qsr_{n}', 'qsr', alpha, n,
                 _claims.qsr_config(base, alpha)))
    jobs.append((f'constant_h{steps // n}', 'constant', steps // n, n,
                 _runs.variant(base, outer__sync_every=steps // n)))
  return jobs


def _run(job, seed, lr):
  """Trains (or reads back) one run; its row."""
  name, rule, knob, pair, c = job
  c = _runs.variant(c, seed=seed, optimizer__learning_rate=lr)
  label = (f'QSR alpha {knob:.4g}' if rule == 'qsr' else f'H = {knob}')
  tail = f'_lr{lr:g}' if _PEAK_LRS.value else ''
  s = _runs.run(c, os.path.join(_WORKDIR.value, f'{name}{tail}_s{seed}'),
                f'{label}, lr {lr:g}, seed {seed}')
  expected = _claims.count_syncs(c)
  if pair is not None and expected != pair:
    raise SystemExit(f'{label}: its schedule makes {expected} syncs at lr '
                     f'{lr:g}, not the {pair} of its pair')
  if s['syncs'] != expected:
    raise SystemExit(f'{label}: the run synced {s["syncs"]} times, its '
                     f'schedule says {expected}; the pairs would not move '
                     'equal bytes')
  row = {'name': name, 'rule': rule, 'knob': knob, 'pair': pair,
         'seed': seed, 'learning_rate': lr, 'expected_syncs': expected,
         'syncs': s['syncs'], 'final_eval_loss': s['final_eval_loss'],
         'cross_worker_bytes': s['cross_worker_bytes'],
         'steps': s['step'], 'curve': s['curve']['eval']}
  if s.get('simulated_workers'):  # its bytes are not measured
    row['simulated_workers'] = s['simulated_workers']
    row['cross_worker_bytes'] = None
  return row


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  base, devices = _base_config()
  steps, h0 = base.num_steps, _BASE.value
  try:
    targets = [int(s) for s in _SYNCS.value]
    seeds = [int(s) for s in _SEEDS.value]
    lrs = [float(v) for v in _PEAK_LRS.value]
  except ValueError as e:
    raise app.UsageError(f'--syncs, --seeds take integers and --peak_lrs '
                         f'numbers: {e}') from e
  for n in targets:
    if steps % n or not 1 <= n < steps // h0:
      raise app.UsageError(
          f'--syncs={n} must divide num_steps {steps} (the constant twin '
          f'H = num_steps / syncs) and be fewer than {steps // h0}, the '
          f'syncs of H_base {h0}')
  setup = {'num_steps': steps, 'batch_size': base.batch_size,
           'seq_len': base.data.seq_len, 'workers': _WORKERS.value,
           'devices': devices, 'base_period': h0, 'method': base.outer.method,
           'size': _SIZE.value, 'simulated_workers': _SIMULATE.value,
           'optimizer': base.optimizer.name,
           'learning_rate': base.optimizer.learning_rate,
           'schedule': base.optimizer.schedule,
           'schedule_kwargs': dict(base.optimizer.schedule_kwargs)}
  for lr in lrs or [base.optimizer.learning_rate]:  # --syncs it can make
    _jobs(_runs.variant(base, optimizer__learning_rate=lr), targets)
  check = [(_jobs(base, [])[0], seeds[0], lr) for lr in lrs]
  results = {'setup': setup, 'lr_check': [], 'rows': []}

  def write(pending):
    results['pending'] = pending
    _runs.write(_WORKDIR.value, _RESULTS_NAME.value,
                tables.render(_RESULTS_NAME.value, 'main',
                              {'results': results}), results)

  for i, (job, seed, lr) in enumerate(check):
    results['lr_check'].append(_run(job, seed, lr))
    write([f'{job[0]}_lr{x:g}_s{seed}' for _, _, x in check[i + 1:]])
  if lrs:
    setup['learning_rate'] = _claims.best_lr(results['lr_check'])
  # QSR's alpha for each sync count follows from the lr schedule it runs.
  jobs = _jobs(_runs.variant(
      base, optimizer__learning_rate=setup['learning_rate']), targets)
  # The reference and the first pair over every seed, then the next pair.
  groups = [jobs[:3]] + [jobs[k:k + 2] for k in range(3, len(jobs), 2)]
  runs = [(j, s) for g in groups for s in seeds for j in g]
  for i, (job, seed) in enumerate(runs):
    results['rows'].append(_run(job, seed, setup['learning_rate']))
    write([f'{j[0]}_s{sd}' for j, sd in runs[i + 1:]])


if __name__ == '__main__':
  app.run(main)
