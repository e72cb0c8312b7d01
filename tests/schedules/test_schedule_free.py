"""Schedule-free optimizers by name, their warmup and eval weights."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import schedules


def f(x):
  return jnp.sum(x**2)


def run(solver, steps, params=None):
  """Steps ``solver`` on f; returns f at the eval params after each step."""
  params = jnp.array([1.0, 2.0, 3.0]) if params is None else params
  state = solver.init(params)

  def step(carry, _):
    params, state = carry
    updates, state = solver.update(jax.grad(f)(params), state, params)
    params = optax.apply_updates(params, updates)
    return (params, state), f(schedules.schedule_free_eval_params(state,
                                                                   params))

  (params, state), out = jax.jit(
      lambda c: jax.lax.scan(step, c, length=steps))((params, state))
  return [float(v) for v in out], params, state


def test_optax_doctest_values():
  # Spec §5: the optax.contrib.schedule_free_sgd docstring (optax 0.2.8).
  expect = ['1.40E+01', '1.75E-14', '9.96E-01', '8.06E-01', '2.41E-01']
  ref, _, _ = run(optax.contrib.schedule_free_sgd(), 5)
  ours, _, _ = run(schedules.schedule_free_optimizer('sgd', 1.0), 5)
  for values in (ref, ours):
    got = [f'{v:.2E}' for v in values]
    assert [got[0]] + got[2:] == [expect[0]] + expect[2:]
    assert values[1] < 1e-10  # 1.75E-14 is rounding noise around 0
  np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-12)


def test_uniform_average_without_warmup():
  solver = schedules.schedule_free_optimizer('sgd', 0.1, b1=0.9)

  @jax.jit
  def step(params, state):
    updates, state = solver.update(jax.grad(f)(params), state, params)
    params = optax.apply_updates(params, updates)
    return params, state, schedules.schedule_free_eval_params(state, params)

  params = jnp.array([1.0, -2.0])
  state = solver.init(params)
  zs = []
  for _ in range(6):
    params, state, x = step(params, state)
    zs.append(state.z)
    np.testing.assert_allclose(x, np.mean(zs, axis=0), rtol=1e-5, atol=1e-6)


def test_reference_warmup_and_matching_rates():
  # The update at count t uses lr * min(1, (t + 1) / W) in the base step and
  # in the averaging weights alike.
  w, lr = 4, 0.5
  solver = schedules.schedule_free_optimizer('sgd', lr, warmup_steps=w)
  params = jnp.array([1.0, 2.0])
  state = solver.init(params)

  @jax.jit
  def step(params, state):
    g = jax.grad(f)(params)
    updates, state = solver.update(g, state, params)
    return optax.apply_updates(params, updates), state, g

  for t in range(6):
    z_before = state.z
    params, state, g = step(params, state)
    rate = lr * min(1.0, (t + 1) / w)
    np.testing.assert_allclose(state.z, z_before - rate * g, rtol=1e-6)
    np.testing.assert_allclose(state.max_lr, rate, rtol=1e-6)
  s = jax.jit(schedules.schedule_free_warmup(lr, w))
  np.testing.assert_allclose(s(jnp.arange(-1, 6)),
                             [.125, .125, .25, .375, .5, .5, .5], rtol=1e-6)


def test_adamw_and_nested_state():
  # As loc_opt.inner.make_optimizer would build it: every numeric argument
  # injected (traced), the rate a schedule evaluated by inject_hyperparams.
  factory = schedules.SCHEDULE_FREE_OPTIMIZERS['adamw']
  kw = dict(warmup_steps=3, weight_decay=0.01, b2=0.99)
  injected = optax.inject_hyperparams(factory)(
      learning_rate=optax.constant_schedule(0.05), **kw)
  direct = factory(0.05, **kw)
  np.testing.assert_allclose(run(injected, 30)[0], run(direct, 30)[0],
                             rtol=1e-5)
  wrapped = optax.chain(optax.clip_by_global_norm(1.0), injected)
  values, params, state = run(wrapped, 30)
  assert values[-1] < 0.5 * values[0]
  assert float(state[1].inner_state.max_lr) == pytest.approx(0.05)
  sf = schedules.find_schedule_free_state(state)
  assert isinstance(sf, optax.contrib.ScheduleFreeState)
  np.testing.assert_allclose(
      schedules.schedule_free_eval_params(state, params),
      optax.contrib.schedule_free_eval_params(sf, params), rtol=1e-6)
  # Inside diloco the state sits in inner_state.
  dl = loc_opt.diloco(direct, sync_every=4, axis_name=None)
  x = jax.eval_shape(
      lambda p: schedules.schedule_free_eval_params(dl.init(p), p),
      jax.ShapeDtypeStruct((3,), jnp.bfloat16))
  assert x.dtype == jnp.bfloat16


def test_errors():
  with pytest.raises(ValueError, match='unknown schedule-free'):
    schedules.schedule_free_optimizer('lion', 1.0)
  with pytest.raises(ValueError, match='not both'):
    schedules.schedule_free_optimizer(
        'sgd', optax.constant_schedule(1.0), warmup_steps=10)
  with pytest.raises(ValueError, match='bad arguments'):
    schedules.schedule_free_optimizer('sgd', 1.0, b2=0.9)
  with pytest.raises(ValueError, match='found 0'):
    schedules.schedule_free_eval_params(optax.sgd(1.0).init(jnp.ones(2)),
                                        jnp.ones(2))
