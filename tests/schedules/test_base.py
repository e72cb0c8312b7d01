import jax
import numpy as np
import pytest

from loc_opt import schedules


def test_warmup_cosine_boundaries_under_jit():
  s = jax.jit(schedules.warmup_cosine_schedule(1.0, 100, warmup_steps=10,
                                               end_value=0.1))
  assert float(s(0)) == 0.0
  np.testing.assert_allclose(float(s(10)), 1.0, rtol=1e-6)
  np.testing.assert_allclose(float(s(55)), 0.55, rtol=1e-5)
  assert s(100) == np.float32(0.1)
  assert s(1000) == np.float32(0.1)


def test_warmup_linear_ends_exactly_at_end_value():
  s = jax.jit(schedules.warmup_linear_schedule(1.0, 20, warmup_steps=0.25))
  np.testing.assert_allclose(float(s(5)), 1.0)
  np.testing.assert_allclose(float(s(10)), 2 / 3, rtol=1e-6)
  assert float(s(20)) == 0.0
  assert float(s(25)) == 0.0


def test_fraction_helper():
  assert schedules.steps_from_fraction(0.1, 250) == 25
  assert schedules.steps_from_fraction(30, 250) == 30
  with pytest.raises(ValueError, match='warmup'):
    schedules.steps_from_fraction(1.5, 10, field='warmup')


def test_registry_unknown_name():
  with pytest.raises(ValueError, match='optimizer.schedule'):
    schedules.make_schedule('nope', 1.0, 10)
  assert float(schedules.make_schedule('constant', 0.3, 10)(7)) == \
      pytest.approx(0.3)
