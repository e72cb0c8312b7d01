"""The staleness options of an asynchronous syncer's outer step
(``loc_opt.outer.staleness``), checked against their stated formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loc_opt.outer import staleness
from tests import optax_conformance as conf


def _nesterov():
  return optax.sgd(0.7, momentum=0.9, nesterov=True)


def _step(tx, updates, state, params, age):
  return jax.jit(tx.update)(updates, state, params, age=jnp.float32(age))


@pytest.mark.parametrize('age, power', [(0., 0.5), (3., 0.5), (7., 1.),
                                        (5., 0.)])
def test_scale_by_age_is_the_stated_power(age, power):
  tx = staleness.scale_by_age(power)
  u = {'w': jnp.array([1., -2., 4.])}
  out, state = _step(tx, u, tx.init(u), None, age)
  want = (1 + age) ** -power
  np.testing.assert_allclose(out['w'], want * u['w'], rtol=1e-6)
  np.testing.assert_allclose(state.last_factor, want, rtol=1e-6)


def test_correction_removes_the_stated_part_along_the_momentum():
  tx = staleness.stale_momentum_correction(_nesterov(), strength=1.0)
  params = {'w': jnp.zeros(2)}
  state = tx.init(params)
  # one fresh step leaves the momentum buffer m = (1, 0)
  _, state = _step(tx, {'w': jnp.array([1., 0.])}, state, params, 0.)
  m = np.array([1., 0.])
  u = np.array([2., 3.])
  for age in (0., 1., 3.):
    got, _ = _step(tx, {'w': jnp.asarray(u)}, state, params, age)
    corrected = u - age / (1 + age) * (u @ m) / (m @ m) * m
    want, _ = _nesterov().update({'w': jnp.asarray(corrected)}, state,
                                 params)
    np.testing.assert_allclose(got['w'], want['w'], rtol=1e-6)
  # a delta opposed to the momentum is left alone
  got, _ = _step(tx, {'w': jnp.array([-1., 1.])}, state, params, 5.)
  want, _ = _nesterov().update({'w': jnp.array([-1., 1.])}, state, params)
  np.testing.assert_allclose(got['w'], want['w'], rtol=1e-6)


def test_correction_needs_a_momentum_buffer():
  with pytest.raises(ValueError, match='momentum buffer'):
    staleness.stale_momentum_correction(optax.sgd(0.7)).init(
        {'w': jnp.zeros(2)})
  with pytest.raises(ValueError, match='strength'):
    staleness.stale_momentum_correction(_nesterov(), strength=2.)


def test_momentum_restarts_zero_the_momentum_every_period():
  every = 3
  tx = staleness.momentum_restarts(_nesterov(), every)
  params = {'w': jnp.zeros(2)}
  state, ref_state = tx.init(params), _nesterov().init(params)
  g = {'w': jnp.array([1., 2.])}
  for k in range(7):
    if k and k % every == 0:
      ref_state = _nesterov().init(params)  # the stated restart
    got, state = _step(tx, g, state, params, 0.)
    want, ref_state = _nesterov().update(g, ref_state, params)
    np.testing.assert_allclose(got['w'], want['w'], rtol=1e-6)
  assert int(state.restarts) == 2 and int(state.count) == 7
  with pytest.raises(ValueError, match='every'):
    staleness.momentum_restarts(_nesterov(), 0)
  with pytest.raises(ValueError, match='params'):
    tx.update(g, state, None)


def test_all_options_off_is_the_outer_optimizer():
  tx = staleness.staleness_outer(_nesterov())
  params = {'w': jnp.ones(3)}
  g = {'w': jnp.array([1., -1., .5])}
  got, _ = _step(tx, g, tx.init(params), params, 4.)
  want, _ = _nesterov().update(g, _nesterov().init(params), params)
  np.testing.assert_allclose(got['w'], want['w'], rtol=1e-6)


@pytest.mark.parametrize('kwargs', [
    {'age_power': 0.5}, {'correction': 0.5}, {'restart_every': 2},
    {'age_power': 0.5, 'correction': 1., 'restart_every': 3}])
def test_options_pass_the_conformance_suite(kwargs, tmp_path):
  def make(learning_rate):
    return staleness.staleness_outer(
        optax.sgd(learning_rate, momentum=0.9, nesterov=True), **kwargs)
  conf.check_no_recompile(make)
  conf.check_jit_matches_eager(make)
  conf.check_all(make, tmp_path)
