"""Helpers shared by the experiment programs.

:func:`run` trains (or resumes, or reads back) one run and remembers its
config and provenance; :func:`write` writes a benchmark's results file with
the numbers, every run's full config and provenance, the provenance of the
writing process and its wall time (see :mod:`experiments.provenance`).
"""

import json
import os
import pathlib
import sys
import time
from typing import Any

import ml_collections

from experiments import provenance as provenance_lib

# Results-file format; bump when the layout of ``write``'s file changes.
FORMAT = 1

# The runs this process trained or read back, in order: what ``write``
# records next to the numbers.
RUNS: list[dict[str, Any]] = []
_START = time.time()


def variant(base: ml_collections.ConfigDict,
            **overrides: Any) -> ml_collections.ConfigDict:
  """A copy of ``base`` with dotted fields (``a__b`` for ``a.b``) replaced."""
  from loc_opt.train import config as cfg_lib  # pylint: disable=g-import-not-at-top
  return cfg_lib.with_overrides(base, overrides, sep='__')


def step_report(tx, params, sync, mesh):
  """Collectives (``loc_opt.parallel.collective_bytes``) of one compiled
  step of transform ``tx`` with phase ``sync`` under the worker map on
  ``mesh``; ``params`` stacked per worker, the gradients shaped like them."""
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  state = jax.eval_shape(jax.vmap(tx.init), params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params, sync=sync)
    return optax.apply_updates(params, updates), state

  compiled = jax.jit(parallel.shard_map_workers(step, mesh)).lower(
      params, state, params).compile()
  return parallel.collective_bytes(compiled, mesh)


# Issue 20's model sizes of the LM (experiments.benchmark_step_time,
# experiments.profile_step): label -> (num_layers, d_model); the config's
# other model fields (d_ff 512, 4 heads) are kept.
LM_SIZES = {'459k': (2, 128), '853k': (4, 128), '1.48M': (4, 192)}

# Sections of the DiLoCo family whose outer step does not fall back to
# outer.learning_rate / outer.momentum when cleared (a sweep writes its grid
# point into them; outer.eager_diloco's are cleared, so it reads the shared).
OWN_OUTER_STEP = {'co2': ('learning_rate', 'momentum'),
                  'noloco': ('momentum',)}


def outer_grid_point(base: ml_collections.ConfigDict, method: str,
                     workers: int, lr: float, momentum: float,
                     sync_every: int) -> ml_collections.ConfigDict:
  """``base`` with method ``method`` on ``workers`` workers (the devices
  split ``workers x devices / workers``) and outer step (lr, momentum), in
  whichever fields the method reads it from."""
  devices = base.mesh.workers * base.mesh.data * base.mesh.fsdp
  devices *= base.mesh.tensor
  overrides = {'outer__method': method, 'outer__sync_every': sync_every,
               'outer__learning_rate': lr, 'outer__momentum': momentum,
               'mesh__workers': workers, 'mesh__data': devices // workers,
               'mesh__fsdp': 1, 'mesh__tensor': 1}
  section = base.outer.get(method)
  point = {'learning_rate': lr, 'momentum': momentum}
  for field in ('learning_rate', 'momentum'):
    if section is not None and field in section:
      overrides[f'outer__{method}__{field}'] = (
          point[field] if field in OWN_OUTER_STEP.get(method, ()) else None)
  return variant(base, **overrides)


def run(config: ml_collections.ConfigDict, workdir: str | os.PathLike,
        label: str) -> dict[str, Any]:
  """Trains (or resumes, or reads a finished run) and prints one line.

  A run trained (or finished) by this call gets ``provenance.json`` in its
  directory: this process's provenance, the wall time of the call and the
  step it resumed from. A finished run read back keeps the record it has.
  Either way the run is remembered for :func:`write`.
  """
  from loc_opt import train  # pylint: disable=g-import-not-at-top
  before = _finished_step(workdir)
  t0 = time.time()
  summary = train.train_and_evaluate(config, workdir)
  wall = time.time() - t0
  summary.pop('state', None)
  record = provenance_lib.read(workdir)
  if before is None or before.get('finished') is not True:
    record = provenance_lib.record(
        workdir, wall_seconds=wall,
        resumed_from_step=(before or {}).get('step'),
        compile_seconds=summary.get('compile_seconds'),
        train_seconds=summary.get('train_seconds_this_run'))
  if not summary.get('finished'):
    raise SystemExit(f'{label}: stopped at step {summary["step"]} in '
                     f'{workdir} (run the command again to resume)')
  remember(config, workdir, label, record, summary)
  summary['curve'] = curve(workdir)
  print(f'{label:<34} steps {summary["step"]:>4}  final eval loss '
        f'{summary["final_eval_loss"]:.4f}', flush=True)
  return summary


def _finished_step(workdir) -> dict[str, Any] | None:
  """``{'step', 'finished'}`` of the run in ``workdir`` before this call
  (the latest checkpoint's step for an unfinished run), or None if there is
  no run yet."""
  path = pathlib.Path(workdir)
  if (path / 'summary.json').exists():
    summary = json.loads((path / 'summary.json').read_text())
    if summary.get('finished'):
      return {'step': summary.get('step'), 'finished': True}
  ckpts = path / 'checkpoints'
  steps = ([int(p.name) for p in ckpts.iterdir() if p.name.isdigit()]
           if ckpts.is_dir() else [])
  return {'step': max(steps), 'finished': False} if steps else None


def read_back(config: ml_collections.ConfigDict, run_dir: str, label: str
              ) -> dict[str, Any] | None:
  """The summary (with its eval curve) of a finished run of ``config``'s
  method and length in ``run_dir``, read from its files without building
  the trainer and remembered as one of :data:`RUNS`; None if there is
  none. (A run whose config predates fields added since, which the
  trainer's resume check refuses, is read back all the same.)"""
  path = os.path.join(run_dir, 'summary.json')
  if not os.path.exists(path):
    return None
  with open(path) as f:
    summary = json.load(f)
  if (not summary.get('finished') or summary.get('step') != config.num_steps
      or summary.get('method') != config.outer.method):
    return None
  summary['curve'] = curve(run_dir)
  remember(config, run_dir, label, provenance_lib.read(run_dir), summary)
  print(f'{label:<34} steps {summary["step"]:>4}  final eval loss '
        f'{summary["final_eval_loss"]:.4f} (read back from {run_dir})',
        flush=True)
  return summary


def remember(config: ml_collections.ConfigDict, workdir, label: str,
             record: dict[str, Any] | None,
             summary: dict[str, Any] | None = None) -> None:
  """Adds a run to :data:`RUNS` (for runs not made by :func:`run`)."""
  RUNS.append({
      'label': label, 'workdir': str(workdir),
      'config': json.loads(json.dumps(config.to_dict(), default=str)),
      'provenance': record if record is not None else {
          'unknown': 'the run finished before provenance was recorded'},
      'final_eval_loss': (summary or {}).get('final_eval_loss'),
      'steps': (summary or {}).get('step'),
      'corpus': (summary or {}).get('corpus')})


def corpus_record(runs: list[dict[str, Any]]) -> dict[str, Any]:
  """A results file's ``corpus``: the distinct fingerprints
  (:mod:`loc_opt.data.corpus`) of the text ``runs`` trained on, and the
  labels of the runs without one (trained before fingerprints were kept,
  or resumed at their end); without runs, of the text this process read
  (none: ``reads_text`` False)."""
  from loc_opt.data import corpus as corpus_lib  # pylint: disable=g-import-not-at-top
  fps: dict[str, dict[str, Any]] = {}
  unknown = []
  for r in runs:
    c = r.get('corpus')
    if not c or c.get('from_step', 0) >= (r.get('steps') or 1):
      unknown.append(r['label'])
      continue
    fps.setdefault(c['sha256'], {k: v for k, v in c.items()
                                 if k != 'from_step'})
  if not runs:
    fps = {c['sha256']: c for c in corpus_lib.loaded()}
  return {'fingerprints': list(fps.values()), 'unknown_runs': unknown,
          'reads_text': bool(fps or unknown)}


def curve(workdir: str | os.PathLike) -> dict[str, dict[int, float]]:
  """``{'eval': {step: loss}, 'train': {step: loss}}`` of a run."""
  from loc_opt import train  # pylint: disable=g-import-not-at-top
  out = {'eval': {}, 'train': {}}
  for r in train.read_metrics(workdir):
    for key, name in (('eval/loss', 'eval'), ('train/loss', 'train')):
      if key in r and isinstance(r[key], (int, float)):
        out[name][int(r['step'])] = float(r[key])
  return out


def _command() -> list[str]:
  """This process's command line, as ``python -m <module> <flags>``."""
  spec = getattr(sys.modules.get('__main__'), '__spec__', None)
  head = (['python', '-m', spec.name] if spec is not None else
          ['python', os.path.basename(sys.argv[0])])
  return head + sys.argv[1:]


def write(workdir: str | os.PathLike, name: str, markdown: str,
          results: Any, **info: Any) -> None:
  """Writes ``name.md`` and the results file ``name.json`` into ``workdir``
  and prints.

  The results file holds ``results`` (the numbers the tables are rendered
  from) under ``'results'``, and beside them the command line, the
  provenance of this process (:func:`experiments.provenance.collect`), its
  wall time, every run of :data:`RUNS` (full config and the provenance of
  the process that trained it), the corpus they read
  (:func:`corpus_record`), and ``info``.
  """
  path = pathlib.Path(workdir)
  path.mkdir(parents=True, exist_ok=True)
  value = {
      'format': FORMAT, 'benchmark': name,
      'command': _command(),
      'provenance': provenance_lib.collect(),
      'wall_seconds': time.time() - _START,
      'runs': RUNS, 'corpus': corpus_record(RUNS), **info,
      'results': results}
  (path / f'{name}.md').write_text(markdown)
  (path / f'{name}.json').write_text(json.dumps(value, indent=2,
                                                default=str))
  print('\n' + markdown)
  print(f'wrote {path / (name + ".md")}, {path / (name + ".json")}')


def require_optimizers(names) -> None:
  """Raises a usage error naming any of ``names`` not in the registry."""
  from absl import app  # pylint: disable=g-import-not-at-top
  from loc_opt import inner  # pylint: disable=g-import-not-at-top
  missing = [n for n in names if n not in inner.OPTIMIZERS]
  if missing:
    raise app.UsageError(f'optimizers {missing} are not in '
                         f'loc_opt.inner.OPTIMIZERS {sorted(inner.OPTIMIZERS)}')


def setup(cpu_devices: int) -> None:
  """Quiet logs, ``cpu_devices`` virtual CPU devices and freed host memory
  kept for reuse (``loc_opt.parallel.host_memory``, ``'auto'``, as the
  launcher's default); call first in ``main``, before anything touches a JAX
  backend."""
  from absl import logging  # pylint: disable=g-import-not-at-top
  from loc_opt.parallel import host_memory  # pylint: disable=g-import-not-at-top
  host_memory.setup('auto', cpu_devices)
  import jax  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.WARNING)
  jax.config.update('jax_num_cpu_devices', cpu_devices)


def inner_step(config: ml_collections.ConfigDict
               ) -> tuple[Any, tuple[Any, Any, Any]]:
  """``(experiment, (step, state, batch))``: the built experiment
  (``loc_opt.train.experiment.build_experiment``), its compiled inner step
  (as ``experiments.train`` runs it), a fresh state and the first training
  batch."""
  from loc_opt.train import experiment as exp_lib  # pylint: disable=g-import-not-at-top
  exp = exp_lib.build_experiment(config)
  return exp, (exp.programs.steps[exp.plan.inner], exp.init_state(),
               exp_lib.train_batch(exp, exp_lib.load_data(config), 0))


def time_alternating(programs: dict[str, tuple[Any, Any, Any]], rounds: int,
                     block: int, warmup: int) -> dict[str, list[float]]:
  """Seconds of each step of each program, timed in alternating blocks.

  ``programs`` maps a name to ``(step, state, batch)``, ``step(state,
  batch) -> (state, loss)``. Each program first takes ``warmup`` untimed
  steps; then, ``rounds`` times, each takes ``block`` steps in turn, each
  timed alone (``block_until_ready`` on the loss), so that a machine whose
  speed drifts slows them all alike.
  """
  states = {name: state for name, (_, state, _) in programs.items()}

  def steps(name, n):
    step, _, batch = programs[name]
    times = []
    for _ in range(n):
      t = time.perf_counter()
      states[name], loss = step(states[name], batch)
      loss.block_until_ready()
      times.append(time.perf_counter() - t)
    return times

  for name in programs:
    steps(name, warmup)
  times = {name: [] for name in programs}
  for _ in range(rounds):
    for name in programs:
      times[name] += steps(name, block)
  return times


def chosen(names, known, flag: str = '--runs') -> list[str]:
  """``names`` (all of ``known`` when empty), or a usage error naming the
  unknown ones."""
  from absl import app  # pylint: disable=g-import-not-at-top
  names = list(names or known)
  unknown = sorted(set(names) - set(known))
  if unknown:
    raise app.UsageError(f'unknown {flag} {unknown}; choose from '
                         f'{list(known)}')
  return names


def state_shardings(params, opt, specs, mesh):
  """Shardings of the stacked params and DiLoCo state: each leaf like its
  parameter inside a worker, the sharded layout's rows/M shards too (the
  layout of ``experiments.outer_state_memory`` and
  ``experiments.sharded_sync_bytes``)."""
  import jax  # pylint: disable=g-import-not-at-top

  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  from loc_opt.outer import _sharded  # pylint: disable=g-import-not-at-top
  from loc_opt.train import state as state_lib  # pylint: disable=g-import-not-at-top
  shard = state_lib.state_shardings(
      {'params': params, 'opt_state': opt}, specs, mesh, True)
  rows = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (x.shape[0], *_sharded.shard_shape(x.shape[1:], x.shape[0])),
      x.dtype), params)
  by_rows = state_lib.state_shardings(
      {'params': rows, 'opt_state': opt}, specs, mesh, True)['opt_state']
  worker_only = jax.NamedSharding(mesh, jax.P(parallel.WORKER))
  shard['opt_state'] = jax.tree.map(
      lambda full, row: row if full == worker_only else full,
      shard['opt_state'], by_rows)
  return shard['params'], shard['opt_state']
