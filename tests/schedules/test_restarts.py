"""SGDR: cosine with warm restarts."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loc_opt import schedules


def at(schedule, steps):
  return np.asarray(jax.jit(schedule)(jnp.asarray(steps, jnp.int32)))


def optax_sgdr(peak, periods, min_value, peak_decay=1.0):
  return optax.sgdr_schedule([
      dict(init_value=peak * peak_decay**i, peak_value=peak * peak_decay**i,
           warmup_steps=0, decay_steps=p, end_value=min_value)
      for i, p in enumerate(periods)])


@pytest.mark.parametrize('mult,periods', [(1.0, [7, 7, 7, 7]),
                                          (2.0, [5, 10, 20, 40]),
                                          (3.0, [4, 12, 36])])
def test_matches_optax_sgdr_on_its_cycles(mult, periods):
  s = schedules.cosine_restarts_schedule(
      2.0, periods[0], period_mult=mult, min_value=0.1, peak_decay=0.8)
  steps = np.arange(sum(periods))
  np.testing.assert_allclose(
      at(s, steps), at(optax_sgdr(2.0, periods, 0.1, 0.8), steps),
      rtol=1e-5, atol=1e-6)


def test_restarts_exactly_at_peak_and_within_bounds():
  s = schedules.cosine_restarts_schedule(1.0, 10, period_mult=2.0,
                                         min_value=0.05)
  starts = [0, 10, 30, 70, 150, 310, 630, 1270]
  v = at(s, np.arange(-3, 3000))[3:]
  assert np.all(v[starts] == np.float32(1.0))
  assert np.all((v >= 0.05) & (v <= 1.0))
  assert np.all(v[np.asarray(starts[1:]) - 1] < 0.1)
  # Monotone inside each cycle.
  for a, b in zip(starts, starts[1:]):
    assert np.all(np.diff(v[a:b]) < 0)


def test_warmup_then_cycles():
  s = schedules.cosine_restarts_schedule(1.0, 8, warmup_steps=4,
                                         init_value=0.2)
  v = at(s, [-1, 0, 2, 4, 8, 12, 16, 20])
  np.testing.assert_allclose(v, [0.2, 0.2, 0.6, 1.0, 0.5, 1.0, 0.5, 1.0],
                             atol=1e-6)


def test_errors():
  with pytest.raises(ValueError, match='period_mult'):
    schedules.cosine_restarts_schedule(1.0, 10, period_mult=0.5)
  with pytest.raises(ValueError, match='first_period'):
    schedules.cosine_restarts_schedule(1.0, 0)
  with pytest.raises(ValueError, match='peak_decay'):
    schedules.cosine_restarts_schedule(1.0, 10, peak_decay=0.0)
  with pytest.raises(ValueError, match='min_value'):
    schedules.cosine_restarts_schedule(1.0, 10, min_value=2.0)
