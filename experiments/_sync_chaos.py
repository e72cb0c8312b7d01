"""Synchronous DiLoCo under the chaos schedule of
``experiments/async_chaos.py``: the ordinary launcher as one
``jax.distributed`` job of one process per worker, killed and restarted.

The job is ``python -m loc_opt.launch --local_processes=4`` with the
learners' tiny ``:mlp`` model, ``H``, data and tokens per step (one worker
per process, one CPU device each). The learners' pace is the job's
``faults.step_sleep_s``: process ``m`` sleeps what learner ``m`` sleeps
after each step (the slow one three times as long), so at each sync the
others wait for the slow process, as synchronous DiLoCo waits for its
slowest worker.

A scheduled kill of learner ``m`` is a ``kill -9`` of the job's process
``m`` (``--process_id=m``); the launcher then stops the others and exits
(``loc_opt.train.local_launch``), and the job stays down until every killed
worker is back (the schedule's restarts); the driver then starts it again,
and it resumes from its last checkpoint, losing the steps since
(:func:`job_actions`). A kill of the syncer has no counterpart: there is
none. The job logs every step (``log_every=1``) and the driver notes when
each step's line appears in ``metrics.jsonl`` (:class:`StepClock`), which
is what :func:`account` counts.
"""

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

PACE_FIELD = 'faults.step_sleep_s'


def job_actions(events: list[tuple[float, str, str]], *, spare: bool
                ) -> list[tuple[float, str, int | None]]:
  """The synchronous job's ``(time, 'kill', worker)`` and ``(time,
  'restart', None)`` actions for a schedule of ``(time, 'kill'|'start',
  process)`` events.

  With ``spare``, a spare machine takes the killed worker's place: every
  learner kill kills the job's process of that worker and restarts the
  job at once. Without, the job has only its 4 machines: a learner's kill
  kills the job's process of that worker if the job is up (else nothing:
  it is down already), and the job restarts when the last killed worker
  is back. The syncer's events are dropped (synchronous DiLoCo has no
  syncer)."""
  down, out = set(), []
  for t, what, proc in sorted(events):
    if proc == 'syncer':
      continue
    if not proc.startswith('l') or what not in ('kill', 'start'):
      raise ValueError(f'an event is (time, kill|start, l<m>|syncer), got '
                       f'{(t, what, proc)!r}')
    m = int(proc[1:])
    if spare:
      if what == 'kill':
        out += [(t, 'kill', m), (t, 'restart', None)]
    elif what == 'kill':
      if not down:
        out.append((t, 'kill', m))
      down.add(m)
    elif m in down:
      down.discard(m)
      if not down:
        out.append((t, 'restart', None))
  return out


def job_command(config_args: list[str], workdir: pathlib.Path,
                paces: list[float], checkpoint_every: int) -> list[str]:
  """The launcher command of the job (one process and CPU device per
  worker, each step logged, no evaluation before the end)."""
  sleeps = '(' + ','.join(f'{p:g}' for p in paces) + ',)'
  return [sys.executable, '-m', 'loc_opt.launch', *config_args,
          f'--workdir={workdir}', f'--local_processes={len(paces)}',
          '--cpu_devices=1', '--config.mesh.data=1',
          f'--config.mesh.workers={len(paces)}', '--config.log_every=1',
          '--config.eval_every=0', '--config.progress=False',
          f'--config.checkpoint_every={checkpoint_every}',
          "--config.logging.backends=('jsonl',)",
          f'--config.{PACE_FIELD}={sleeps}']


class StepClock:
  """When each step of each incarnation of the job appeared in its
  ``metrics.jsonl`` (polled). A resumed job rewrites the file (a new
  inode, rows past its checkpoint dropped) before it logs a step, so an
  incarnation counts rows only from a file it wrote."""

  def __init__(self, path: pathlib.Path):
    self.path = path
    self.incarnations: list[dict] = []
    self._stale_inode = None

  def new_incarnation(self, resume_step: int, started: float) -> None:
    try:
      self._stale_inode = self.path.stat().st_ino
    except FileNotFoundError:
      self._stale_inode = None
    self.incarnations.append({'resume_step': resume_step,
                              'started': started, 'steps': {},
                              'killed': None})

  def poll(self, now: float) -> None:
    try:
      with open(self.path, encoding='utf-8') as f:
        if os.fstat(f.fileno()).st_ino == self._stale_inode:
          return
        lines = f.read().splitlines()
    except FileNotFoundError:
      return
    steps = self.incarnations[-1]['steps']
    for line in lines:
      try:
        step = int(json.loads(line)['step'])
      except (ValueError, KeyError, TypeError):
        continue  # a line being written
      if step > self.incarnations[-1]['resume_step']:
        steps.setdefault(step, now)


@dataclasses.dataclass
class Account:
  """The synchronous job's numbers over the window (see :func:`account`)."""

  t0: float
  first_step: int
  final_step: int
  steps_kept: int
  steps_lost: int
  steps_unsynced: int
  syncs: int
  step_s: float
  startup_s: float
  restart_s: list[float]


def account(incarnations: list[dict], t0: float, t1: float,
            sync_every: int, final_checkpoint: int) -> Account:
  """Counts the job's steps in the window ``(t0, t1]``.

  Args:
    incarnations: :class:`StepClock`'s, each with ``resume_step``,
      ``started`` (wall time), ``steps`` (step -> wall time it was logged),
      ``killed`` (wall time or None) and, for a killed one, ``checkpoint``:
      the latest checkpoint step after it died (where the next resumes).
    t0, t1: the window; ``t0`` is when the first step of the first
      incarnation was logged.
    sync_every: ``H``: step ``s`` syncs when ``s % H == 0``.
    final_checkpoint: the latest checkpoint step at ``t1`` if the job was
      down then.

  Returns:
    An :class:`Account`: ``first_step`` (the first incarnation's first
    step, done at ``t0``); ``final_step``, the last sync step of the final
    lineage by ``t1`` (the running job's last synced step, or the last
    checkpoint when it was down); ``steps_kept`` = ``final_step -
    first_step``; ``steps_lost``: steps logged in the window and rolled
    back by a restart (or, for a job down at the end, past its last
    checkpoint); ``steps_unsynced``: the final lineage's steps past
    ``final_step``; ``syncs``: sync steps logged in the window (lost ones
    too); ``step_s``: seconds per step while running (the first to the
    last logged step of each incarnation, pooled); ``startup_s`` and
    ``restart_s``: seconds from the start command to the first logged step,
    of the first incarnation and of each restart.
  """
  if not incarnations or not incarnations[0]['steps']:
    raise ValueError('the first incarnation logged no step')
  first = min(incarnations[0]['steps'])
  inside = lambda t: t0 < t <= t1
  lost = syncs = 0
  for i, inc in enumerate(incarnations):
    logged = {s: t for s, t in inc['steps'].items() if inside(t)}
    syncs += sum(1 for s in logged if s % sync_every == 0)
    if i + 1 < len(incarnations):
      back_to = incarnations[i + 1]['resume_step']
      lost += sum(1 for s in logged if s > back_to)
  last = incarnations[-1]
  by_end = [s for s, t in last['steps'].items() if t <= t1]
  if last['killed'] is None or last['killed'] > t1:
    top = max(by_end, default=last['resume_step'])
    final = max(top - top % sync_every, last['resume_step'])
    unsynced = top - final
  else:  # down at the end: what it ran past its checkpoint is lost too
    final, unsynced = final_checkpoint, 0
    lost += sum(1 for s, t in last['steps'].items()
                if inside(t) and s > final_checkpoint)
  run_s = run_steps = 0.
  for inc in incarnations:
    times = sorted(inc['steps'].items())
    if len(times) > 1:
      run_s += times[-1][1] - times[0][1]
      run_steps += times[-1][0] - times[0][0]
  restarts = [min(inc['steps'].values()) - inc['started']
              for inc in incarnations[1:] if inc['steps']]
  return Account(t0=t0, first_step=first, final_step=final,
                 steps_kept=max(final - first, 0), steps_lost=lost,
                 steps_unsynced=unsynced, syncs=syncs,
                 step_s=run_s / run_steps if run_steps else float('nan'),
                 startup_s=min(incarnations[0]['steps'].values())
                 - incarnations[0]['started'], restart_s=restarts)


def worker_pid(launcher_pid: int, worker: int) -> int | None:
  """The pid of the launcher's child ``--process_id=worker`` (Linux
  ``/proc``), or None."""
  for task in pathlib.Path(f'/proc/{launcher_pid}/task').glob('*'):
    try:
      children = (task / 'children').read_text().split()
    except OSError:
      continue
    for pid in children:
      try:
        argv = pathlib.Path(f'/proc/{pid}/cmdline').read_bytes().split(b'\0')
      except OSError:
        continue
      if f'--process_id={worker}'.encode() in argv:
        return int(pid)
  return None


class Job:
  """The launcher process of the job, started and stopped by the driver."""

  def __init__(self, command: list[str], log_dir: pathlib.Path, env: dict,
               cwd: pathlib.Path):
    self.command, self.log_dir, self.env, self.cwd = (command, log_dir,
                                                      env, cwd)
    self.proc, self.count = None, 0

  def running(self) -> bool:
    return self.proc is not None and self.proc.poll() is None

  def start(self) -> None:
    log = self.log_dir / f'job.{self.count}.log'
    self.count += 1
    with open(log, 'w') as f:
      self.proc = subprocess.Popen(
          ['nice', '-n', '19', *self.command], cwd=self.cwd, env=self.env,
          stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

  def kill_worker(self, worker: int, timeout_s: float = 120.) -> int:
    """``kill -9`` of process ``worker``; waits for the launcher to stop
    the job; returns its exit code."""
    end = time.time() + 30.
    pid = worker_pid(self.proc.pid, worker)
    while pid is None and self.running() and time.time() < end:
      time.sleep(0.05)  # the launcher is still starting its children
      pid = worker_pid(self.proc.pid, worker)
    if pid is None:
      raise RuntimeError(f'no process {worker} under the launcher '
                         f'{self.proc.pid}; see {self.log_dir}')
    os.kill(pid, signal.SIGKILL)
    return self.proc.wait(timeout=timeout_s)

  def kill(self) -> None:
    """SIGKILL of the launcher (its children die with it)."""
    if self.running():
      os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait(timeout=60)

  def stop(self, timeout_s: float = 120.) -> int | None:
    """A SIGTERM (the children save a checkpoint and exit), then SIGKILL
    of the group if it does not end in time."""
    if not self.running():
      return None
    self.proc.send_signal(signal.SIGTERM)
    try:
      return self.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      os.killpg(self.proc.pid, signal.SIGKILL)
      return self.proc.wait(timeout=60)


def _latest_step(workdir: pathlib.Path) -> int:
  from loc_opt.train import checkpoint  # pylint: disable=g-import-not-at-top
  step = checkpoint.latest_step(str(workdir)) if workdir.exists() else None
  return 0 if step is None else int(step)


def _wait_for_first_step(job: Job, clock: StepClock, timeout_s: float
                         ) -> float:
  end = time.time() + timeout_s
  while not clock.incarnations[-1]['steps']:
    if not job.running():
      raise RuntimeError(f'the synchronous job exited before its first '
                         f'step; see {job.log_dir}')
    if time.time() > end:
      raise RuntimeError(f'the synchronous job logged no step in '
                         f'{timeout_s:.0f} s; see {job.log_dir}')
    time.sleep(0.05)
    clock.poll(time.time())
  return min(clock.incarnations[-1]['steps'].values())


def drive(job: Job, workdir: pathlib.Path, actions, seconds: float,
          sync_every: int) -> tuple[Account, list[dict]]:
  """Runs the job over the window under ``actions`` (:func:`job_actions`,
  times from the first logged step) and returns
  its :class:`Account` and the incarnations; the job is stopped
  (SIGTERM: it saves) at the end."""
  clock = StepClock(workdir / 'metrics.jsonl')
  job.start()
  clock.new_incarnation(0, time.time())
  try:
    t0 = _wait_for_first_step(job, clock, 600.)
    pending = list(actions)
    while time.time() < t0 + seconds:
      now = time.time()
      clock.poll(now)
      while pending and pending[0][0] <= now - t0:
        _, what, worker = pending.pop(0)
        inc = clock.incarnations[-1]
        if what == 'kill':
          if not job.running():
            raise RuntimeError(f'the synchronous job had stopped by itself '
                               f'before a kill; see {job.log_dir}')
          inc['killed'] = now
          inc['exit_code'] = job.kill_worker(worker)
          clock.poll(time.time())
          inc['checkpoint'] = _latest_step(workdir)
        else:
          job.start()
          clock.new_incarnation(_latest_step(workdir), time.time())
      if clock.incarnations[-1]['killed'] is None and not job.running():
        raise RuntimeError(f'the synchronous job stopped by itself; see '
                           f'{job.log_dir}')
      time.sleep(0.05)
    t1 = time.time()
    clock.poll(t1)
    final_checkpoint = _latest_step(workdir)
  finally:
    if clock.incarnations[-1]['steps']:
      job.stop()
    else:  # still starting: nothing to save (and a SIGTERM while it
      job.kill()  # restores a checkpoint was seen to hang)
  return (account(clock.incarnations, t0, t1, sync_every, final_checkpoint),
          clock.incarnations)
