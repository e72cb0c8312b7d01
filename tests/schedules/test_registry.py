"""The SCHEDULES registry, make_schedule, exports and docstring examples."""

import doctest
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loc_opt import schedules

T = 200


@pytest.mark.parametrize('name,kwargs', [
    ('constant', {}),
    ('warmup_linear', dict(warmup_steps=0.1)),
    ('warmup_cosine', dict(warmup_steps=20, end_value=0.0)),
    ('warmup_constant', dict(warmup_steps=20)),
    ('linear_decay', dict(warmup_steps=20)),
    ('wsd', dict(warmup_steps=20, decay_steps=0.2, decay_shape='1-sqrt')),
    ('wsds', dict(warmup_steps=20, decay_points=[0.5, 1.0],
                  decay_steps=0.2)),
    ('cosine_restarts', dict(first_period=0.25, warmup_steps=20,
                             period_mult=1.0)),
])
def test_every_name_builds_and_jits(name, kwargs):
  s = schedules.make_schedule(name, 0.5, T, **kwargs)
  v = np.asarray(jax.jit(s)(jnp.arange(-1, T + 2)))
  assert v.shape == (T + 3,) and np.all(np.isfinite(v))
  assert v.max() == np.float32(0.5) and v.min() >= 0.0
  if name not in ('constant', 'warmup_constant', 'cosine_restarts'):
    assert v[T + 1] == v[T + 2] == 0.0  # count T: exactly end_value
  if 'warmup_steps' in kwargs and name != 'warmup_linear':
    assert v[0 + 1] == 0.0 and v[20 + 1] == np.float32(0.5)


def test_registry_covers_the_schedules():
  assert set(schedules.SCHEDULES) == {
      'constant', 'warmup_linear', 'warmup_cosine', 'warmup_constant',
      'linear_decay', 'wsd', 'wsds', 'cosine_restarts'}


def test_wsds_by_name_decays_at_each_point():
  s = schedules.make_schedule('wsds', 1.0, T, decay_points=[100, 200],
                              decay_steps=10)
  v = np.asarray(jax.jit(s)(jnp.arange(T + 1)))
  assert v[99] < 0.2 and v[100] == 1.0 and v[200] == 0.0
  with pytest.raises(ValueError, match='must be total_steps=200'):
    schedules.make_schedule('wsds', 1.0, T, decay_points=[100],
                            decay_steps=10)


def test_errors_name_the_config_fields():
  with pytest.raises(ValueError, match=r"unknown schedule 'wsdd' \(field "
                     r'optimizer.schedule\)'):
    schedules.make_schedule('wsdd', 1.0, T)
  with pytest.raises(ValueError, match='optimizer.schedule_kwargs'):
    schedules.make_schedule('wsd', 1.0, T)  # decay_steps missing
  with pytest.raises(ValueError, match='optimizer.schedule_kwargs'):
    schedules.make_schedule('constant', 1.0, T, warmup_steps=3)
  with pytest.raises(ValueError, match='exceed total_steps'):
    schedules.make_schedule('wsd', 1.0, T, warmup_steps=0.5,
                            decay_steps=0.6)


MODULES = ['base', 'convex', 'refinement', 'restarts', 'schedule_free',
           'sync', 'wsd', 'wsm']


@pytest.mark.parametrize('module', MODULES)
def test_docstring_examples(module):
  mod = importlib.import_module(f'loc_opt.schedules.{module}')
  result = doctest.testmod(mod, extraglobs={'jax': jax, 'np': np, 'jnp': jnp},
                           optionflags=doctest.ELLIPSIS)
  assert result.failed == 0
