"""WSD, linear decay, warmup-constant and WSD-S schedules."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loc_opt import schedules

SHAPES = sorted(schedules.DECAY_SHAPES)


def at(schedule, steps):
  """Values of ``schedule`` at ``steps``, computed under jax.jit."""
  return np.asarray(jax.jit(schedule)(jnp.asarray(steps, jnp.int32)))


@pytest.mark.parametrize('shape', SHAPES)
def test_wsd_boundaries_under_jit(shape):
  s = schedules.wsd_schedule(2.0, 100, warmup_steps=10, decay_steps=20,
                             init_value=0.5, end_value=0.1,
                             decay_shape=shape)
  v = at(s, [-5, 0, 5, 9, 10, 50, 79, 80, 81, 99, 100, 101, 10**6])
  assert v[0] == v[1] == np.float32(0.5)  # negative counts clamp to 0
  np.testing.assert_allclose(v[2], 1.25, rtol=1e-6)
  assert v[3] < 2.0
  assert v[4] == v[5] == v[6] == v[7] == np.float32(2.0)  # exact peak
  assert 0.1 < v[9] < v[8] < 2.0
  assert v[10] == v[11] == v[12] == np.float32(0.1)  # exactly end_value
  assert v.dtype == np.float32


@pytest.mark.parametrize('shape', SHAPES)
def test_wsd_decay_values_and_monotone(shape):
  total, decay = 50, 20
  s = schedules.wsd_schedule(1.0, total, warmup_steps=5, decay_steps=decay,
                             decay_shape=shape)
  v = at(s, np.arange(total + 1))
  assert np.all(np.diff(v[:5]) > 0)
  assert np.all(np.diff(v[5:]) <= 0)
  expect = {'linear': lambda u: 1 - u,
            'cosine': lambda u: 0.5 * (1 + np.cos(np.pi * u)),
            '1-sqrt': lambda u: 1 - np.sqrt(u),
            '1-square': lambda u: 1 - u * u}[shape]
  u = np.arange(decay + 1) / decay
  np.testing.assert_allclose(v[total - decay:], expect(u), atol=1e-6)


def test_wsd_1sqrt_is_not_optax_polynomial():
  # The pitfall of spec B1: polynomial(power=0.5) is sqrt(1 - s).
  s = schedules.wsd_schedule(1.0, 4, decay_steps=4, decay_shape='1-sqrt')
  poly = optax.polynomial_schedule(1.0, 0.0, 0.5, 4)
  np.testing.assert_allclose(at(s, [1]), [0.5], rtol=1e-6)
  np.testing.assert_allclose(at(poly, [1]), [np.sqrt(0.75)], rtol=1e-6)


def test_wsd_fractions_and_no_decay():
  s = schedules.wsd_schedule(1.0, 1000, warmup_steps=0.1, decay_steps=0.2)
  v = at(s, [99, 100, 800, 900, 1000])
  np.testing.assert_allclose(v, [0.99, 1.0, 1.0, 0.5, 0.0], rtol=1e-6)
  flat = schedules.wsd_schedule(1.0, 10, warmup_steps=2, decay_steps=0)
  np.testing.assert_array_equal(at(flat, [0, 1, 2, 10, 99]),
                                np.float32([0, 0.5, 1, 1, 1]))


def test_wsd_errors():
  with pytest.raises(ValueError, match='exceed total_steps'):
    schedules.wsd_schedule(1.0, 10, warmup_steps=5, decay_steps=6)
  with pytest.raises(ValueError, match='decay_steps'):
    schedules.wsd_schedule(1.0, 10, decay_steps=-1)
  with pytest.raises(ValueError, match='decay_steps as a fraction'):
    schedules.wsd_schedule(1.0, 10, decay_steps=1.5)
  with pytest.raises(ValueError, match="unknown decay_shape 'exp'"):
    schedules.wsd_schedule(1.0, 10, decay_steps=2, decay_shape='exp')
  with pytest.raises(ValueError, match='total_steps'):
    schedules.wsd_schedule(1.0, 0, decay_steps=0)


def test_linear_decay_matches_existing_warmup_linear():
  new = schedules.linear_decay_schedule(3.0, 40, warmup_steps=8,
                                        end_value=0.3)
  old = schedules.warmup_linear_schedule(3.0, 40, warmup_steps=8,
                                         end_value=0.3)
  steps = np.arange(-2, 45)
  np.testing.assert_allclose(at(new, steps), at(old, steps), rtol=1e-6)
  assert at(new, [40])[0] == np.float32(0.3)
  with pytest.raises(ValueError, match='below total_steps'):
    schedules.linear_decay_schedule(1.0, 10, warmup_steps=10)


def test_warmup_constant():
  s = schedules.warmup_constant_schedule(2.0, 100, warmup_steps=0.04,
                                         init_value=1.0)
  np.testing.assert_allclose(at(s, [-1, 0, 2, 4, 10**7]),
                             [1.0, 1.0, 1.5, 2.0, 2.0])


def test_wsds_single_point_equals_wsd():
  a = schedules.wsds_schedule(1.0, [60], 12, warmup_steps=6,
                              end_value=0.05, decay_shape='cosine')
  b = schedules.wsd_schedule(1.0, 60, warmup_steps=6, decay_steps=12,
                             end_value=0.05, decay_shape='cosine')
  steps = np.arange(-3, 70)
  # Two functions' programs: equal to float32 rounding.
  np.testing.assert_allclose(at(a, steps), at(b, steps), rtol=1e-6,
                             atol=1e-7)


def test_wsds_windows_and_resume():
  s = schedules.wsds_schedule(1.0, [100, 200, 400], 0.1, warmup_steps=10)
  v = at(s, np.arange(401))
  # Windows are 10% of each segment: [90, 100), [190, 200), [380, 400).
  assert v[10] == v[89] == v[90] == 1.0
  np.testing.assert_allclose(v[95], 0.5)
  assert v[99] < 0.11
  assert v[100] == 1.0  # resumes at the peak from the decayed weights
  assert v[189] == v[190] == 1.0 and v[199] < 0.11 and v[200] == 1.0
  np.testing.assert_allclose(v[390], 0.5)
  assert v[379] == v[380] == 1.0 and v[400] == 0.0
  assert np.all(v[:101] <= 1.0) and np.all(np.diff(v[90:100]) < 0)


def test_wsds_errors():
  with pytest.raises(ValueError, match='strictly increasing'):
    schedules.wsds_schedule(1.0, [100, 100], 10)
  with pytest.raises(ValueError, match='does not fit before decay point 105'):
    schedules.wsds_schedule(1.0, [100, 105], 10)
  with pytest.raises(ValueError, match='overlaps'):
    schedules.wsds_schedule(1.0, [10], 8, warmup_steps=5)
  with pytest.raises(ValueError, match='does not fit'):
    schedules.wsds_schedule(1.0, [5], 10)


def test_wsd_branch_of_constant_main_run():
  start, branch = schedules.wsds_branch(1.0, (), 20, 100, warmup_steps=10)
  assert start == 80
  wsd = schedules.wsd_schedule(1.0, 100, warmup_steps=10, decay_steps=20)
  steps = np.arange(-1, 110)
  # Other functions' programs: equal to float32 rounding.
  np.testing.assert_allclose(at(branch, steps), at(wsd, steps), rtol=1e-6,
                             atol=1e-7)
  main = schedules.wsds_schedule(1.0, (), 20, warmup_steps=10)
  np.testing.assert_allclose(at(main, steps[:82]), at(wsd, steps[:82]),
                             rtol=1e-6, atol=1e-7)
  assert at(main, [10**6])[0] == 1.0


def test_wsds_branch_off_a_wsds_run():
  kw = dict(warmup_steps=10, decay_shape='1-sqrt')
  main = schedules.wsds_schedule(1.0, [100, 200], 0.1, **kw)
  # A budget that is a decay point needs no branch.
  start, same = schedules.wsds_branch(1.0, [100, 200], 0.1, 100, **kw)
  assert start == 100
  # The main schedule itself (the same jaxpr): bit for bit.
  assert (str(jax.make_jaxpr(same)(jnp.arange(100)))
          == str(jax.make_jaxpr(main)(jnp.arange(100))))
  np.testing.assert_array_equal(at(same, np.arange(100)),
                                at(main, np.arange(100)))
  # Budget 150: segment [100, 150), 10% gives a 5-step decay from 145.
  start, branch = schedules.wsds_branch(1.0, [100, 200], 0.1, 150, **kw)
  assert start == 145
  v, m = at(branch, np.arange(160)), at(main, np.arange(160))
  # The branch's program around the main schedule's: to float32 rounding.
  np.testing.assert_allclose(v[:145], m[:145], rtol=1e-6, atol=1e-7)
  assert v[145] == 1.0 and v[149] < 0.2 and v[150] == 0.0
  # Budget 195 with 15-step decays: the branch starts at 180, before the
  # main run's window [185, 200), at the peak.
  start, branch = schedules.wsds_branch(1.0, [100, 200], 15, 195, **kw)
  assert start == 180 and at(main, [180])[0] == 1.0
  with pytest.raises(ValueError, match='does not fit'):
    schedules.wsds_branch(1.0, [100, 200], 15, 110, **kw)
  with pytest.raises(ValueError, match='past the last decay point'):
    schedules.wsds_branch(1.0, [100, 200], 0.1, 250, **kw)
  with pytest.raises(ValueError, match='inside the warmup'):
    schedules.wsds_branch(1.0, (), 20, 25, **kw)
