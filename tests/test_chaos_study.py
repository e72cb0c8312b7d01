"""The wall-clock chaos study's parts that run without its processes: the
synchronous job's actions and step accounting, and the translation of the
schedule into the virtual-clock models (experiments/_sync_chaos.py,
experiments/_chaos_predict.py)."""

import json
import os
import pathlib

import pytest

from experiments import _chaos_predict as predict
from experiments import _sync_chaos as sync

EVENTS = [(10., 'kill', 'l1'), (20., 'start', 'l1'), (25., 'kill', 'syncer'),
          (30., 'kill', 'l2'), (32., 'kill', 'l0'), (35., 'start', 'l0'),
          (40., 'start', 'l2')]


def test_the_job_is_down_until_every_killed_worker_is_back():
  assert sync.job_actions(EVENTS, spare=False) == [
      (10., 'kill', 1), (20., 'restart', None), (30., 'kill', 2),
      (40., 'restart', None)]


def test_with_a_spare_every_kill_restarts_the_job_at_once():
  assert sync.job_actions(EVENTS, spare=True) == [
      (10., 'kill', 1), (10., 'restart', None), (30., 'kill', 2),
      (30., 'restart', None), (32., 'kill', 0), (32., 'restart', None)]
  with pytest.raises(ValueError, match='an event is'):
    sync.job_actions([(1., 'pause', 'l0')], spare=False)


def _incarnation(resume, started, steps, start_time, killed=None, ckpt=None):
  # steps logged one per second from start_time
  return {'resume_step': resume, 'started': started, 'killed': killed,
          'checkpoint': ckpt,
          'steps': {s: start_time + i for i, s in enumerate(steps)}}


def test_the_account_counts_kept_lost_and_unsynced_steps():
  # Steps 1..20 logged at 11..30 s, killed at 30.5 s with its checkpoint
  # at 16; restarted at 35 s, steps 17..40 logged at 51..74 s. Window
  # (11, 70]: the second reaches step 36 by 70 s.
  incs = [_incarnation(0, 0., range(1, 21), 11., killed=30.5, ckpt=16),
          _incarnation(16, 35., range(17, 41), 51.)]
  a = sync.account(incs, 11., 70., 8, final_checkpoint=32)
  assert (a.first_step, a.final_step, a.steps_kept) == (1, 32, 31)
  assert (a.steps_lost, a.steps_unsynced) == (4, 4)  # 17..20; 33..36
  assert a.syncs == 4  # 8, 16 (lost later), 24, 32
  assert a.step_s == pytest.approx(1.)
  assert (a.startup_s, a.restart_s) == (11., [16.])
  # Down at the end: killed at 60.5 s after step 26, its lineage ends at
  # its last checkpoint (24); steps 25 and 26 are lost too.
  incs[-1] = _incarnation(16, 35., range(17, 27), 51., killed=60.5)
  a = sync.account(incs, 11., 70., 8, final_checkpoint=24)
  assert (a.final_step, a.steps_kept, a.steps_unsynced) == (24, 23, 0)
  assert a.steps_lost == 4 + 2
  with pytest.raises(ValueError, match='no step'):
    sync.account([_incarnation(0, 0., [], 0.)], 0., 1., 8, 0)


def _write(path: pathlib.Path, steps) -> None:
  tmp = path.with_suffix('.tmp')
  tmp.write_text(''.join(json.dumps({'step': s}) + '\n' for s in steps))
  os.replace(tmp, path)  # as the trainer rewrites it on resume


def test_the_step_clock_ignores_the_old_file_until_the_resume_rewrites_it(
    tmp_path):
  path = tmp_path / 'metrics.jsonl'
  clock = sync.StepClock(path)
  clock.new_incarnation(0, 0.)
  clock.poll(1.)  # no file yet
  _write(path, [1, 2, 3, 4, 5])
  clock.poll(2.)
  clock.new_incarnation(2, 3.)  # resumes from step 2
  clock.poll(4.)  # the old file: steps 3..5 are not this incarnation's
  assert clock.incarnations[1]['steps'] == {}
  _write(path, [1, 2, 3])
  clock.poll(5.)
  assert clock.incarnations[0]['steps'] == {s: 2. for s in range(1, 6)}
  assert clock.incarnations[1]['steps'] == {3: 5.}


def test_learner_kills_become_timeline_failures_in_ticks():
  failures = predict.learner_failures(EVENTS, {'l1': 5.}, 0.5, 100.)
  # l2 and l0 have no measured restart cost: they take l1's
  assert failures == [(1, 20., 30.), (2, 60., 30.), (0, 64., 16.)]
  assert predict.learner_failures(EVENTS, {}, 0.5, 100.)[0] == (1, 20., 20.)
  with pytest.raises(ValueError, match='never restarted'):
    predict.learner_failures([(1., 'kill', 'l3')], {}, 0.5, 100.)


def test_the_predictions_fall_with_the_failures():
  kw = dict(window_s=150., fast_step_s=0.25, slow_step_s=0.75,
            sync_every=8, quorum=2, grace=0.2, grace_cap_s=0.5, overlap=2.)
  calm = predict.predict_async([], restart_s={}, **kw)
  hit = predict.predict_async(EVENTS, restart_s={'l0': 20., 'l1': 20.,
                                                 'l2': 20.}, **kw)
  assert 0 < hit['goodput'] < calm['goodput'] < 1
  # The synchronous job at 1 s per step, 5 s restarts, a checkpoint every 4
  # steps: paused over [10, 25) in a 100 s window keeps 8 + 75 s of steps.
  s = predict.predict_sync([(10., 'kill', 1), (20., 'restart', None)],
                           window_s=100., step_s=1., restart_s=5.,
                           checkpoint_every=4, tokens_per_step=128.,
                           fast_tokens_per_s=512.)
  assert s['goodput'] == pytest.approx(83 * 128 / (100 * 512))
  assert s['running_fraction'] == pytest.approx(0.85)
