"""Convex-theory bound, optimal base rate and rate transfer."""

import functools

import numpy as np
import pytest

from loc_opt import schedules

T = 1000


@functools.cache
def shapes():
  make = {
      'constant': schedules.constant_schedule(1.0),
      'linear': schedules.linear_decay_schedule(1.0, T),
      'cosine': schedules.warmup_cosine_schedule(1.0, T),
      'wsd20': schedules.wsd_schedule(1.0, T, decay_steps=0.2),
  }
  return {k: schedules.schedule_shape(s, T, peak_value=1.0, floor=1e-3)
          for k, s in make.items()}


# Spec §5: T = 1000, D = G = 1, shapes floored at 1e-3.
TABLE = {
    'constant': (1000.0, 4.2422, 0.010860, 0.092110),
    'linear': (500.50, 1.0070, 0.031500, 0.063430),
    'cosine': (500.51, 1.0644, 0.030640, 0.065220),
    'wsd20': (900.50, 2.1255, 0.016160, 0.068710),
}


def sig(x, digits=4):
  return float(f'{x:.{digits - 1}e}')


def test_spec_table():
  got = {}
  for name, shape in shapes().items():
    s1, c = schedules.bound_constants(shape)
    gamma = schedules.theory_optimal_base_lr(shape)
    omega = schedules.theory_bound(shape)
    s1_t, c_t, gamma_t, omega_t = TABLE[name]
    assert round(s1, 2) == pytest.approx(s1_t)
    assert round(c, 4) == pytest.approx(c_t)
    assert sig(gamma) == pytest.approx(gamma_t)
    assert sig(omega) == pytest.approx(omega_t)
    got[name] = omega
  assert got['linear'] < got['cosine'] < got['wsd20'] < got['constant']


def brute_force_bound(s, gamma, D, G):
  """The spec B6 bound with eta_t = gamma s_t and ||g_t|| = G, O(T^2)."""
  eta = gamma * np.asarray(s)
  n = len(eta)
  total = (D**2 + np.sum(eta**2 * G**2)) / (2 * np.sum(eta))
  for k in range(n - 1):  # k = 1..T-1 in 1-based indices
    total += 0.5 * (eta[k] / np.sum(eta[k + 1:])) * (
        np.sum(eta[k:]**2 * G**2) / np.sum(eta[k:]))
  return total


@pytest.mark.parametrize('seed', [0, 1])
def test_against_brute_force(seed):
  s = np.random.default_rng(seed).uniform(0.05, 1.0, size=37)
  for gamma in (0.01, 0.3):
    np.testing.assert_allclose(
        schedules.theory_bound(s, D=2.0, G=3.0, base_lr=gamma),
        brute_force_bound(s, gamma, 2.0, 3.0), rtol=1e-12)
  gammas = np.geomspace(1e-3, 10, 4001)
  values = [brute_force_bound(s, g, 2.0, 3.0) for g in gammas[::40]]
  best = gammas[::40][int(np.argmin(values))]
  gamma_star = schedules.theory_optimal_base_lr(s, D=2.0, G=3.0)
  assert abs(np.log(best / gamma_star)) < 0.1
  np.testing.assert_allclose(
      schedules.theory_bound(s, 2.0, 3.0),
      schedules.theory_bound(s, 2.0, 3.0, base_lr=gamma_star), rtol=1e-12)


def test_transfer_and_zero_tail():
  sh = shapes()
  lr_cos = 3e-3
  lr_wsd = schedules.transfer_lr(lr_cos, sh['cosine'], sh['wsd20'])
  np.testing.assert_allclose(
      lr_wsd / lr_cos,
      schedules.theory_optimal_base_lr(sh['wsd20'])
      / schedules.theory_optimal_base_lr(sh['cosine']), rtol=1e-12)
  assert lr_wsd < lr_cos  # a longer high phase wants a smaller base rate
  # Trailing zeros do not move the iterate and are dropped.
  s = np.array([1.0, 0.5, 0.25])
  assert schedules.bound_constants(np.concatenate([s, [0, 0]])) == \
      schedules.bound_constants(s)
  with pytest.raises(ValueError, match='all zeros'):
    schedules.bound_constants(np.zeros(3))
  with pytest.raises(ValueError, match='>= 0'):
    schedules.bound_constants(np.array([1.0, -1.0]))
