"""The training loop: config in, trained model, metrics and checkpoints out.

``train_and_evaluate(config, workdir)`` builds the experiment
(``loc_opt.train.experiment``), starts from a checkpoint in ``workdir``, a
branch of another run (``init_from``) or the initialisation, and runs the
steps: the method's plan picks each step's compiled program on the host,
metrics go to ``metrics.jsonl`` and the configured backends, evaluation
uses the method's evaluation weights, and checkpoints make resume
bit-exact. The absl launcher, notebooks and tests all call it.
"""

import dataclasses
import json
import os
import pathlib
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from loc_opt import parallel
from loc_opt.data import corpus as corpus_lib
from loc_opt.train import checkpoint as ckpt_lib
from loc_opt.train import config as cfg_lib
from loc_opt.train import experiment as exp_lib
from loc_opt.train import faults
from loc_opt.train import hosts
from loc_opt.train import metrics as metrics_lib
from loc_opt.train import preemption
from loc_opt.train import records as records_lib
from loc_opt.train import routing as routing_lib
from loc_opt.train import simulated_time
from loc_opt.train import workdir_lock
from loc_opt.train import startup


@dataclasses.dataclass
class _Counters:
  """Where the run is: steps, sync bookkeeping and bytes moved."""
  step: int
  since_sync: int
  syncs: int
  cross_worker_bytes: int
  bad_steps: int = 0  # non-finite steps, all workers (read when logging)
  left_out: int = 0  # workers left out of a sync's mean, summed over syncs

  def advance(self, synced: bool, step_bytes: int) -> None:
    self.step += 1
    self.since_sync = 0 if synced else self.since_sync + 1
    self.syncs += int(synced)
    self.cross_worker_bytes += step_bytes


def _counters(exp: exp_lib.Experiment, state, step: int) -> _Counters:
  """The counters after ``step`` steps of a restored state.

  A method that keeps its sync counters in the optimizer state has them read
  from there, so a branch from another run's checkpoint (whose sync
  schedule may differ) counts right; otherwise the plan is replayed.
  """
  nbytes = exp.programs.bytes_per_step
  if exp.method.counters is None:
    out = _Counters(0, 0, 0, 0)
    for phase in exp.plan.walk(0, step):
      out.advance(exp.plan.is_sync(phase), nbytes[phase])
    return out
  syncs, since = (int(hosts.fetch(x).reshape(-1)[0])
                  for x in exp.method.counters(state['opt_state']))
  inner = nbytes[exp.plan.inner]
  total = syncs * (exp.sync_bytes() or 0) + (step - syncs) * inner
  return _Counters(step, since, syncs, total)


def _left_out(exp: exp_lib.Experiment, state) -> int:
  """Workers left out of a sync's mean so far, summed over workers."""
  if exp.method.left_out is None:
    return 0
  return int(np.sum(hosts.fetch(exp.method.left_out(state['opt_state']))))


def _start(exp, ckpt, config, config_json, branch, progress):
  """``(step, state)`` to start from: this run's checkpoint, else a branch
  of another run, else the initialisation."""
  if ckpt.latest_step() is not None:
    startup.say(f'restoring the checkpoint at step {ckpt.latest_step()} in '
                f'{ckpt.dir} ...')
    start, state = ckpt.restore(exp.layout, config_json)
    progress.message(f'resumed from checkpoint at step {start} in {ckpt.dir}')
    return start, state
  if branch is not None:
    progress.message(f'branched from {config.init_from.workdir} at step '
                     f'{branch[0]}')
    return branch
  return 0, exp.init_state()


class _Logger:
  """Train metrics, evaluation and progress at the configured steps."""

  def __init__(self, exp, config, workdir, start, eval_batches, progress):
    # The run's own config: run-control fields (logging, evaluation) may
    # differ from those of the cached experiment's.
    self.exp, self.config = exp, config
    # Process 0 alone writes (every process evaluates: it is collective).
    logging_section = config.get('logging')
    self.writer = (metrics_lib.MetricWriter(
        workdir, resume_step=start,
        backends=metrics_lib.check_logging(config),
        settings=logging_section.to_dict() if logging_section else {},
        run_config=config.to_dict())
                   if hosts.is_writer() else metrics_lib.NullWriter())
    # Simulated wall-clock per bandwidth, replayed to the start step.
    self.clocks = simulated_time.RunClocks(exp)
    for phase in exp.plan.walk(0, start):
      self.clocks.advance(phase)
    self.eval_batches, self.progress = eval_batches, progress
    self.tokens_per_step = self.config.batch_size * self.config.data.seq_len
    self.last_time, self.last_step = time.perf_counter(), start
    self.first_step = start
    self.train_time = 0.0
    self.loss = float('nan')
    self.last_eval = None

  def due(self, step: int) -> tuple[bool, bool]:
    """``(log, evaluate)`` after ``step`` steps."""
    c = self.config
    last = step == c.num_steps
    return (step % c.log_every == 0 or last,
            bool(c.eval_every and step % c.eval_every == 0) or last)

  def log(self, counters, state, loss_arr, step_bytes, evaluate,
          extra=None) -> None:
    step = counters.step
    self.loss = float(np.mean(hosts.fetch(loss_arr)))
    now = time.perf_counter()
    dt = now - self.last_time
    self.train_time += dt
    tps = self.tokens_per_step * (step - self.last_step) / max(dt, 1e-9)
    scalars = {
        'train/loss': self.loss,
        'perf/tokens_per_s': tps,
        'comm/cross_worker_bytes_step': step_bytes,
        'comm/cross_worker_bytes_total': counters.cross_worker_bytes,
        'comm/syncs': counters.syncs,
    }
    sync_bytes = self.exp.sync_bytes()
    if sync_bytes is not None:
      scalars['comm/cross_worker_bytes_per_sync'] = sync_bytes
    scalars.update(self.clocks.scalars())
    scalars['faults/bad_steps'] = counters.bad_steps
    if self.exp.method.left_out is not None:
      scalars['faults/left_out'] = counters.left_out
    scalars.update(extra or {})  # routing diagnostics (MoE)
    if evaluate:
      scalars['eval/loss'] = self.exp.evaluate(state, self.eval_batches)
      self.last_eval = scalars['eval/loss']
    self.writer.write(step, scalars)
    self.progress.update(step, loss=self.loss, tokens_per_s=tps,
                         cross_worker_bytes=counters.cross_worker_bytes)

  def restart_clock(self, step: int) -> None:
    """Throughput excludes evaluation and saving."""
    self.last_time, self.last_step = time.perf_counter(), step


def _window(exp, config, counters, phase, start, logger, ckpt
            ) -> tuple | None:
  """With ``outer.overlap='compiled'``, the phases of the overlapped
  program that starts at a sync step; None (one step at a time) elsewhere,
  or where the window would pass the run's end or ``halt_after_steps``, or
  a log, evaluation or checkpoint falls inside it (the step-by-step
  programs give the same numbers)."""
  windows = exp.programs.windows
  if windows is None or not exp.plan.is_sync(phase):
    return None
  phases = windows.phases(counters.step, counters.since_sync)
  end = counters.step + len(phases)
  halt = config.halt_after_steps
  if end > config.num_steps or (halt and end - start > halt):
    return None
  for step in range(counters.step + 1, end):
    if any(logger.due(step)) or ckpt.should_save(step, config.num_steps):
      return None
  return phases


def _routing(exp, logger, state, batch, phase, step):
  """A Mixture-of-Experts LM's routing diagnostics
  (``loc_opt.train.routing``) at the parameters entering the step after
  ``step - 1`` steps, when that step syncs or is logged; else None."""
  program = exp.programs.routing
  if program is None or not (exp.plan.is_sync(phase) or logger.due(step)[0]):
    return None
  stats = program(state['params'], batch)  # before the step donates them
  return routing_lib.routing_scalars(stats, state['params'],
                                     exp.method.per_worker)


def _run_steps(exp, config, state, counters, data, logger, ckpt,
               config_json, preempt):
  """Trains from ``counters.step`` to the end (or ``halt_after_steps``, or
  a preemption notice: then it saves a checkpoint at the current step)."""
  programs = exp.programs
  position = int(hosts.fetch(state['data_position']))
  halt_after = config.halt_after_steps
  bound = faults.Bound(faults.settings(config)['max_bad_steps'],
                       counters.step, state)
  start = counters.step
  # an emulated slower machine (faults.step_sleep_s)
  pause = faults.step_sleep(config, jax.process_index(), jax.process_count())
  while counters.step < config.num_steps:
    if preempt.reached(counters.step):
      ckpt.save(counters.step, state, config_json)  # checks it is finite
      break
    if halt_after and counters.step - start >= halt_after:
      break
    phase = exp.plan(counters.step, counters.since_sync)
    window = _window(exp, config, counters, phase, start, logger, ckpt)
    if window is None:
      batch = exp_lib.train_batch(exp, data, position)
      routed = _routing(exp, logger, state, batch, phase, counters.step + 1)
      state, loss_arr = programs.steps[phase](state, batch)
      window = (phase,)
    else:  # the sync and the steps that overlap it, one program
      batches = tuple(exp_lib.train_batch(exp, data, position + i)
                      for i in range(len(window)))
      routed = _routing(exp, logger, state, batches[0], phase,
                        counters.step + 1)
      state, loss_arr = programs.windows[window](state, batches)
    position += len(window)
    if pause:
      time.sleep(pause * len(window))
    for phase in window:
      step_bytes = programs.bytes_per_step[phase]
      counters.advance(exp.plan.is_sync(phase), step_bytes)
      logger.clocks.advance(phase)
    log_now, eval_now = logger.due(counters.step)
    if log_now or eval_now:
      counters.bad_steps = bound.check(state, counters.step)
      counters.left_out = _left_out(exp, state)
      logger.log(counters, state, loss_arr, step_bytes, eval_now, routed)
    elif routed is not None:  # a sync step between log steps
      logger.writer.write(counters.step, routed)
    if ckpt.should_save(counters.step, config.num_steps):
      ckpt.save(counters.step, state, config_json)  # checks it is finite
    if log_now or eval_now:
      logger.restart_clock(counters.step)
  return state


def _summary(exp, config, counters, logger, workdir, compile_s
             ) -> dict[str, Any]:
  """The end-of-run summary (written to ``summary.json``)."""
  nbytes = exp.programs.bytes_per_step
  # Process 0 reads its metrics (the last eval may predate a resume);
  # the others know the eval of this run's last step.
  records = metrics_lib.read_metrics(workdir) if hosts.is_writer() else []
  evals = [r['eval/loss'] for r in records if 'eval/loss' in r]
  evals = evals or [e for e in [logger.last_eval] if e is not None]
  losses = [r['train/loss'] for r in records if 'train/loss' in r]
  # A run that logged nothing itself (resumed at its last step) reports
  # the last loss its records hold.
  train_loss = (logger.loss if logger.last_step > logger.first_step
                or not losses else losses[-1])
  dp_step = (nbytes[exp.plan.inner] if not exp.method.per_worker else
             exp_lib.data_parallel_bytes_per_step(config))
  summary = {
      'step': counters.step, 'finished': True,
      'method': config.outer.method,
      'final_eval_loss': evals[-1] if evals else None,
      'final_train_loss': train_loss,
      'cross_worker_bytes': counters.cross_worker_bytes,
      'syncs': counters.syncs,
      'bad_steps': counters.bad_steps,
      'left_out': counters.left_out,
      'data_parallel_cross_worker_bytes': dp_step * config.num_steps,
      'bytes_per_inner_step': nbytes[exp.programs.steps.phases[0]],
      'bytes_per_sync_step': exp.sync_bytes(),
      'peak_bytes_per_step': max(nbytes.values()),
      'bytes_per_phase': {str(k): v for k, v in nbytes.items()},
      'wallclock': simulated_time.wallclock_summary(exp),
      'num_params': exp.model.num_params,
      'compile_seconds': compile_s,
      'train_seconds_this_run': logger.train_time,
  }
  if cfg_lib.simulates_workers(config):
    # The workers share devices: the byte counts above are what crosses
    # between their groups of devices (zeros for one group), not between
    # workers.
    summary['simulated_workers'] = config.mesh.workers
    summary['worker_groups'] = exp.mesh.shape[parallel.WORKER]
  init_from = config.get('init_from')
  if init_from is not None and init_from.get('workdir'):
    summary['init_from'] = {'workdir': str(init_from.workdir),
                            'step': int(init_from.step)}
  return summary


def _write_json(path: pathlib.Path, value: Any) -> None:
  """Writes ``value`` to ``path`` atomically, as strict JSON (a non-finite
  number as null, named under ``non_finite``; ``loc_opt.train.records``)."""
  records_lib.write_json(path, value)


def _saved_summary(workdir: pathlib.Path, start: int, config
                   ) -> dict[str, Any] | None:
  """The ``summary.json`` of a run that was already finished when this
  call started (it resumed at ``num_steps``), if it holds one; a rerun
  returns it and leaves the file as it is, byte for byte."""
  if start < config.num_steps:
    return None
  try:
    saved = json.loads((workdir / 'summary.json').read_text())
  except (OSError, ValueError):
    return None
  if not (isinstance(saved, dict) and saved.get('finished')
          and saved.get('step') == config.num_steps):
    return None
  return saved


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str | os.PathLike) -> dict[str, Any]:
  """Trains per ``config``, writing checkpoints and metrics to ``workdir``.

  One run at a time per workdir: process 0 holds ``workdir/lock.json``
  while the run writes (``loc_opt.train.workdir_lock``). A SIGTERM or
  SIGINT once training runs saves the live state at the current step and
  returns (``preempted``; ``exit_code`` 0 or 130); before the first step it
  raises ``preemption.Interrupted`` (``loc_opt.train.preemption``).

  If ``workdir`` holds a checkpoint, training resumes from it and ends with
  exactly the state an uninterrupted run would have (bit for bit on CPU).
  Otherwise, if ``config.init_from.workdir`` is set, the run starts from
  that run's checkpoint at ``config.init_from.step`` (see
  :func:`loc_opt.train.branch_and_evaluate`); else from the initialisation.

  Args:
    config: see ``configs/diloco_lm.py`` for every field.
    workdir: where checkpoints, ``metrics.jsonl``, TensorBoard files and
      ``summary.json`` go.

  Returns:
    The summary: final eval loss, cross-worker bytes moved, the bytes the
    data-parallel step would have moved for the same steps, timings; and
    ``state``, the final train state.

  Raises:
    workdir_lock.WorkdirLockedError: another live run holds ``workdir``.
    faults.NonFiniteError: training went non-finite.
    preemption.Interrupted: a signal before the first step.
  """
  preempt = preemption.PreemptionWatch(startup=True)
  lock = workdir_lock.WorkdirLock(workdir)
  try:
    return _train_and_evaluate(config, pathlib.Path(workdir), preempt, lock)
  finally:
    lock.release()
    preempt.close()


def _train_and_evaluate(config, workdir, preempt, lock) -> dict[str, Any]:
  """:func:`train_and_evaluate`, with its signal watch and workdir lock."""
  config_json = cfg_lib.config_to_json(config)
  t0 = time.perf_counter()
  exp_lib.validate_config(config, jax.device_count())
  metrics_lib.check_logging(config)  # before compiling anything
  lock.acquire()  # before anything is written
  init_from = config.get('init_from')
  branching = (init_from is not None and bool(init_from.get('workdir'))
               and ckpt_lib.latest_step(workdir) is None)
  if branching:  # fail before compiling anything
    ckpt_lib.check_branch(init_from.workdir, init_from.step, config_json)
  else:
    ckpt_lib.check_resume(workdir, config_json)
  # The data first: a missing dataset fails before anything compiles.
  data = exp_lib.load_data(config)
  if ckpt_lib.latest_step(workdir) is not None:  # other text: fail now
    corpus_lib.check_resume(workdir, data.corpus)
  t0 = time.perf_counter()
  exp = exp_lib.get_experiment(config)
  compile_s = time.perf_counter() - t0
  progress = metrics_lib.Progress(config.num_steps, every=config.log_every,
                                  enabled=config.progress and
                                  hosts.is_writer())
  # A branch reads the other run's state before anything is written here,
  # so a bad branch leaves no trace.
  branch = (ckpt_lib.restore_branch(init_from.workdir, init_from.step,
                                    exp.layout, config_json)
            if branching else None)
  workdir.mkdir(parents=True, exist_ok=True)
  ckpt = ckpt_lib.Checkpointer(workdir, every=config.checkpoint_every,
                               max_to_keep=config.keep_checkpoints,
                               layout=exp.layout)
  start, state = _start(exp, ckpt, config, config_json, branch, progress)
  corpus = corpus_lib.track(workdir, data.corpus, start,
                            write=hosts.is_writer())
  # The sync counters live in the optimizer state (or the plan), so a
  # resumed or branched run continues them exactly; the input position is
  # in the state, so the data order resumes exactly too.
  counters = _counters(exp, state, start)
  logger = _Logger(exp, config, workdir, start,
                   exp_lib.eval_batches(exp, data, config.eval_batches),
                   progress)
  preempt.start_training()  # SIGTERM, SIGINT: save the live state, stop
  try:
    state = _run_steps(exp, config, state, counters, data, logger, ckpt,
                       config_json, preempt)
  finally:
    logger.writer.close()
  ckpt.close()
  summary = {'step': counters.step, 'finished': False,
             'preempted': preempt.preempted, 'signal': preempt.signal,
             'exit_code': preempt.exit_code}
  saved = _saved_summary(workdir, start, config) if hosts.is_writer() \
      else None
  if saved is not None:  # a rerun of a finished run: nothing to record
    summary = saved
  elif counters.step >= config.num_steps:
    summary = _summary(exp, config, counters, logger, workdir, compile_s)
    summary['corpus'] = corpus  # loc_opt.data.corpus.track's record
    if hosts.is_writer():
      _write_json(workdir / 'summary.json', summary)
  summary['state'] = state
  return summary


def format_summary(summary: dict[str, Any]) -> str:
  """A short human-readable end-of-run summary."""
  if summary.get('preempted'):
    what = ('interrupted (SIGINT)' if summary.get('signal') == 'SIGINT'
            else 'preempted')
    return (f'{what}: saved a checkpoint at step {summary["step"]} '
            '(run the same command to resume)')
  if not summary.get('finished'):
    return f'stopped at step {summary["step"]} (resume to finish)'
  fb = metrics_lib.format_bytes
  dp = summary['data_parallel_cross_worker_bytes']
  moved = summary['cross_worker_bytes']
  ratio = f'{dp / moved:.0f}x less' if moved else 'none moved'
  lines = [
      f'method: {summary["method"]}   steps: {summary["step"]}   '
      f'params: {summary["num_params"]:,}',
      f'final eval loss: {summary["final_eval_loss"]:.4f}',
  ]
  if summary.get('simulated_workers'):
    groups = summary.get('worker_groups', 1)
    stacked = (f'the {summary["simulated_workers"]} workers were simulated '
               'on shared devices, mesh.simulate_workers')
    if groups == 1:
      lines.append(f'cross-worker bytes: not measured ({summary["syncs"]} '
                   f'syncs; {stacked})')
    else:
      lines.append(f'bytes between the {groups} groups of devices: '
                   f'{fb(moved)} ({summary["syncs"]} syncs; {stacked})')
    return '\n'.join(lines)
  lines += [
      f'cross-worker bytes moved: {fb(moved)} ({summary["syncs"]} syncs)',
      f'data-parallel would have moved: {fb(dp)} ({ratio})',
  ]
  return '\n'.join(lines)
