"""The goodput simulator: closed forms, a hand-worked trace, orderings."""

import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from loc_opt import outer
from loc_opt.parallel import goodput

HOUR = 3600.0
NO_FAILURES = goodput.Assumptions(mtbi_s=1e30)


@pytest.mark.parametrize('policy', sorted(goodput.POLICIES))
def test_goodput_is_one_without_failures(policy):
  r = goodput.simulate(policy, 4096, 4, NO_FAILURES, horizon_s=HOUR)
  assert r.failures == 0
  assert r.goodput == pytest.approx(1.0)
  assert r.uptime == pytest.approx(1.0)


@pytest.mark.parametrize('overlap, closed_form', [
    ('fold', lambda x: 1 / (1 + x)),  # renewal: run ~ Exp(rate), then R
    ('extend', lambda x: math.exp(-x)),  # uncovered by Poisson intervals
])
def test_non_elastic_dp_matches_the_closed_form(overlap, closed_form):
  a = goodput.Assumptions(restart_s=60.0, overlap=overlap)
  n = 600_000
  r = goodput.simulate('dp', n, assumptions=a, horizon_s=30 * goodput.DAY_S)
  expected = closed_form(n / a.mtbi_s * a.restart_s)
  assert r.goodput == pytest.approx(expected, abs=0.01)
  assert r.uptime == pytest.approx(r.goodput)  # nothing rolled back


def test_checkpoint_loss_matches_the_closed_form():
  # A run X ~ Exp(rate) keeps C floor(X / C): E = C q / (1 - q), q = e^-rC.
  a = goodput.Assumptions(restart_s=30.0, checkpoint_every_s=20.0)
  n = 300_000
  rate = n / a.mtbi_s
  q = math.exp(-rate * a.checkpoint_every_s)
  kept = a.checkpoint_every_s * q / (1 - q)
  expected = kept / (1 / rate + a.restart_s)
  r = goodput.simulate('dp', n, assumptions=a, horizon_s=30 * goodput.DAY_S)
  assert r.goodput == pytest.approx(expected, abs=0.01)
  assert r.uptime == pytest.approx(1 / (1 + rate * a.restart_s), abs=0.01)
  assert r.goodput < r.uptime - 0.05


def test_elastic_matches_the_closed_form():
  # One-chip slices back at once and free upscales: only downscales cost.
  a = goodput.Assumptions(slice_size=1, recovery_s=0.0, downscale_s=20.0,
                          upscale_s=0.0)
  n = 800_000
  horizon = 10 * goodput.DAY_S
  rate = n / a.mtbi_s
  r = goodput.simulate('elastic_dp', n, assumptions=a, horizon_s=horizon)
  assert r.goodput == pytest.approx(1 / (1 + rate * a.downscale_s), abs=0.01)
  d = goodput.simulate('decoupled', n, 8, a, horizon_s=horizon)
  assert d.goodput == pytest.approx(1 / (1 + rate / 8 * a.downscale_s),
                                    abs=0.005)


def test_decoupled_with_one_learner_is_elastic_dp():
  a = goodput.Assumptions()
  elastic = goodput.simulate('elastic_dp', 300_000, 8, a, seed=3)
  assert elastic == goodput.simulate('elastic_dp', 300_000, 1, a, seed=3)
  assert goodput.simulate('decoupled', 300_000, 1, a, seed=3) == elastic


def test_diloco_on_a_hand_worked_trace():
  # 2 learners x 2 chips, one slice of 1 chip fails at t = 10 on learner 0
  # and stays down; 5 s downscale; barriers every 24 one-second steps; 48 s.
  # Round 1: learner 0 runs 0-10 on 2 chips, pauses to 15, runs 15-29 on 1;
  # learner 1 runs 0-24 on 2 and waits to 29. Round 2: 29-48 (horizon).
  a = goodput.Assumptions(slice_size=1, recovery_s=1e9, downscale_s=5.0,
                          step_s=1.0, sync_every=24)
  run = goodput.POLICIES['diloco']
  useful, advancing = run(np.array([10.0]), np.array([0]), 4, 2, a, 48.0)
  assert useful == pytest.approx(10 * 2 + 14 + 24 * 2 + 19 + 19 * 2)
  assert advancing == pytest.approx(48.0)  # someone always steps
  # 2 s of blocking sync: everyone idles 29-31, round 2 runs 31-48.
  a = goodput.Assumptions(slice_size=1, recovery_s=1e9, downscale_s=5.0,
                          sync_s=2.0)
  useful, advancing = run(np.array([10.0]), np.array([0]), 4, 2, a, 48.0)
  assert useful == pytest.approx(10 * 2 + 14 + 24 * 2 + 17 + 17 * 2)
  assert advancing == pytest.approx(46.0)
  # Decoupled on the same trace: nobody waits.
  useful, advancing = goodput.POLICIES['decoupled'](
      np.array([10.0]), np.array([0]), 4, 2, a, 48.0)
  assert useful == pytest.approx(10 * 2 + 33 + 48 * 2)
  assert advancing == pytest.approx(48.0)


def test_orderings_on_a_fixed_seed():
  n, horizon = 1_200_000, goodput.DAY_S
  g = {p: goodput.simulate(p, n, 4, horizon_s=horizon, seed=1)
       for p in goodput.POLICIES}
  assert (g['decoupled'].goodput > g['diloco'].goodput
          > g['elastic_dp'].goodput > g['dp'].goodput)
  assert g['decoupled'].uptime > g['diloco'].uptime > g['dp'].uptime
  more = goodput.simulate('decoupled', n, 16, horizon_s=horizon, seed=1)
  assert more.goodput > g['decoupled'].goodput


@pytest.mark.parametrize('num_learners', [4, 8])
def test_rule_of_thumb(num_learners):
  # M learners on N chips ~ elastic DP on N / M chips, within 1.5 points
  # (the model makes it exact in expectation; this is Monte Carlo noise).
  n, horizon = 1_200_000, 7 * goodput.DAY_S
  d = goodput.simulate('decoupled', n, num_learners, horizon_s=horizon)
  e = goodput.simulate('elastic_dp', n // num_learners, horizon_s=horizon,
                       seed=1)
  assert d.goodput == pytest.approx(e.goodput, abs=0.015)


def test_same_seed_same_result():
  a = goodput.Assumptions(checkpoint_every_s=30.0)
  for policy in goodput.POLICIES:
    first = goodput.simulate(policy, 600_000, 4, a, horizon_s=HOUR, seed=7)
    assert first == goodput.simulate(policy, 600_000, 4, a, horizon_s=HOUR,
                                     seed=7)
    assert first != goodput.simulate(policy, 600_000, 4, a, horizon_s=HOUR,
                                     seed=8)


@pytest.mark.parametrize('kwargs, match', [
    ({'num_chips': 4, 'num_learners': 8}, 'num_learners'),
    ({'num_chips': 1000, 'num_learners': 3}, 'num_learners'),
    ({'num_chips': 0}, 'num_chips'),
    ({'num_learners': 0}, 'num_learners'),
    ({'horizon_s': -1.0}, 'horizon_s'),
    ({'seed': -1}, 'seed'),
    ({'policy': 'async'}, 'policy'),
    ({'num_chips': 256, 'num_learners': 8}, 'slice_size'),
])
def test_bad_arguments_name_the_field(kwargs, match):
  args = {'policy': 'decoupled', 'num_chips': 4096, 'num_learners': 4,
          'horizon_s': HOUR, 'seed': 0}
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    goodput.simulate(**args)


@pytest.mark.parametrize('field, value', [
    ('mtbi_s', 0.0), ('slice_size', 0), ('recovery_s', -1.0),
    ('restart_s', -1.0), ('checkpoint_every_s', -1.0),
    ('downscale_s', -1.0), ('upscale_s', -1.0), ('step_s', 0.0),
    ('sync_every', 0), ('sync_s', -1.0), ('overlap', 'merge'),
])
def test_bad_assumptions_name_the_field(field, value):
  with pytest.raises(ValueError, match=field):
    goodput.Assumptions(**{field: value})


# ------------------------------------------- measured on the timeline ---
def test_timeline_goodput_accounts_for_every_learner_tick():
  trace = outer.chaos_failures(3, 600, mtbf=80., downtime=10., seed=1)
  t = outer.decoupled_timeline(600, num_learners=3, sync_every=6,
                               num_fragments=3, quorum=1, grace=.2,
                               failures=trace)
  g = outer.timeline_goodput(t)
  busy = t.active.mean()
  assert g.goodput + g.discarded + g.lost_rejoin + g.in_flight == \
      pytest.approx(busy)
  assert busy + g.idle + g.down == pytest.approx(1.)
  assert g.lost_rejoin > 0 and g.down > 0 and g.merges == len(t.rounds)


def test_timeline_goodput_without_failures_loses_the_overlap_step():
  # Every fragment merges on the tick its window opens and arrives one
  # tick later (sync_steps = 1): that tick's step on the fragment is
  # overwritten (alpha = 0), 1 of every H steps; nothing else is lost.
  t = outer.decoupled_timeline(400, num_learners=2, sync_every=4,
                               num_fragments=4, grace=0.)
  g = outer.timeline_goodput(t)
  assert g.down == 0 and g.lost_rejoin == 0 and g.skipped == 0
  assert g.discarded == pytest.approx(1 / 4, abs=0.01)
  assert g.goodput == pytest.approx(3 / 4, abs=0.01)
  # a learner never admitted (too slow to report before the deadline)
  # has all its work overwritten
  slow = outer.timeline_goodput(outer.decoupled_timeline(
      400, num_learners=2, sync_every=4, num_fragments=4, grace=0.,
      speeds=(1., .5)))
  assert slow.goodput < g.goodput and slow.mean_admitted < 2


@pytest.mark.parametrize('num_learners', [2, 8])
def test_measured_goodput_is_below_the_renewal_upper_bound(num_learners):
  a = goodput.Assumptions(downscale_s=10., upscale_s=10.)
  bound = goodput.simulate('decoupled', 1_200_000, num_learners, a).goodput
  got = outer.simulate_timeline(1_200_000, num_learners, a,
                                  num_steps=4000, sync_every=8,
                                  num_fragments=8)
  # merges overwrite some work and rejoins lose some: the renewal model,
  # which counts every live step, is above by more than its noise
  assert got.goodput < bound - 0.02, (got, bound)
  assert got.discarded + got.lost_rejoin > 0.02
  assert abs(got.down - (1 - bound)) < 0.03  # the same failure rate


def test_goodput_experiment_prints_without_a_workdir_or_matplotlib(
    tmp_path):
  # A subprocess: the program's absl flags (--workdir, ...) would collide
  # with other programs' in this test process.
  figure = tmp_path / 'goodput.png'
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.goodput', '--chips=150000,300000',
       '--learners=1,4', '--nofit', '--horizon_days=1',
       '--timeline_steps=500', f'--figure={figure}'],
      cwd=pathlib.Path(__file__).resolve().parents[2], capture_output=True,
      text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = proc.stdout
  assert 'measured on its driver\'s timeline' in out
  assert '| 4 | 150k |' in out and 'nothing written' in out
  assert not list(tmp_path.glob('*.md'))
  try:
    import matplotlib  # noqa: F401
    assert figure.exists()
  except ImportError:
    assert f'matplotlib is not installed: figure {figure} skipped' in out


def test_restarts_on_a_given_trace():
  # Stops at 10 and 15, back at 20 and 18, 5 s to restart: one pause
  # [10, 25). The run [0, 10) keeps 8 s (checkpoints every 4 s), the last
  # run [25, 100) all of its 75.
  kept, ran = goodput.restarts_on_trace([10., 15.], [20., 18.], 100.,
                                        restart_s=5., checkpoint_every_s=4.)
  assert (kept, ran) == (83., 85.)
  assert goodput.restarts_on_trace([], [], 100., restart_s=5.,
                                   checkpoint_every_s=4.) == (100., 100.)
  with pytest.raises(ValueError, match='back'):
    goodput.restarts_on_trace([10.], [5.], 100., restart_s=1.,
                              checkpoint_every_s=0.)
