"""Tests of loc_opt.inner.multi_timescale (MT-DAO's inner optimizer)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loc_opt.inner import multi_timescale as mt
from tests import optax_conformance as conf


def test_conformance(tmp_path):
  conf.check_all(mt.multi_timescale_adam, tmp_path)


def updates_of(tx, steps, params=None):
  """The updates of ``tx`` over ``steps`` random gradients at fixed params."""
  params = conf.example_params() if params is None else params
  state = tx.init(params)
  update = jax.jit(tx.update)
  out = []
  for i in range(steps):
    u, state = update(conf.example_grads(params, i), state, params)
    out.append(u)
  return out, state


@pytest.mark.parametrize('weight_decay', [0.0, 0.1])
def test_one_slow_momentum_with_weight_one_is_adam(weight_decay):
  tx = mt.multi_timescale_adam(1e-2, slow_betas=(0.9,), slow_weights=(1.0,),
                               b2=0.99, weight_decay=weight_decay)
  if weight_decay:
    want_tx = optax.adamw(1e-2, b1=0.9, b2=0.99, weight_decay=weight_decay)
  else:
    want_tx = optax.adam(1e-2, b1=0.9, b2=0.99)
  params = conf.example_params()
  p1, s1 = conf.run(tx, params, 8)
  p2, s2 = conf.run(want_tx, params, 8)
  # Two transforms' programs (the same formulas, other operations around
  # them): equal to float32 rounding, bit for bit on some CPUs.
  conf.assert_trees_close(p1, p2, rtol=1e-6, atol=1e-7)
  conf.assert_trees_close(s1[0].slow[0], s2[0].mu, rtol=1e-6, atol=1e-8)
  conf.assert_trees_close(s1[0].nu, s2[0].nu, rtol=1e-6, atol=1e-10)
  # Another slow beta is another optimizer: the check bites.
  other, _ = conf.run(mt.multi_timescale_adam(
      1e-2, slow_betas=(0.8,), slow_weights=(1.0,), b2=0.99,
      weight_decay=weight_decay), params, 8)
  assert not all(np.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(
      jax.tree.leaves(other), jax.tree.leaves(p1)))


def test_zero_weights_are_rmsprop_with_bias_corrected_nu():
  b2, eps, lr = 0.95, 1e-8, 0.1
  tx = mt.multi_timescale_adam(lr, slow_betas=(0.99,), slow_weights=(0.0,),
                               b2=b2, eps=eps)
  got, _ = updates_of(tx, 5)
  params = conf.example_params()
  nu = jax.tree.map(lambda p: np.zeros(p.shape, np.float32), params)
  for t in range(1, 6):
    g = jax.tree.map(np.asarray, conf.example_grads(params, t - 1))
    nu = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * x * x, nu, g)
    want = jax.tree.map(
        lambda x, v: -lr * x / (np.sqrt(v / (1 - b2**t)) + eps), g, nu)
    conf.assert_trees_close(got[t - 1], want, rtol=2e-6, atol=1e-7)


def test_two_slow_momenta_match_numpy_reference():
  betas, weights, b2, eps = (0.5, 0.9), (0.3, 0.5), 0.9, 1e-8
  tx = mt.scale_by_multi_timescale(betas, weights, b2, eps)
  got, state = updates_of(tx, 6)
  params = conf.example_params()
  us = [jax.tree.map(lambda p: np.zeros(p.shape, np.float32), params)
        for _ in betas]
  nu = jax.tree.map(lambda p: np.zeros(p.shape, np.float32), params)
  for t in range(1, 7):
    g = jax.tree.map(np.asarray, conf.example_grads(params, t - 1))
    us = [jax.tree.map(lambda u, x, b=b: b * u + (1 - b) * x, u, g)
          for u, b in zip(us, betas)]
    nu = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * x * x, nu, g)

    def d(x, v, u0, u1, t=t):
      num = (0.2 * x + weights[0] * u0 / (1 - betas[0]**t)
             + weights[1] * u1 / (1 - betas[1]**t))
      return num / (np.sqrt(v / (1 - b2**t)) + eps)

    want = jax.tree.map(d, g, nu, *us)
    conf.assert_trees_close(got[t - 1], want, rtol=2e-5, atol=1e-6)
  assert len(state.slow) == 2
  assert int(state.count) == 6


def test_constant_gradient_gives_sign_for_any_weights():
  # Bias-corrected moments of a constant gradient are exact: u_hat = g and
  # v_hat = g^2, so d = g / |g| whatever the weights.
  tx = mt.scale_by_multi_timescale((0.99, 0.999), (0.4, 0.9), 0.999, eps=0.0)
  g = {'w': jnp.array([2.0, -0.5, 3.0])}
  state = tx.init(g)
  for _ in range(4):
    u, state = tx.update(g, state)
    np.testing.assert_allclose(u['w'], [1.0, -1.0, 1.0], rtol=1e-5)


def test_mu_dtype_sets_slow_momenta_dtype():
  tx = mt.scale_by_multi_timescale(mu_dtype=jnp.bfloat16)
  state = tx.init(conf.example_params())
  assert state.slow[0]['w'].dtype == jnp.bfloat16
  assert state.nu['w'].dtype == jnp.float32
  _, state = tx.update(conf.example_grads(conf.example_params(), 0), state)
  assert state.slow[0]['w'].dtype == jnp.bfloat16


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match='slow_weights'):
    mt.scale_by_multi_timescale((0.9, 0.99), (0.5,))
  with pytest.raises(ValueError, match='slow_betas'):
    mt.scale_by_multi_timescale((1.0,), (0.5,))
