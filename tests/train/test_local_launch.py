"""``loc_opt.train.local_launch`` and ``experiments.train --local_processes``:
one run as several local processes, each pinned to its share of the cores."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from loc_opt.train import checkpoint as ckpt_lib
from loc_opt.train import local_launch
from tests.train._helpers import preempt_after_steps

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 240

# A child that records its layout flags and cores, then does what MODE says.
CHILD = textwrap.dedent('''
    import json, os, pathlib, signal, sys, time
    flags = dict(a[2:].split('=', 1) for a in sys.argv[1:])
    out = pathlib.Path(os.environ['OUT'])
    i = flags['process_id']
    def done(signum, frame):
      (out / f'term{i}').write_text('')
      sys.exit(0)
    signal.signal(signal.SIGTERM, done)
    (out / f'{i}.json').write_text(json.dumps(
        {'flags': flags, 'cores': sorted(os.sched_getaffinity(0)),
         'pid': os.getpid()}))
    mode = os.environ['MODE']
    if mode == 'fail' and i == '1':
      sys.exit(3)
    if mode == 'kill9' and i == '1':
      os.kill(os.getpid(), signal.SIGKILL)
    if mode == 'kill9':
      time.sleep(120)
    if mode in ('fail', 'wait'):
      time.sleep(3600)
''')


def _run(tmp_path, mode, num_processes=2):
  os.environ.update(OUT=str(tmp_path), MODE=mode)
  try:
    return local_launch.run([sys.executable, '-c', CHILD], num_processes)
  finally:
    del os.environ['OUT'], os.environ['MODE']


def test_core_shares():
  assert local_launch.core_shares([0, 1], 2) == [{0}, {1}]
  assert local_launch.core_shares([0, 1, 2, 3, 4], 2) == [{0, 1, 2}, {3, 4}]
  assert local_launch.core_shares([3, 1], 4) == [{1}, {3}, {1}, {3}]
  assert local_launch.core_shares([0, 1, 2, 3], 1) == [{0, 1, 2, 3}]
  with pytest.raises(ValueError, match='num_processes'):
    local_launch.core_shares([0, 1], 0)


def test_each_process_gets_its_layout_and_cores(tmp_path):
  own = os.sched_getaffinity(0)
  assert _run(tmp_path, 'exit', num_processes=3) == 0
  assert os.sched_getaffinity(0) == own  # the launcher's cores restored
  seen = [json.loads((tmp_path / f'{i}.json').read_text()) for i in range(3)]
  ports = {s['flags']['coordinator_address'] for s in seen}
  assert len(ports) == 1 and ports.pop().startswith('localhost:')
  assert [s['flags']['process_id'] for s in seen] == ['0', '1', '2']
  assert {s['flags']['num_processes'] for s in seen} == {'3'}
  shares = local_launch.core_shares(os.sched_getaffinity(0), 3)
  assert [set(s['cores']) for s in seen] == shares


def test_a_failed_process_stops_the_others(tmp_path, capfd):
  start = time.monotonic()
  assert _run(tmp_path, 'fail') == 3
  # The other child sleeps an hour unless it is killed: a liveness bound
  # far above any machine's start-up time, not a speed check.
  assert time.monotonic() - start < 600
  assert 'process 1 of 2 exited with code 3' in capfd.readouterr().err
  assert not list(tmp_path.glob('term*'))  # killed, not asked to save


def test_a_killed_process_gives_128_plus_the_signal(tmp_path, capfd):
  assert _run(tmp_path, 'kill9') == 128 + signal.SIGKILL
  assert ('process 1 of 2 was killed by SIGKILL (exit code 137)'
          in capfd.readouterr().err)


def _running(pid: int) -> bool:
  """Whether process ``pid`` exists and is not a zombie."""
  try:
    stat = pathlib.Path(f'/proc/{pid}/stat').read_text()
  except FileNotFoundError:
    return False
  return stat.rsplit(')', 1)[1].split()[0] not in ('Z', 'X')


def _launcher(tmp_path, mode):
  """A launcher process running CHILD twice; once both children started:
  ``(launcher, child pids)``."""
  parent = subprocess.Popen(
      [sys.executable, '-c',
       'import sys; from loc_opt.train import local_launch; '
       f'sys.exit(local_launch.run([sys.executable, "-c", {CHILD!r}], 2))'],
      cwd=ROOT, env=dict(os.environ, OUT=str(tmp_path), MODE=mode,
                         PYTHONPATH=str(ROOT)))
  deadline = time.monotonic() + 60
  while len(list(tmp_path.glob('*.json'))) < 2:
    assert time.monotonic() < deadline, 'the children did not start'
    time.sleep(0.1)
  time.sleep(0.2)  # both json files written whole
  pids = [json.loads((tmp_path / f'{i}.json').read_text())['pid']
          for i in range(2)]
  return parent, pids


def test_children_die_with_a_launcher_killed_by_sigkill(tmp_path):
  """kill -9 of the launcher leaves no child running (each child asked for
  a SIGKILL at its parent's death); before, they slept on as orphans."""
  parent, pids = _launcher(tmp_path, 'wait')
  try:
    assert all(_running(p) for p in pids)
    parent.kill()
    assert parent.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 5
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert not [p for p in pids if _running(p)]
  finally:
    for p in pids:
      try:
        os.kill(p, signal.SIGKILL)
      except ProcessLookupError:
        pass


def test_sigint_reaches_every_process_as_sigterm_and_gives_130(tmp_path):
  """Ctrl-C to the launcher: every child gets a preemption notice (saves
  and exits 0 in a real run); the launcher exits 130."""
  parent, _ = _launcher(tmp_path, 'wait')
  try:
    parent.send_signal(signal.SIGINT)
    assert parent.wait(timeout=60) == 128 + signal.SIGINT
  finally:
    if parent.poll() is None:
      parent.kill()
  assert sorted(p.name for p in tmp_path.glob('term*')) == ['term0', 'term1']


def test_sigterm_reaches_every_process(tmp_path):
  """A preemption notice to the launcher goes to every child."""
  parent = subprocess.Popen(
      [sys.executable, '-c',
       'import sys; from loc_opt.train import local_launch; '
       f'sys.exit(local_launch.run([sys.executable, "-c", {CHILD!r}], 2))'],
      cwd=ROOT, env=dict(os.environ, OUT=str(tmp_path), MODE='wait',
                         PYTHONPATH=str(ROOT)))
  try:
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob('*.json'))) < 2:
      assert time.monotonic() < deadline, 'the children did not start'
      time.sleep(0.1)
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=60) == 0
  finally:
    if parent.poll() is None:
      parent.kill()
  assert sorted(p.name for p in tmp_path.glob('term*')) == ['term0', 'term1']


def _train_cmd(workdir, *args, **fields):
  fields = {'num_steps': 8, 'batch_size': 16, 'data.eval_batch_size': 16,
            'eval_batches': 1, 'eval_every': 8, 'log_every': 2,
            'checkpoint_every': 0, 'progress': False, 'model.hidden': 64,
            'data.seq_len': 32, 'data.max_bytes': 300_000,
            'outer.sync_every': 4, 'mesh.workers': 4, 'mesh.data': 1,
            'mesh.simulate_workers': True, **fields}
  return [sys.executable, '-m', 'experiments.train',
          f'--config={ROOT / "configs" / "diloco_lm.py"}:mlp',
          f'--workdir={workdir}', '--cpu_devices=1',
          *[f'--config.{k}={v}' for k, v in fields.items()], *args]


ENV = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=str(ROOT))


def _train(workdir, *args, timeout=TIMEOUT_S, **fields):
  return subprocess.run(_train_cmd(workdir, *args, **fields), cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout,
                        env=ENV)


@pytest.mark.slow
def test_two_local_processes_train_as_one(tmp_path):
  """4 stacked workers in 2 processes (2 on each one's device, the
  pseudo-gradients averaged across processes by gloo) train as the 4
  stacked on one process's device, and a run halted in 2 processes
  resumes in one."""
  one = _train(tmp_path / 'one')
  two = _train(tmp_path / 'two', '--local_processes=2')
  assert one.returncode == 0, one.stderr[-3000:]
  assert two.returncode == 0, two.stderr[-3000:]
  s1, s2 = (json.loads((tmp_path / n / 'summary.json').read_text())
            for n in ('one', 'two'))
  assert (s1['worker_groups'], s2['worker_groups']) == (1, 2)
  assert s1['cross_worker_bytes'] == 0 < s2['cross_worker_bytes']
  assert s2['bytes_per_phase']['False'] == 0  # inner steps stay local
  assert s1['syncs'] == s2['syncs'] == 2
  np.testing.assert_allclose(s2['final_eval_loss'], s1['final_eval_loss'],
                             rtol=1e-5)
  assert 'bytes between the 2 groups of devices' in two.stdout
  # Halted in 2 processes, resumed in 1: the same run.
  mixed = tmp_path / 'mixed'
  halted = _train(mixed, '--local_processes=2', halt_after_steps=4,
                  checkpoint_every=4)
  assert halted.returncode == 0, halted.stderr[-3000:]
  assert ckpt_lib.latest_step(mixed) == 4
  resumed = _train(mixed, checkpoint_every=4)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  s3 = json.loads((mixed / 'summary.json').read_text())
  assert s3['step'] == 8 and s3['worker_groups'] == 1
  np.testing.assert_allclose(s3['final_eval_loss'], s1['final_eval_loss'],
                             rtol=1e-5)


@pytest.mark.parametrize('args, message', [
    (('--local_processes=2', '--process_id=0'),
     'drop --process_id'),
    (('--local_processes=2', '--distributed=off'), 'distributed=off'),
    (('--local_processes=0',), 'must be >= 1'),
])
def test_local_processes_refuses_what_contradicts_it(tmp_path, args,
                                                    message):
  result = _train(tmp_path, *args, timeout=60)
  assert result.returncode != 0
  assert message in result.stderr
  assert not (tmp_path / 'summary.json').exists()


@pytest.mark.slow
def test_sigterm_to_local_processes_saves_and_resumes_exactly(tmp_path):
  """A preemption notice to the launcher: both processes save one
  checkpoint at the same step and exit 0; the same command resumes and
  ends where an uninterrupted 2-process run does, bit for bit."""
  fields = {'num_steps': 120, 'log_every': 1, 'eval_every': 120,
            'checkpoint_every': 1000}
  full = _train(tmp_path / 'full', '--local_processes=2', **fields)
  assert full.returncode == 0, full.stderr[-3000:]
  workdir = tmp_path / 'run'
  cmd = _train_cmd(workdir, '--local_processes=2', **fields)
  returncode, out, err = preempt_after_steps(cmd, ROOT, ENV, workdir, 3,
                                             TIMEOUT_S)
  assert returncode == 0, err[-3000:]
  step = ckpt_lib.latest_step(workdir)
  assert step is not None and 3 <= step < 120, (step, out)
  assert f'preempted: saved a checkpoint at step {step} ' in out, out
  assert 'Traceback' not in err, err[-3000:]
  resumed = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True,
                           text=True, timeout=TIMEOUT_S)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  s_full, s_run = (json.loads((tmp_path / n / 'summary.json').read_text())
                   for n in ('full', 'run'))
  assert s_run['step'] == s_full['step'] == 120
  # Both are 2-process runs of the same compiled steps on the same cores;
  # the resume replays them on the restored state: bit for bit.
  assert s_run['final_eval_loss'] == s_full['final_eval_loss']
  assert s_run['final_train_loss'] == s_full['final_train_loss']


@pytest.fixture(scope='module')
def halted_at_4(tmp_path_factory):
  """A 2-process run halted with its checkpoint at step 4 (copy it)."""
  workdir = tmp_path_factory.mktemp('halted') / 'run'
  halted = _train(workdir, '--local_processes=2', halt_after_steps=4,
                  checkpoint_every=4)
  assert halted.returncode == 0, halted.stderr[-3000:]
  assert ckpt_lib.latest_step(workdir) == 4
  return workdir


def _child(parent: int, process_id: int) -> int:
  """The pid of the launcher ``parent``'s child ``process_id``."""
  for stat in pathlib.Path('/proc').glob('[0-9]*/stat'):
    try:
      ppid = int(stat.read_text().rsplit(')', 1)[1].split()[1])
      args = (stat.parent / 'cmdline').read_bytes().split(b'\0')
    except (FileNotFoundError, ProcessLookupError, IndexError):
      continue
    if ppid == parent and f'--process_id={process_id}'.encode() in args:
      return int(stat.parent.name)
  raise AssertionError(f'no process {process_id} under {parent}')


@pytest.mark.slow
@pytest.mark.parametrize('target', [
    'launcher',
    pytest.param('process 1', marks=pytest.mark.xfail(
        strict=False, reason='known race (docs/resilience.md): a SIGTERM '
        'to process 1 mid-restore can leave process 0 reporting no '
        'readable checkpoint and the job waiting until it is killed; seen '
        'once in a full suite run')),
    'process 0'])
def test_sigterm_while_local_processes_restore_stops_them_at_once(
    tmp_path, halted_at_4, target):
  """A preemption notice while a resumed --local_processes run restores
  its checkpoint, to the launcher or to one process: the whole job exits
  within seconds, 143 with one line, the checkpoint as it was. Before,
  JAX's preemption service took the SIGTERM and set its sync point at call
  1, which the resumed run (asking at step 4 on) never met: it trained on
  to the end; and a process that stopped left another waiting in Orbax's
  restore barrier, and itself in jax.distributed's shutdown barrier. (A
  SIGTERM to process 0 alone: its line and the launcher's; the other's
  failed restore is not called an unreadable checkpoint.)"""
  workdir = tmp_path / 'run'
  shutil.copytree(halted_at_4, workdir)
  saved = sorted(p.name for p in (workdir / 'checkpoints').iterdir())
  proc = subprocess.Popen(
      _train_cmd(workdir, '--local_processes=2', checkpoint_every=4),
      cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, start_new_session=True)
  try:
    err = ''
    for line in proc.stderr:  # the run ends, or the line comes
      err += line
      if 'restoring the checkpoint at step 4' in line:
        break
    assert 'restoring' in err, err[-3000:]
    if target == 'launcher':
      proc.send_signal(signal.SIGTERM)
    else:
      os.kill(_child(proc.pid, int(target[-1])), signal.SIGTERM)
    sent = time.monotonic()
    out, rest = proc.communicate(timeout=120)
    took = time.monotonic() - sent
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.communicate()
  err += rest
  lines = [l for l in (err + out).splitlines()
           if l.startswith(('interrupted', 'local_launch', 'preempted'))]
  assert took < 15, (took, lines)
  assert 'Traceback' not in err, err[-3000:]
  assert 'no readable checkpoint' not in err, err[-3000:]
  if proc.returncode == 0:  # the notice came as training started: saved
    assert len(lines) == 1, lines
    assert lines[0].startswith('preempted: saved a checkpoint at step '), \
        lines
    assert ckpt_lib.latest_step(workdir) in (4, 5)
    return
  assert len(lines) == 1 + (target == 'process 0'), lines
  assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, out,
                                                   lines, err[-3000:])
  if target != 'process 1':
    assert 'interrupted by SIGTERM during startup' in lines[0], lines
  if target != 'launcher':
    assert f'{target} of 2 exited with code 143; stopped the others' in \
        lines[-1], lines
  assert sorted(p.name for p in (workdir / 'checkpoints').iterdir()) == saved
  assert not (workdir / 'summary.json').exists()
