"""Signals and the workdir lock, sent to and tried on real launcher
processes: SIGTERM (a preemption notice) and SIGINT save the live state at
the current step and exit (0 and 130); a signal during startup exits at
once with one line (128 + the signal) and writes nothing; a second
launcher on a live run's workdir is refused, and takes over once the first
is killed; each interrupted run resumes bit for bit."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from loc_opt import train
from loc_opt.train import checkpoint as ckpt_lib
from loc_opt.train import preemption
from loc_opt.train import workdir_lock
from tests.train._helpers import leaves
from tests.train._helpers import tiny_config
from tests.train._helpers import preempt_after_steps

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_STEPS = 200


def _cli(workdir, data_dir, **fields):
  overrides = {
      'num_steps': _STEPS, 'model.hidden': 64, 'data.seq_len': 32, 'batch_size': 16, 'data.eval_batch_size': 16,
      'eval_batches': 1, 'data.max_bytes': 300_000, 'outer.sync_every': 4,
      'checkpoint_every': 1000, 'log_every': 1, 'progress': False,
      'data.data_dir': data_dir, **fields}
  return ([sys.executable, '-m', 'experiments.train',
           '--config=configs/diloco_lm.py:mlp', f'--workdir={workdir}',
           '--cpu_devices=8']
          + [f'--config.{k}={v}' for k, v in overrides.items()])


def _config(data_dir):
  """The CLI's config (run-control fields may differ on resume)."""
  return tiny_config(data_dir, config_schedule=True, num_steps=_STEPS,
                     checkpoint_every=1000, log_every=50)


_ENV = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS='cpu')


@pytest.fixture(scope='module')
def full(data_dir, tmp_path_factory):
  """The uninterrupted run (it builds the dataset too)."""
  return train.train_and_evaluate(_config(data_dir),
                                  tmp_path_factory.mktemp('full'))


def _popen(cmd):
  return subprocess.Popen(cmd, cwd=_ROOT, env=_ENV, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          start_new_session=True)


def _finish(proc, timeout=120):
  try:
    out, err = proc.communicate(timeout=timeout)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.communicate()
  return proc.returncode, out, err


def _wait_for(predicate, proc, timeout=120.0, poll=0.005):
  deadline = time.monotonic() + timeout
  while not predicate():
    if proc.poll() is not None:
      raise AssertionError(f'the run ended early: {proc.communicate()}')
    assert time.monotonic() < deadline, 'timed out'
    time.sleep(poll)


def _steps_logged(workdir) -> int:
  metrics = workdir / 'metrics.jsonl'
  return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _assert_resumes_exactly(config, workdir, full):
  resumed = train.train_and_evaluate(config, workdir)
  assert resumed['finished'] and resumed['step'] == _STEPS
  # One config, one mesh: the CLI process and this one compile the same
  # programs on this machine, and the resume replays them: bit for bit.
  for a, b in zip(leaves(full['state']), leaves(resumed['state'])):
    np.testing.assert_array_equal(a, b)
  assert resumed['cross_worker_bytes'] == full['cross_worker_bytes']


def test_sigint_during_a_save_saves_the_live_state_and_exits_130(
    data_dir, full, tmp_path):
  # A checkpoint every step; the SIGINT is sent once a save is in progress
  # (its temporary directory seen). Before, the handler saved the state
  # the loop had donated: "Array has been deleted", rc 1, a traceback.
  workdir = tmp_path / 'run'
  proc = _popen(_cli(workdir, data_dir, checkpoint_every=1))
  tmp_dirs = lambda: list((workdir / 'checkpoints').glob(
      '*.orbax-checkpoint-tmp*'))
  try:
    _wait_for(lambda: _steps_logged(workdir) >= 3, proc)
    _wait_for(lambda: bool(tmp_dirs()), proc, timeout=30, poll=0.0005)
    proc.send_signal(signal.SIGINT)
  finally:
    returncode, out, err = _finish(proc)
  assert returncode == 130, err[-3000:]
  step = ckpt_lib.latest_step(workdir)
  assert step is not None and 3 <= step < _STEPS, (step, out)
  assert f'interrupted (SIGINT): saved a checkpoint at step {step} ' in out
  assert 'Traceback' not in err, err[-3000:]
  assert not tmp_dirs()
  assert not (workdir / 'lock.json').exists()
  records = [json.loads(l) for l in
             (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert records[-1]['step'] == step  # the live state, not an older one
  _assert_resumes_exactly(_config(data_dir), workdir, full)


@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_startup_exits_in_one_line(data_dir, full, tmp_path,
                                                   sig):
  # Sent once the run holds its workdir lock: it is then compiling (the
  # data is read before). Before, a SIGTERM there ended with rc 143 and
  # nothing printed.
  workdir = tmp_path / 'run'
  proc = _popen(_cli(workdir, data_dir))
  try:
    _wait_for(lambda: (workdir / 'lock.json').exists(), proc, poll=0.001)
    proc.send_signal(sig)
  finally:
    returncode, out, err = _finish(proc)
  assert returncode == 128 + sig, (returncode, err[-3000:])
  lines = err.strip().splitlines()
  assert lines[-1] == (f'interrupted by {sig.name} during startup (before '
                       'the first step); nothing was saved by this run (run '
                       'the same command to start or resume)'), err[-3000:]
  assert 'Traceback' not in err, err[-3000:]
  assert not (workdir / 'lock.json').exists()
  assert ckpt_lib.latest_step(workdir) is None
  assert not (workdir / 'metrics.jsonl').exists()


def test_a_second_launcher_is_refused_and_takes_over_a_dead_ones_lock(
    data_dir, full, tmp_path):
  workdir = tmp_path / 'run'
  cmd = _cli(workdir, data_dir, checkpoint_every=20)
  first = _popen(cmd)
  try:
    _wait_for(lambda: ckpt_lib.latest_step(workdir) is not None, first)
    # Paused (alive, holding its lock) so that it cannot finish its 200
    # steps while the second launcher starts.
    os.killpg(first.pid, signal.SIGSTOP)
    second = subprocess.run(cmd, cwd=_ROOT, env=_ENV, capture_output=True,
                            text=True, timeout=120)
    assert first.poll() is None
    os.killpg(first.pid, signal.SIGKILL)
  finally:
    _finish(first)
  assert second.returncode == 1, second.stderr[-3000:]
  line = second.stderr.strip().splitlines()[-1]
  assert line.startswith(f'error: workdir {workdir} is in use by another '
                         f'run: pid {first.pid} on host '
                         f'{socket.gethostname()!r} since '), line
  assert 'Traceback' not in second.stderr
  # The first run was killed -9: its lock stays, and the next launcher
  # takes it over, resumes and ends where the uninterrupted run does.
  assert json.loads((workdir / 'lock.json').read_text())['pid'] == first.pid
  third = subprocess.run(cmd, cwd=_ROOT, env=_ENV, capture_output=True,
                         text=True, timeout=240)
  assert third.returncode == 0, third.stderr[-3000:]
  assert (f'took over the lock of {workdir}: pid {first.pid} on host '
          in third.stderr), third.stderr[-3000:]
  assert f'is stale (pid {first.pid} on this host is gone)' in third.stderr
  summary = json.loads((workdir / 'summary.json').read_text())
  assert summary['step'] == _STEPS
  # One config and mesh: the same compiled steps, replayed from the
  # checkpoint: bit for bit.
  assert summary['final_eval_loss'] == full['final_eval_loss']
  assert not (workdir / 'lock.json').exists()


def test_a_lock_from_another_host_is_taken_over_once_its_heartbeat_is_old(
    tmp_path):
  lock_file = tmp_path / 'lock.json'
  holder = {'host': 'another-host', 'pid': 1, 'started': time.time() - 99,
            'heartbeat': time.time() - 5}
  lock_file.write_text(json.dumps(holder))
  lines = []
  lock = workdir_lock.WorkdirLock(tmp_path, say=lines.append, stale_s=60)
  with pytest.raises(workdir_lock.WorkdirLockedError,
                     match="pid 1 on host 'another-host'"):
    lock.acquire()
  holder['heartbeat'] = time.time() - 61
  lock_file.write_text(json.dumps(holder))
  with workdir_lock.WorkdirLock(tmp_path, say=lines.append, stale_s=60,
                                heartbeat_s=0.05) as lock:
    mine = json.loads(lock_file.read_text())
    assert mine['pid'] == os.getpid()
    time.sleep(0.3)  # the heartbeat moves on
    assert json.loads(lock_file.read_text())['heartbeat'] > mine['heartbeat']
  assert len(lines) == 1 and "its heartbeat from host 'another-host' is " \
      in lines[0]
  assert not lock_file.exists()


def test_sigterm_saves_exits_zero_and_resumes_bit_exactly(data_dir, full,
                                                          tmp_path):
  config = _config(data_dir)
  workdir = tmp_path / 'run'
  env = _ENV
  returncode, out, err = preempt_after_steps(_cli(workdir, data_dir), _ROOT,
                                             env, workdir, 3, 240)
  assert returncode == 0, err
  step = ckpt_lib.latest_step(workdir)
  assert step is not None and 3 <= step < _STEPS, (step, out)
  assert f'preempted: saved a checkpoint at step {step} ' in out, out
  assert 'Traceback' not in err, err
  records = [json.loads(l) for l in
             (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert records[-1]['step'] == step

  resumed = train.train_and_evaluate(config, workdir)
  assert resumed['finished'] and resumed['step'] == _STEPS
  # One config, one mesh: the CLI process and this one compile the same
  # programs on this machine, and the resume replays them: bit for bit.
  for a, b in zip(leaves(full['state']), leaves(resumed['state'])):
    np.testing.assert_array_equal(a, b)
  assert resumed['cross_worker_bytes'] == full['cross_worker_bytes']


def test_watch_without_distributed_uses_a_signal_flag():
  before = signal.getsignal(signal.SIGTERM)
  with preemption.PreemptionWatch() as watch:
    assert not watch.reached(3) and not watch.preempted
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)  # the handler runs between bytecodes
    assert watch.reached(4) and watch.reached(5)
    assert watch.step == 4
  assert signal.getsignal(signal.SIGTERM) is before
