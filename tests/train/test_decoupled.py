"""Decoupled DiLoCo in the trainer: the timeline drives the learners, a
merge moves one fragment, and a SIGTERM resumes bit-exactly."""

import os
import signal
import threading
import time

import jax
import numpy as np
import pytest

from loc_opt import outer
from loc_opt import train
from loc_opt.train import checkpoint as ckpt_lib
from loc_opt.train import experiment as exp_lib
from loc_opt.train import registry
from loc_opt.train.method import shared_mask
from tests.train._helpers import leaves
from tests.train._helpers import tiny_config

_STEPS = 16


def _config(data_dir, **overrides):
  return tiny_config(data_dir, **{
      'outer.method': 'decoupled_diloco', 'num_steps': _STEPS,
      'outer.decoupled_diloco.num_fragments': 2,
      'wallclock.worker_speeds': (1., 1., .6, .6),
      'faults.failures': ((3, 5, 8),), 'checkpoint_every': 1000,
      'eval_every': 8, 'log_every': 1, **overrides})


def _sigterm_after(metrics, lines, timeout=300):
  """A thread that sends this process SIGTERM once ``metrics`` has
  ``lines`` lines (the run's SIGTERM handler is installed by then)."""

  def watch():
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if metrics.exists() and len(metrics.read_text().splitlines()) >= lines:
        os.kill(os.getpid(), signal.SIGTERM)
        return
      time.sleep(0.01)

  thread = threading.Thread(target=watch, daemon=True)
  thread.start()
  return thread


def test_timeline_drives_the_run_and_sigterm_resumes_bit_exactly(
    data_dir, tmp_path):
  config = _config(data_dir)
  timeline = registry.decoupled_timeline(config)
  # learner 3 is down for steps 5..12 and rejoins; the slow learners take
  # fewer steps
  assert not timeline.alive[6:12, 3].any() and timeline.rejoin[:, 3].any()
  steps_taken = timeline.active.sum(0)
  assert steps_taken[0] == _STEPS and steps_taken[2] < 0.7 * _STEPS
  full = train.train_and_evaluate(config, tmp_path / 'full')
  assert full['finished'] and full['syncs'] == len(timeline.rounds)
  state = full['state']['opt_state']
  np.testing.assert_array_equal(np.asarray(state.inner_steps),
                                steps_taken)
  # The shared fields (Method.shared_fields) are bit-identical on every
  # learner (the same operations in one program on level inputs); the
  # learners' own counters differ (they step at their speeds).
  mask = shared_mask(registry.METHODS['decoupled_diloco'], state)
  for x, shared in zip(jax.tree.leaves(state), jax.tree.leaves(mask)):
    x = np.asarray(x)
    if shared:
      for m in range(1, x.shape[0]):
        np.testing.assert_array_equal(x[m], x[0])
  assert not np.array_equal(np.asarray(state.steps_since)[2],
                            np.asarray(state.steps_since)[0])
  # A merge moves its fragment once per learner (fp32, plus a few scalars);
  # inner steps move nothing (read from the run's compiled programs).
  exp = exp_lib.get_experiment(config)
  nbytes = exp.programs.bytes_per_step
  assert nbytes[False] == 0
  shapes = jax.eval_shape(exp.model.init, jax.random.key(0))
  ids = jax.tree.leaves(outer.balanced_fragments(shapes, 2))
  sizes = [x.size for x in jax.tree.leaves(shapes)]
  for p in range(2):
    n = sum(s for s, i in zip(sizes, ids) if i == p)
    per_worker = nbytes[(p, None)] / config.mesh.workers
    assert 4 * n <= per_worker <= 4 * n + 4 * 64, (p, per_worker, 4 * n)
  # Learner 3 missed the merges while it was down.
  missed = sum(3 not in r.admitted for r in timeline.rounds)
  assert int(np.asarray(state.left_out)[3]) == missed > 0

  workdir = tmp_path / 'run'
  if threading.current_thread() is not threading.main_thread():
    pytest.skip('the SIGTERM handler needs the main thread')
  thread = _sigterm_after(workdir / 'metrics.jsonl', 6)
  first = train.train_and_evaluate(config, workdir)
  thread.join()
  step = ckpt_lib.latest_step(workdir)
  assert not first['finished'] and 6 <= step < _STEPS, step
  resumed = train.train_and_evaluate(config, workdir)
  assert resumed['finished'] and resumed['step'] == _STEPS
  # The resume replays the same compiled steps: bit for bit.
  for a, b in zip(leaves(full['state']), leaves(resumed['state'])):
    np.testing.assert_array_equal(a, b)
  assert resumed['cross_worker_bytes'] == full['cross_worker_bytes']


def test_failures_need_a_timeline_method(data_dir, tmp_path):
  config = tiny_config(data_dir, **{'faults.failures': ((0, 2, 2),)})
  with pytest.raises(ValueError, match='does not simulate learner failures'):
    train.train_and_evaluate(config, tmp_path)
  assert not any(tmp_path.iterdir())
  bad = _config(data_dir, **{'faults.failures': ((4, 2, 2),)})
  with pytest.raises(ValueError, match='faults.failures entry'):
    train.train_and_evaluate(bad, tmp_path)
