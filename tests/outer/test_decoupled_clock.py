"""Decoupled DiLoCo's timeline: quorum, grace, failures on a scripted clock.

Three learners; learners 0 and 1 take one tick per step (they finish at
times 1, 2, 3, ...), learner 2 runs at speed 0.4 (finishes at 2.5, 5, 7.5,
...). With ``H = 4``, ``P = 2`` fragment 1's first window opens at the start
of tick 1 and fragment 0's at tick 3.
"""

import numpy as np
import pytest

from loc_opt import outer

SPEEDS = (1., 1., .4)


def _timeline(steps=8, **kwargs):
  args = dict(num_learners=3, sync_every=4, num_fragments=2, overlap=2,
              quorum=1, grace=0., sync_steps=1., speeds=SPEEDS)
  args.update(kwargs)
  return outer.decoupled_timeline(steps, **args)


def test_learners_step_on_their_own_clocks():
  t = _timeline()
  np.testing.assert_array_equal(t.active[:, 0], np.ones(8, bool))
  # learner 2 finishes at 2.5, 5.0, 7.5: ticks 2, 4, 7
  np.testing.assert_array_equal(np.flatnonzero(t.active[:, 2]), [2, 4, 7])


def test_quorum_one_without_grace_merges_the_first_reports():
  first = _timeline().rounds[0]
  assert first.fragment == 1 and first.opened == 1.
  assert first.reported == {0: 2., 1: 2.}  # learner 2 is still stepping
  assert first.quorum_time == 2. and first.deadline == 2.
  assert first.admitted == (0, 1)
  assert first.merge_tick == 1 and first.receive_tick == 2
  t = _timeline()
  assert t.phase(1) == (1, None) and t.phase(0) is False
  np.testing.assert_array_equal(t.admitted[1], [True, True, False])
  np.testing.assert_array_equal(t.receive[2, :, 1], [True] * 3)


def test_grace_window_admits_the_straggler():
  # slack = tau * xi_slowest - (q - open) - sync = 2 * 2.5 - 1 - 1 = 3;
  # grace 0.2 * 3 = 0.6 (under the cap 1): the deadline 2.6 takes learner
  # 2's report at 2.5, and the merge moves to tick 2.
  first = _timeline(grace=.2).rounds[0]
  assert first.deadline == pytest.approx(2.6)
  assert first.admitted == (0, 1, 2)
  assert first.merge_tick == 2 and first.receive_tick == 3
  # the cap bounds the window
  capped = _timeline(grace=1., grace_cap=.4).rounds[0]
  assert capped.deadline == pytest.approx(2.4) and capped.admitted == (0, 1)


def test_full_quorum_waits_for_every_live_learner():
  first = _timeline(quorum=3).rounds[0]
  assert first.quorum_time == 2.5 and first.admitted == (0, 1, 2)
  assert first.merge_tick == 2


def test_a_failed_learner_is_out_and_rejoins():
  # learner 1 fails at 2.5 for 3 ticks: down during ticks 2-4, back (with
  # rejoin) on tick 5, stepping again from tick 6.
  t = _timeline(failures=[(1, 2.5, 3.)], quorum=1, grace=.2)
  np.testing.assert_array_equal(t.alive[:, 1],
                                [1, 1, 0, 0, 0, 1, 1, 1])
  np.testing.assert_array_equal(t.active[:, 1],
                                [1, 1, 0, 0, 0, 0, 1, 1])
  np.testing.assert_array_equal(np.flatnonzero(t.rejoin[:, 1]), [5])
  first = t.rounds[0]
  assert first.admitted == (0, 1, 2)  # learner 1 reported before failing
  np.testing.assert_array_equal(t.receive[3, :, 1], [True, False, True])
  # fragment 0 (window at tick 3): learner 1 is down and never reports
  assert 1 not in t.rounds[1].reported
  # quorum 3 = M waits for every *live* learner: while learner 1 is down
  # the rounds merge learners 0 and 2 (learner 1's report at 2.0 was in
  # before it failed); nothing is skipped
  strict = _timeline(steps=12, failures=[(1, 2.5, 6.)], quorum=3)
  assert strict.skipped == 0
  assert [r.admitted for r in strict.rounds] == [
      (0, 1), (0, 2), (0, 2), (0, 2), (0, 1, 2)]


def test_a_failure_starting_on_the_rejoin_tick_is_not_dropped():
  # Learner 0 is back at 4.5 and fails again at 4.6: it must stay down
  # until 7.6 (ticks 4-6) as with the second failure alone, and rejoin on
  # tick 7.
  kw = dict(num_learners=2, sync_every=4, num_fragments=2)
  both = outer.decoupled_timeline(12, failures=[(0, 2., 2.5), (0, 4.6, 3.)],
                                  **kw)
  alone = outer.decoupled_timeline(12, failures=[(0, 4.6, 3.)], **kw)
  np.testing.assert_array_equal(both.alive[:, 0],
                                [1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1])
  np.testing.assert_array_equal(both.alive[4:, 0], alone.alive[4:, 0])
  np.testing.assert_array_equal(np.flatnonzero(both.rejoin[:, 0]), [7])
  np.testing.assert_array_equal(both.active[4:7, 0], [0, 0, 0])


def test_every_chaos_failure_takes_its_learner_down():
  # Seed 0 holds a failure that starts on the tick its learner rejoins
  # (learner 3 at 7644.3); every failure's own tick must be down.
  trace = outer.chaos_failures(4, 20000, mtbf=150., downtime=30., seed=0)
  back = {(m, int(np.ceil(s + d)) - 1) for m, s, d in trace}  # rejoin tick
  assert any((m, int(s)) in back for m, s, _ in trace)  # the case is there
  t = outer.decoupled_timeline(20000, num_learners=4, sync_every=8,
                               num_fragments=2, failures=trace)
  hit = [t.alive[int(s), m] for m, s, _ in trace]
  assert not any(hit), [f for f, h in zip(trace, hit) if h]
  # down for the whole failure: every tick that ends inside it
  for m, s, d in trace:
    assert not t.alive[int(s):int(np.ceil(s + d)) - 1, m].any()


def test_full_quorum_never_waits_for_a_dead_learner():
  # Learner 1 down for good: K = M = 3 merges the two live learners.
  t = outer.decoupled_timeline(120, num_learners=3, sync_every=6,
                               num_fragments=2, quorum=3,
                               failures=[(1, .5, 1000.)])
  assert t.summary()['merges'] >= 35 and t.skipped == 0
  assert all(r.admitted == (0, 2) for r in t.rounds)


def test_a_global_model_that_cannot_move_warns():
  # learner 2 takes 50 ticks per step: with K = 3 no round of 40 ticks
  # ever gets its report
  with pytest.warns(RuntimeWarning,
                    match=r'fragments \[0, 1\] are never merged'):
    t = _timeline(steps=40, quorum=3, speeds=(1., 1., .02))
  assert t.summary()['merges'] == 0 and t.skipped > 0


def test_peer_rejoin_names_a_live_source():
  t = _timeline(failures=[(0, 2.5, 3.)], peer_rejoin=True)
  assert t.phase(5)[1] == 1  # the lowest live learner
  assert _timeline(failures=[(0, 2.5, 3.)]).source[5] == -1


def test_same_seed_same_timeline_and_chaos_trace():
  trace = outer.chaos_failures(3, 400, mtbf=40., downtime=10., seed=3)
  assert trace == outer.chaos_failures(3, 400, mtbf=40., downtime=10.,
                                       seed=3)
  assert trace != outer.chaos_failures(3, 400, mtbf=40., downtime=10.,
                                       seed=4)
  # about 400 / (40 + 10) = 8 failures per learner
  assert 12 <= len(trace) <= 40
  # 4 chips per learner at a per-chip MTBF of 160: the same rate
  assert trace == outer.chaos_failures(3, 400, mtbf=160., downtime=10.,
                                       chips=4, seed=3)
  a = _timeline(steps=400, jitter=.3, failures=trace, seed=1)
  b = _timeline(steps=400, jitter=.3, failures=trace, seed=1)
  c = _timeline(steps=400, jitter=.3, failures=trace, seed=2)
  for field in ('merge', 'active', 'admitted', 'receive', 'rejoin'):
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
  assert not np.array_equal(a.active, c.active)
  assert a.summary()['alive_fraction'] < 1


def test_plan_counts_merges_as_syncs():
  t = _timeline(failures=[(0, 2.5, 3.)], peer_rejoin=True)
  plan = t.plan()
  assert plan.is_sync((1, None)) and not plan.is_sync((None, 1))
  assert plan.num_syncs(0, 8) == len(t.rounds)


@pytest.mark.parametrize('kwargs,match', [
    ({'quorum': 4}, 'quorum=4 is more than'),
    ({'sync_every': 5}, 'multiple of num_fragments'),
    ({'speeds': (1., .5)}, 'speeds must be 3 values'),
    ({'grace': 1.5}, 'grace'),
    ({'sync_steps': 4.}, 'sync_steps=4.0 must be below'),
    ({'failures': [(3, 1., 1.)]}, 'names learner 3'),
    ({'failures': [(0, 1., 0.)]}, 'duration > 0'),
])
def test_bad_arguments_name_the_field(kwargs, match):
  with pytest.raises(ValueError, match=match):
    _timeline(**kwargs)
