"""Schedule refinement from gradient norms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loc_opt import schedules


def test_constant_norms_give_linear_decay():
  eta = schedules.refined_schedule(np.full(10, 3.0))
  np.testing.assert_allclose(eta, np.arange(9, -1, -1) / 9, atol=1e-15)
  eta = schedules.refined_schedule(np.full(10, 3.0), kind='adam', tau=0.3,
                                   peak_value=2.0)
  np.testing.assert_allclose(eta, 2 * np.arange(9, -1, -1) / 9, atol=1e-15)


def test_formula_on_varying_norms():
  g = np.array([4.0, 2.0, 1.0, 1.0, 2.0])
  w = g**-2.0
  expect = np.array([w[t] * w[t + 1:].sum() for t in range(5)])
  np.testing.assert_allclose(schedules.refined_schedule(g),
                             expect / expect.max(), rtol=1e-12)
  # Large early norms give an automatic warmup.
  eta = schedules.refined_schedule(g)
  assert eta[0] < eta[1] < eta[2]
  w = 1 / g
  expect = np.array([w[t] * w[t + 1:].sum() for t in range(5)])
  np.testing.assert_allclose(schedules.refined_schedule(g, kind='adam'),
                             expect / expect.max(), rtol=1e-12)


def test_median_filter_removes_spikes():
  g = np.ones(20)
  g[7] = 100.0
  np.testing.assert_array_equal(schedules.median_filter(g, 3), np.ones(20))
  np.testing.assert_array_equal(schedules.median_filter(g, 1), g)
  smooth = schedules.refined_schedule(g, tau=0.15)  # width 3
  np.testing.assert_allclose(smooth, np.arange(19, -1, -1) / 19, atol=1e-15)


def test_schedule_from_array_under_jit():
  s = jax.jit(schedules.schedule_from_array(np.array([1.0, 0.5, 0.0]), 4.0))
  np.testing.assert_array_equal(s(jnp.arange(-2, 6)),
                                np.float32([4, 4, 4, 2, 0, 0, 0, 0]))


def test_errors():
  with pytest.raises(ValueError, match='kind'):
    schedules.refined_schedule(np.ones(4), kind='lion')
  with pytest.raises(ValueError, match='positive'):
    schedules.refined_schedule(np.array([1.0, 0.0, 1.0]))
  with pytest.raises(ValueError, match='>= 2'):
    schedules.refined_schedule(np.ones(1))
  with pytest.raises(ValueError, match='tau'):
    schedules.refined_schedule(np.ones(4), tau=2.0)
