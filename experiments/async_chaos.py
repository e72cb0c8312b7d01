r"""Decoupled DiLoCo's learners and syncer as separate processes on one
machine, in wall-clock time, under a seeded kill -9 / restart schedule.

  nice -n 19 python -m experiments.async_chaos --out=DIR [--seconds=120]

Each run starts a syncer and 4 learners (``loc_opt.train.async_learners``,
a tiny ``:mlp`` model) on localhost with one store directory. Learner 3 is
the slow one: every learner sleeps ``--pace_s`` after each inner step (so
five processes leave this shared machine's CPUs to others) and learner 3
sleeps ``--slow_factor`` times as long. In the runs with failures the
schedule (seeded) kills learners with SIGKILL and restarts them after a
downtime, and kills the syncer once (restarted after ``--syncer_down_s``).
Runs:

* ``no_failures``: the same processes, nothing killed;
* ``chaos``: the schedule;
* ``chaos_staleness``: the schedule, with the syncer's staleness options
  (``--age_power=0.5 --correction=1 --restart_every=8``);
* ``sync_no_failures``, ``sync_chaos_spare``, ``sync_chaos``: synchronous
  DiLoCo, the ordinary launcher as one ``--local_processes=4`` job (one
  process per worker, the same model, ``H``, data and tokens per step,
  process ``m`` sleeping what learner ``m`` sleeps after each step:
  ``faults.step_sleep_s``), without failures, and under the schedule: each
  learner kill a ``kill -9`` of that worker's process, after which the
  launcher stops the job and the driver starts it again, at once (a spare
  machine takes the killed one's place) or once every killed worker is
  back; it resumes from its last checkpoint (every ``--checkpoint_every``
  steps). ``experiments/_sync_chaos.py`` has the rules.

Measured per run, from the processes' logs and the store, over the window
from the moment every learner has started (compiled, first version read)
to the end: goodput = tokens of payloads merged / (4 x window x a learner's
failure-free tokens/s), the last measured as the fast learners' tokens per
inner step over their median inner-step time (from their payloads) -- so it
charges the store's reads and writes, kills, restarts and stale drops, and
not the start-up; merges per minute; tokens dropped as stale (more than
``max_staleness`` versions old) and tokens published but not merged by the
end; the final eval loss of the last global version (the trainer's eval
batches). Simulated: the pace (sleeps) and the failures (the schedule).
For the synchronous job: goodput = tokens of the steps that reached a sync
and were kept (not rolled back by a restart) over the same 4 x window x a
fast learner's failure-free tokens/s (the asynchronous runs' figure); syncs
per minute (lost ones too); tokens lost to restarts; final eval loss of the
anchor saved when the job is stopped at the end. Beside each run, what the
virtual-clock models predict for its schedule and measured times
(``experiments/_chaos_predict.py``).
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from absl import app
from absl import flags
import numpy as np

from experiments import _async_tables
from experiments import _chaos_predict
from experiments import _runs
from experiments import _sync_chaos
from experiments._chaos_schedule import NUM_LEARNERS
from experiments._chaos_schedule import schedule
from experiments._chaos_schedule import SLOW

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUNS = {'no_failures': (False, []), 'chaos': (True, []),
        'chaos_staleness': (True, ['--age_power=0.5', '--correction=1',
                                   '--restart_every=8']),
        'sync_no_failures': (False, []), 'sync_chaos_spare': (True, []),
        'sync_chaos': (True, [])}
# The syncer's merge rules (its flags; the timeline model takes the same).
SYNCER = {'quorum': 2, 'liveness_s': 5, 'max_staleness': 3,
          'grace_cap_s': 0.5, 'poll_s': 0.1}
GRACE, OVERLAP = 0.2, 2.  # the syncer's defaults (gamma, tau)
CONFIG = {'model.hidden': 32, 'data.seq_len': 32, 'data.max_bytes': 300_000,
          'batch_size': 16, 'outer.sync_every': 8, 'num_steps': 3000,
          'eval_batches': 4}

_OUT = flags.DEFINE_string('out', None, 'Output directory.')
_SECONDS = flags.DEFINE_float('seconds', 120., 'Window of each run.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of the failure schedule.')
_PACE = flags.DEFINE_float('pace_s', 0.25, 'Sleep after each inner step.')
_SLOW = flags.DEFINE_float('slow_factor', 3., 'Learner 3 sleeps this x.')
_KILLS = flags.DEFINE_integer('kills', 4, 'Learner kills per chaos run.')
_DOWN = flags.DEFINE_float('down_s', 15., 'Mean learner downtime (s).')
_SYNCER_DOWN = flags.DEFINE_float('syncer_down_s', 5., 'Syncer downtime.')
_ONLY = flags.DEFINE_list('runs', list(RUNS), 'Runs to do.')
_CKPT = flags.DEFINE_integer('checkpoint_every', 32,
                             'Synchronous job: steps between checkpoints.')
flags.mark_flag_as_required('out')


class _Run:
  """The processes of one run."""

  def __init__(self, out: pathlib.Path, syncer_args: list[str]):
    self.out, self.syncer_args = out, syncer_args
    self.store = out / 'store'
    self.procs, self.logs = {}, {}
    self.env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=str(ROOT),
                    XLA_FLAGS='')
    self.config = [f'--config={ROOT / "configs" / "diloco_lm.py"}:mlp'] + [
        f'--config.{k}={v}' for k, v in CONFIG.items()]

  def start(self, name: str) -> None:
    if name == 'syncer':
      args = ['loc_opt.train.async_learners.syncer',
              *[f'--{k}={v}' for k, v in SYNCER.items()], *self.syncer_args]
    else:
      m = int(name[1:])
      pace = _PACE.value * (_SLOW.value if m == SLOW else 1.)
      args = ['loc_opt.train.async_learners.learner', f'--learner={name}',
              f'--index={m}', f'--num_learners={NUM_LEARNERS}',
              f'--slowdown_s={pace}']
    log = self.out / f'{name}.{len(self.logs.get(name, []))}.log'
    self.logs.setdefault(name, []).append(log)
    with open(log, 'w') as f:
      self.procs[name] = subprocess.Popen(
          ['nice', '-n', '19', sys.executable, '-m', *args, *self.config,
           f'--store={self.store}'], cwd=ROOT, env=self.env, stdout=f,
          stderr=subprocess.STDOUT, start_new_session=True)

  def kill(self, name: str) -> None:
    proc = self.procs.pop(name, None)
    if proc is not None and proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait(timeout=60)

  def events(self, name: str) -> list[dict]:
    out = []
    for log in self.logs.get(name, []):
      for line in log.read_text().splitlines():
        if line.startswith('{'):
          try:
            out.append(json.loads(line))
          except json.JSONDecodeError:
            pass
    return out


def _started(run: _Run) -> bool:
  return all(any(e['event'] == 'start' for e in run.events(f'l{m}'))
             for m in range(NUM_LEARNERS))


def one_run(name: str, out: pathlib.Path) -> dict:
  """One run (see the module doc); returns its measurements."""
  failures, syncer_args = RUNS[name]
  out.mkdir(parents=True, exist_ok=True)
  run = _Run(out, syncer_args)
  events = (schedule(_SEED.value, _SECONDS.value, _KILLS.value, _DOWN.value)
            if failures else [])
  try:
    run.start('syncer')
    for m in range(NUM_LEARNERS):
      run.start(f'l{m}')
    deadline = time.time() + 600
    while not _started(run):
      for proc_name, proc in run.procs.items():
        if proc.poll() is not None:
          raise RuntimeError(f'{name}: {proc_name} exited; see {out}')
      if time.time() > deadline:
        raise RuntimeError(f'{name}: learners did not start; see {out}')
      time.sleep(0.5)
    t0 = time.time()
    pending = list(events)
    while time.time() < t0 + _SECONDS.value:
      now = time.time() - t0
      while pending and pending[0][0] <= now:
        _, what, proc = pending.pop(0)
        if what == 'kill':
          run.kill(proc)
          if proc == 'syncer':
            pending.append((now + _SYNCER_DOWN.value, 'start', 'syncer'))
            pending.sort()
        else:
          run.start(proc)
      time.sleep(0.1)
    t1 = time.time()
  finally:
    for proc in list(run.procs):
      run.kill(proc)
  return measure(run, t0, t1, events)


def _paces() -> list[float]:
  return [_PACE.value * (_SLOW.value if m == SLOW else 1.)
          for m in range(NUM_LEARNERS)]


def sync_run(name: str, out: pathlib.Path, fast_rate: float) -> dict:
  """A synchronous run (see the module doc); returns its measurements."""
  failures, _ = RUNS[name]
  out.mkdir(parents=True, exist_ok=True)
  run = _Run(out, [])
  workdir = out / 'workdir'
  events = (schedule(_SEED.value, _SECONDS.value, _KILLS.value, _DOWN.value)
            if failures else [])
  actions = _sync_chaos.job_actions(events, spare=name.endswith('spare'))
  job = _sync_chaos.Job(_sync_chaos.job_command(
      run.config, workdir, _paces(), _CKPT.value), out, run.env, ROOT)
  a, incarnations = _sync_chaos.drive(job, workdir, actions, _SECONDS.value,
                                      CONFIG['outer.sync_every'])
  per_step = CONFIG['batch_size'] * CONFIG['data.seq_len']  # 4 workers
  window = _SECONDS.value
  restart = float(np.mean(a.restart_s)) if a.restart_s else a.startup_s
  predicted = _chaos_predict.predict_sync(
      actions, window_s=window, step_s=a.step_s, restart_s=restart,
      checkpoint_every=_CKPT.value, tokens_per_step=per_step / NUM_LEARNERS,
      fast_tokens_per_s=fast_rate)
  return {
      'window_s': window, 'learner_tokens_per_s': fast_rate,
      'goodput': a.steps_kept * per_step / (NUM_LEARNERS * window * fast_rate),
      'goodput_predicted': predicted['goodput'],
      'syncs': a.syncs, 'merges_per_min': 60 * a.syncs / window,
      'tokens_merged': a.steps_kept * per_step,
      'tokens_lost': a.steps_lost * per_step,
      'tokens_unmerged': a.steps_unsynced * per_step,
      'learner_kills': sum(1 for _, w, p in events
                           if w == 'kill' and p != 'syncer'),
      'job_kills': sum(1 for _, w, _ in actions if w == 'kill'),
      'restarts': len(incarnations) - 1, 'step_s': a.step_s,
      'startup_s': a.startup_s, 'restart_s': a.restart_s,
      'final_step': a.final_step, 'actions': actions,
      'incarnations': [
          {'resume_step': i['resume_step'], 'exit_code': i.get('exit_code'),
           'steps': [min(i['steps']), max(i['steps'])] if i['steps'] else []}
          for i in incarnations],
      'eval_loss': _eval_loss(_exported(workdir, out / 'export'))}


def _exported(workdir: pathlib.Path, out: pathlib.Path):
  """The job's global model (its anchor) at its last checkpoint, through
  ``loc-opt-export``; the initial model if it saved none."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from loc_opt.train import checkpoint  # pylint: disable=g-import-not-at-top
  from loc_opt.train.async_learners import syncer  # pylint: disable=g-import-not-at-top
  if checkpoint.latest_step(str(workdir)) is None:
    return syncer.init_params(_tiny_config())
  subprocess.run(
      ['nice', '-n', '19', sys.executable, '-c',
       'from loc_opt.launch import export_main; export_main()',
       f'--workdir={workdir}', f'--out={out}', f'--cpu_devices={NUM_LEARNERS}'],
      cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=''),
      check=True, capture_output=True)
  return ocp.StandardCheckpointer().restore(out / 'params')


def _restart_costs(run: _Run, t0: float, events, step_s) -> dict:
  """Per restarted learner, seconds from its scheduled restart to its
  first step (its first payload after it, less ``H`` of its median
  steps), mean over its restarts; a restart killed again before its first
  payload is not counted."""
  costs = {}
  for i, (t, what, proc) in enumerate(events):
    if what != 'start' or proc == 'syncer':
      continue
    end = next((u for u, w, p in events[i + 1:] if p == proc and w == 'kill'),
               np.inf)
    after = [e['wall'] for e in run.events(proc) if e['event'] == 'payload'
             and t0 + t < e['wall'] < t0 + end]
    if after:
      costs.setdefault(proc, []).append(
          min(after) - t0 - t - CONFIG['outer.sync_every'] * step_s[proc])
  return {k: float(np.mean(v)) for k, v in costs.items()}


def measure(run: _Run, t0: float, t1: float, events) -> dict:
  """The run's numbers (see the module doc)."""
  payloads = {}
  for m in range(NUM_LEARNERS):
    for e in run.events(f'l{m}'):
      if e['event'] == 'payload':
        payloads[(f'l{m}', e['seq'])] = e
  merges = [e for e in run.events('syncer') if e['event'] == 'merge'
            and e['time'] <= t1]
  merged = {tuple(p) for e in merges for p in e['payloads']}
  in_window = {k: p for k, p in payloads.items() if t0 <= p['wall'] <= t1}
  tokens_merged = sum(p['tokens'] for k, p in in_window.items()
                      if k in merged)
  fast = [p for (l, _), p in in_window.items() if l != f'l{SLOW}']
  rate = (np.mean([p['tokens'] / p['steps'] for p in fast])
          / np.median([p['step_s'] for p in fast]))
  window = t1 - t0
  step_s = {f'l{m}': float(np.median([p['step_s'] for (l, _), p
                                      in in_window.items() if l == f'l{m}']))
            for m in range(NUM_LEARNERS)}
  fast_s = float(np.median([p['step_s'] for p in fast]))
  restart_s = _restart_costs(run, t0, events, step_s)
  predicted = _chaos_predict.predict_async(
      events, window_s=window, fast_step_s=fast_s,
      slow_step_s=step_s[f'l{SLOW}'], restart_s=restart_s,
      sync_every=CONFIG['outer.sync_every'], quorum=SYNCER['quorum'],
      grace=GRACE, grace_cap_s=SYNCER['grace_cap_s'], overlap=OVERLAP)
  from loc_opt.train.async_learners import store as store_lib  # pylint: disable=g-import-not-at-top
  store = store_lib.Store(run.store)
  version = store.latest_version()
  params, counters = _final(store, version)
  store.close()
  return {
      'window_s': window, 'learner_tokens_per_s': float(rate),
      'goodput': tokens_merged / (NUM_LEARNERS * window * rate),
      'goodput_predicted': predicted['goodput'],
      'merges_per_min_predicted': predicted['merges_per_min'],
      'step_s': step_s, 'restart_s': restart_s,
      'merges': len([e for e in merges if e['time'] >= t0]),
      'merges_per_min': 60 * len([e for e in merges if e['time'] >= t0])
                        / window,
      'tokens_merged': tokens_merged,
      'tokens_stale': counters['tokens_discarded'],
      'tokens_unmerged': sum(p['tokens'] for k, p in in_window.items()
                             if k not in merged),
      'learner_kills': sum(1 for _, w, p in events
                           if w == 'kill' and p != 'syncer'),
      'syncer_kills': sum(1 for _, w, p in events if p == 'syncer'),
      'syncer_starts': counters['syncer_starts'], 'version': version,
      'eval_loss': _eval_loss(params)}


def _tiny_config():
  sys.path.insert(0, str(ROOT))
  from configs import diloco_lm  # pylint: disable=g-import-not-at-top
  c = diloco_lm.get_config('mlp')
  for k, v in CONFIG.items():
    section, _, field = k.rpartition('.')
    (c[section] if section else c)[field] = v
  c.mesh.workers = NUM_LEARNERS
  return c


def _final(store, version):
  from loc_opt.train.async_learners import syncer  # pylint: disable=g-import-not-at-top
  like = syncer.init_params(_tiny_config())
  params, _, meta = store.read_global(version, like)
  return params, meta


def _eval_loss(params) -> float:
  import jax  # pylint: disable=g-import-not-at-top
  from loc_opt import models  # pylint: disable=g-import-not-at-top
  from loc_opt.train import experiment  # pylint: disable=g-import-not-at-top
  from loc_opt.train import programs  # pylint: disable=g-import-not-at-top
  c = _tiny_config()
  model = models.build_model(c.model)
  data = experiment.load_data(c)
  batches = data.eval_batches(c.eval_batches)
  loss = jax.jit(lambda p, b: programs.loss_fn(model, p, b))
  return float(np.mean([loss(params, b) for b in batches]))


def main(argv):
  del argv
  # a SIGTERM ends the run through its finally: its processes are killed
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
  out = pathlib.Path(_OUT.value)
  results = {}
  for name in _ONLY.value:
    if name not in RUNS:
      raise app.UsageError(f'--runs: no run {name!r} ({", ".join(RUNS)})')
    if name.startswith('sync'):
      rates = [r['learner_tokens_per_s'] for r in results.values()
               if 'merges' in r]
      if not rates:
        raise app.UsageError('the synchronous runs take a fast learner\'s '
                             'tokens/s from an asynchronous run: list one '
                             'before them in --runs')
      results[name] = sync_run(name, out / name, float(np.mean(rates)))
    else:
      results[name] = one_run(name, out / name)
    print(name, json.dumps(results[name]), flush=True)
  settings = {'seconds': _SECONDS.value, 'seed': _SEED.value,
              'pace_s': _PACE.value, 'slow_factor': _SLOW.value,
              'kills': _KILLS.value, 'down_s': _DOWN.value,
              'syncer_down_s': _SYNCER_DOWN.value,
              'num_learners': NUM_LEARNERS, 'config': CONFIG,
              'checkpoint_every': _CKPT.value, 'syncer': SYNCER}
  # The results file of every benchmark (command, provenance, corpus).
  _runs.write(out, 'async_chaos', _async_tables.async_chaos_main(
      {'settings': settings, 'results': results}), results,
              settings=settings)


if __name__ == '__main__':
  app.run(main)
