r"""DiLoCo with M = 1 and M = 4 against data-parallel at three model sizes.

The DiLoCo scaling-law result (Charles et al., "Communication-Efficient
Language Model Training Scales Reliably and Robustly: Scaling Laws for
DiLoCo", 2025) is that DiLoCo with one worker reaches a lower loss than
data-parallel training at equal tokens, and that with more workers it comes
close to data-parallel, the gap shrinking as the model grows. This study
measures both on the reference byte-level LM at three sizes:

* ``0.5M``: 2 blocks, d_model 128, MLP 512 (459,392 parameters);
* ``2M``: 4 blocks, d_model 192, MLP 768 (about 1.9M);
* ``8M``: 6 blocks, d_model 320, MLP 1280 (about 7.5M);

all at the same tokens (``--num_steps`` x 32 sequences x 128 bytes), on 8
devices (data-parallel over 8; DiLoCo M = 1 as one worker of 8 devices;
M = 4 as 4 workers x 2). Tuning, what the paper tunes for each method:

* data-parallel: the inner (AdamW) peak learning rate over ``--dp_lrs``;
* DiLoCo M = 1 and M = 4: the outer learning rate over ``--outer_lrs``
  (Nesterov, momentum 0.9, H = ``--sync_every``) at each inner learning
  rate of ``--diloco_inner_lrs`` (the paper fits DiLoCo's inner rate apart
  from data-parallel's);

then the best setting of each method is rerun with the extra seeds
``--seeds`` (model initialisation and data order), and the table reports
its mean and spread (half the range) over all its seeds.

``--search=local`` runs fewer settings, for budgets where one run takes an
hour (20 tokens per parameter and more): from a start (the first value of
each list, e.g. the best of the 600-step grid) it runs the grid neighbours
of the best setting so far until the best is a local minimum of the grid
(``_claims.local_search``), methods taking turns; DiLoCo tunes its outer
learning rate and its outer momentum (``--outer_momenta``) at one inner
rate per method (``--method_inner_lrs``), data-parallel its learning rate.
Then the seeds of each best setting. ``diloco_m2`` (M = 2) is a method too.

  python -m experiments.claims --workdir=/work/runs/claims \
    [--sizes=0.5M,2M,8M] [--num_steps=600] [--sync_every=30]

Every run is resumable and a finished run is read back, so the command can
be stopped and rerun at any point; the results file ``claims.json`` is
rewritten after every run, with the runs still to do listed.

Part of the study can run elsewhere, e.g. the larger sizes on a GPU: there,
``--methods`` picks the methods that fit its devices (``dp,diloco_m1`` on one
device, with ``--config.mesh.data=1``) and the run writes its own
``claims.json``; here, ``--import_results=THAT_FILE`` adds its rows (and the
provenance of its runs) to the table and skips those runs. Every row names
the device it ran on; compare rows of one size across devices only at the
same matmul precision (``JAX_DEFAULT_MATMUL_PRECISION=highest`` on a GPU,
whose default for float32 is TF32). ``--simulate_workers`` runs M = 4 on
fewer than 4 devices (one GPU): its 4 workers are stacked on every device
(``mesh.simulate_workers``, tested equal to workers on their own devices),
and its rows say so instead of giving bytes.
"""

import copy
import os

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _runs
from experiments import _claims
from experiments import tables
from experiments._claims import METHODS
from experiments._claims import SIZES

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/diloco_lm.py',
                                          'Config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Parent of the run dirs.')
_SIZES = flags.DEFINE_list('sizes', ['0.5M', '2M', '8M'], 'Model sizes.')
_NUM_STEPS = flags.DEFINE_integer('num_steps', 600, 'Steps of every run.')
_SIZE_STEPS = flags.DEFINE_list(
    'steps_per_size', [], 'SIZE=STEPS pairs: the steps of the runs at that '
    'size instead of --num_steps (e.g. 0.2M=1000: the same tokens per '
    'parameter as 0.5M at 2400).')
_SYNC_EVERY = flags.DEFINE_integer('sync_every', 30, 'DiLoCo H.')
_DP_LRS = flags.DEFINE_list(
    'dp_lrs', ['2.4e-2', '1.2e-2', '6e-3', '3e-3', '1.5e-3'],
    'Data-parallel peak learning rates.')
_OUTER_LRS = flags.DEFINE_list('outer_lrs', ['0.2', '0.4', '0.7', '1.0'],
                               'DiLoCo outer learning rates.')
_INNER_LRS = flags.DEFINE_list(
    'diloco_inner_lrs', ['3e-3', '6e-3', '1.2e-2'],
    'DiLoCo inner (AdamW) peak learning rates, each with every outer lr; the '
    'DiLoCo scaling-law paper tunes them apart from data-parallel\'s.')
_MOMENTA = flags.DEFINE_list(
    'outer_momenta', [], 'DiLoCo outer momenta (each with every outer lr); '
    'empty: the config\'s only.')
_METHOD_INNER = flags.DEFINE_list(
    'method_inner_lrs', [], 'METHOD=LR or SIZE:METHOD=LR pairs: with '
    '--search=local, the one inner lr of that DiLoCo method (at that size; '
    'default: the first of --diloco_inner_lrs).')
_SEARCH = flags.DEFINE_enum(
    'search', 'grid', ['grid', 'local'], 'grid: every setting, then the '
    'seeds; local: the neighbours of the best setting until it is a local '
    'minimum of the grid (fewer runs), then the seeds.')
_SEEDS = flags.DEFINE_list('seeds', ['1', '2'],
                           'Extra seeds of each method\'s best setting.')
_METHODS = flags.DEFINE_list('methods', ['dp', 'diloco_m1', 'diloco_m4'],
                             'Methods to run here (keys of METHODS).')
_IMPORT = flags.DEFINE_list(
    'import_results', [], 'claims.json files written by other runs of this '
    'study (another machine); their rows join the table and are not rerun.')
_MERGE_ONLY = flags.DEFINE_bool(
    'merge_only', False, 'Train nothing: write the table of the imported '
    'rows, with every run of the grid not among them listed as to do.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')
# The results files this study writes (NAME.json; experiments.tables
# renders each): the main grid, and longer runs of the same table.
RESULTS_NAMES = ('claims', 'claims_long', 'claims_budget')
_RESULTS_NAME = flags.DEFINE_enum(
    'results_name', 'claims', RESULTS_NAMES,
    'The results file (NAME.json) this study writes.')
_SIMULATE = flags.DEFINE_bool(
    'simulate_workers', False, 'Stack the M = 4 workers on every device '
    '(mesh.simulate_workers: the same numerics, no bytes measured), so M = 4 '
    'runs on one device, e.g. a GPU.')
flags.mark_flag_as_required('workdir')



def _steps(size: str) -> int:
  """The steps of a run at ``size`` (``--steps_per_size`` or
  ``--num_steps``)."""
  return _claims.size_steps(_SIZE_STEPS.value).get(size, _NUM_STEPS.value)


def _floats(values, flag):
  try:
    return [float(v) for v in values]
  except ValueError as e:
    raise app.UsageError(f'--{flag} takes numbers, got {values}') from e


def _config(base, size, method, knob, seed, inner=None, momentum=None):
  """The run's config: ``knob`` is the tuned value (dp: inner lr; DiLoCo:
  outer lr), ``inner`` DiLoCo's inner lr and ``momentum`` its outer
  momentum where not the config's."""
  _, workers, overrides = METHODS[method]
  devices = (base.mesh.workers * base.mesh.data * base.mesh.fsdp
             * base.mesh.tensor)
  fields = _claims.size_fields(size)
  fields.update(overrides)
  simulate = _SIMULATE.value and workers > 1
  steps = _steps(size)
  fields.update({'num_steps': steps, 'seed': seed,
                 'outer__sync_every': _SYNC_EVERY.value,
                 'mesh__workers': workers,
                 'mesh__data': devices if simulate else devices // workers,
                 'mesh__simulate_workers': simulate,
                 'mesh__fsdp': 1, 'mesh__tensor': 1,
                 'eval_every': max(steps // 6, 1),
                 'checkpoint_every': max(steps // 6, 1)})
  if method == 'dp':
    fields['optimizer__learning_rate'] = knob
  else:
    fields['outer__learning_rate'] = knob
    if inner is not None:
      fields['optimizer__learning_rate'] = inner
    if momentum is not None:
      fields['outer__momentum'] = momentum
  return _runs.variant(base, **fields)


class _Study:
  """Runs (or reads back) the grid and writes the results after each."""

  def __init__(self, base, sizes, knobs, imported=(), methods=()):
    self.base, self.sizes, self.knobs = base, sizes, knobs
    self.methods = list(methods)
    self.rows: list[dict] = list(imported)
    self.imported = {r['name'] for r in imported}
    self.device = _device()

  def run(self, size, method, knob, seed, inner=None, momentum=None):
    name = _claims.run_name(size, method, knob, seed, inner, momentum)
    if name in self.imported:
      return None
    c = _config(self.base, size, method, knob, seed, inner, momentum)
    at = '' if inner is None else f' at inner {inner:g}'
    at += '' if momentum is None else f', momentum {momentum:g}'
    label = f'{size} {METHODS[method][0]}, {knob:g}{at}, seed {seed}'
    run_dir = os.path.join(_WORKDIR.value, name)
    s = _runs.read_back(c, run_dir, label) or _runs.run(c, run_dir, label)
    row = {'name': name, 'size': size, 'method': method, 'knob': knob,
           'inner_lr': inner, 'seed': seed, 'num_params': s['num_params'],
           'outer_momentum': momentum,
           'final_eval_loss': s['final_eval_loss'],
           'cross_worker_bytes': s['cross_worker_bytes'],
           'syncs': s['syncs'], 'steps': s['step'], 'device': self.device,
           'train_seconds': s.get('train_seconds_this_run'),
           'curve': s['curve']['eval']}
    if s.get('simulated_workers'):  # its bytes are not measured
      row['simulated_workers'] = s['simulated_workers']
      row['cross_worker_bytes'] = None
    self.rows.append(row)
    return row

  def write(self, pending):
    setup = {'num_steps': _NUM_STEPS.value, 'sync_every': _SYNC_EVERY.value,
             'batch_size': self.base.batch_size,
             'seq_len': self.base.data.seq_len,
             'outer_momentum': self.base.outer.momentum,
             'inner_learning_rate': self.base.optimizer.learning_rate,
             'knobs': self.knobs,
             'sizes': {k: v for k, v in SIZES.items() if k in self.sizes
                       or any(r['size'] == k for r in self.rows)},
             'methods': {k: v[0] for k, v in METHODS.items()
                         if k in self.methods
                         or any(r['method'] == k for r in self.rows)},
             'search': _SEARCH.value}
    results = {'setup': setup, 'rows': self.rows, 'pending': pending}
    _runs.write(_WORKDIR.value, _RESULTS_NAME.value,
                tables.render('claims', 'main', {'results': results}),
                results)


def _device() -> str:
  """The device kind this process trains on, with the matmul precision
  where it is not the default."""
  import jax  # pylint: disable=g-import-not-at-top
  kind = jax.devices()[0].device_kind
  precision = jax.config.jax_default_matmul_precision
  return f'{kind} ({precision})' if precision else kind


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  unknown = [s for s in _SIZES.value if s not in SIZES]
  if unknown:
    raise app.UsageError(f'unknown sizes {unknown}; known: {list(SIZES)}')
  try:
    per_size = _claims.size_steps(_SIZE_STEPS.value)
  except ValueError as e:
    raise app.UsageError(f'--steps_per_size: {e}') from e
  if min([_NUM_STEPS.value, *per_size.values()]) < _SYNC_EVERY.value:
    raise app.UsageError('--num_steps and --steps_per_size must be at least '
                         '--sync_every')
  methods = _runs.chosen(_METHODS.value, METHODS, '--methods')
  base = copy.deepcopy(_CONFIG.value)
  base.progress = False
  devices = (base.mesh.workers * base.mesh.data * base.mesh.fsdp
             * base.mesh.tensor)
  for m in methods:
    if devices % METHODS[m][1] and not _SIMULATE.value:
      raise app.UsageError(f'{m} needs {METHODS[m][1]} workers, which do not '
                           f'divide the config\'s {devices} devices')
  knobs = {'dp': _floats(_DP_LRS.value, 'dp_lrs'),
           'diloco_m1': _floats(_OUTER_LRS.value, 'outer_lrs'),
           'diloco_m2': _floats(_OUTER_LRS.value, 'outer_lrs'),
           'diloco_m4': _floats(_OUTER_LRS.value, 'outer_lrs'),
           'diloco_inner': _floats(_INNER_LRS.value, 'diloco_inner_lrs')}
  if _MOMENTA.value:
    knobs['outer_momenta'] = _floats(_MOMENTA.value, 'outer_momenta')
  # DiLoCo runs at the config's inner lr (and outer momentum) keep their
  # names (None).
  inners = [None if lr == base.optimizer.learning_rate else lr
            for lr in knobs['diloco_inner']]
  momenta = [None if mo == base.outer.momentum else mo
             for mo in knobs.get('outer_momenta', [base.outer.momentum])]
  seeds = [int(s) for s in _SEEDS.value]
  try:
    imported = _claims.import_rows(_IMPORT.value)
    method_inner = _claims.method_inner(_METHOD_INNER.value,
                                        base.optimizer.learning_rate)
  except ValueError as e:
    raise app.UsageError(f'--import_results / --method_inner_lrs: {e}') from e
  study = _Study(base, _SIZES.value, knobs, imported, methods)

  def grid(size, m):
    if m == 'dp':
      return [(size, m, k, 0, None) for k in knobs[m]]
    return [(size, m, k, 0, i, mo) for i in inners for mo in momenta
            for k in knobs[m]]

  if _SEARCH.value == 'local':
    def inner_of(size, m):
      return method_inner.get((size, m), method_inner.get((None, m),
                                                          inners[0]))
    _local(study, methods, knobs, momenta, inner_of, seeds, base)
    return

  # Sweeps of every size first (seed 0), smallest first, then the seeds.
  todo = [j for size in _SIZES.value for m in methods for j in grid(size, m)]
  todo = [j for j in todo if _claims.run_name(*j) not in study.imported]

  def seed_runs():
    """The extra seeds of each method's best setting so far, not done."""
    jobs = []
    for size in _SIZES.value:
      for m in methods:
        best = _claims.claims_best(study.rows, size, m)
        if best is not None:
          jobs += [(size, m, best[0], s, *best[1:]) for s in seeds]
    done = {r['name'] for r in study.rows}
    return [j for j in jobs if _claims.run_name(*j) not in done]

  def pending(grid_left):
    # Seeds of a best setting that the rest of the grid may still change
    # are listed as they stand now.
    return [_claims.run_name(*j) for j in grid_left + seed_runs()]

  if _MERGE_ONLY.value:
    study.write(pending(todo))
    return
  for i, job in enumerate(todo):
    study.run(*job)
    study.write(pending(todo[i + 1:]))
  extra = seed_runs()
  for i, job in enumerate(extra):
    study.run(*job)
    study.write(pending([]))
  if not extra:
    study.write(pending([]))

def _local(study, methods, knobs, momenta, inner_of, seeds, base):
  """``--search=local``: each method's grid neighbours of its best setting
  until the best is a local minimum (methods taking turns), then each best
  setting's seeds; the results rewritten after every run."""
  sizes = _SIZES.value
  default_momentum = base.outer.momentum
  study.knobs['method_inner'] = {
      m: base.optimizer.learning_rate if inner_of(sizes[0], m) is None
      else inner_of(sizes[0], m) for m in methods if m != 'dp'}
  if len(sizes) > 1:
    study.knobs['method_inner_by_size'] = {
        size: {m: (base.optimizer.learning_rate if inner_of(size, m) is None
                   else inner_of(size, m)) for m in methods if m != 'dp'}
        for size in sizes}

  def axes(m):  # DiLoCo: (outer momentum, outer lr), momentum tried first
    if m == 'dp':
      return [knobs['dp']]
    return [[default_momentum if mo is None else mo for mo in momenta],
            knobs[m]]

  def job(size, m, point, seed):
    if m == 'dp':
      return (size, m, point[0], seed, None)
    mo = None if point[0] == default_momentum else point[0]
    return (size, m, point[1], seed, inner_of(size, m), mo)

  def losses(size, m):
    out = {}
    for r in study.rows:
      if r['size'] != size or r['method'] != m or r['seed'] != 0:
        continue
      if m == 'dp':
        out[(r['knob'],)] = r['final_eval_loss']
      elif r.get('inner_lr') == inner_of(size, m):
        mo = r.get('outer_momentum')
        out[(default_momentum if mo is None else mo, r['knob'])] = (
            r['final_eval_loss'])
    return out

  def wanted():
    """Per (size, method): the settings still to try, else the seeds of
    its best setting not run yet; and the seeds of each best setting so far
    that the search may still change (for the pending list)."""
    done = {r['name'] for r in study.rows} | study.imported
    out, later = [], []
    for size in sizes:
      for m in methods:
        got = losses(size, m)
        points = _claims.local_search(axes(m), got)
        seeds_left = []
        if got:
          best = min(got, key=got.get)
          seeds_left = [j for j in (job(size, m, best, s) for s in seeds)
                        if _claims.run_name(*j) not in done]
        if points:
          out.append([job(size, m, p, 0) for p in points])
          later += seeds_left
        elif seeds_left:
          out.append(seeds_left)
    return out, later

  turn = 0
  while True:
    lists, later = wanted()
    study.write([_claims.run_name(*j) for jobs in lists + [later]
                 for j in jobs])
    if _MERGE_ONLY.value or not lists:
      return
    study.run(*lists[turn % len(lists)][0])
    turn += 1


if __name__ == '__main__':
  app.run(main)
