"""Tests of SWAN (loc_opt.inner.swan)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import parallel
from loc_opt.inner.swan import scale_by_swan
from loc_opt.inner.swan import swan
from tests import optax_conformance as conf
from tests.inner import _helpers as helpers


def test_conformance(tmp_path):
  conf.check_all(lambda learning_rate: swan(learning_rate), tmp_path)


def test_every_numeric_hyperparameter_can_be_injected():
  helpers.check_injectable(swan)


def _swan(g, **kw):
  tx = scale_by_swan(**kw)
  return jax.jit(tx.update)({'w': g}, tx.init({'w': g}))[0]['w']


@pytest.mark.parametrize('whitening,tol', [('newton_schulz', 1e-3),
                                           ('exact', 1e-5)])
def test_swan_update_is_orthogonal(whitening, tol):
  # fan_in 8 > fan_out 4: the centered gradient keeps full column rank, so
  # the update has orthonormal columns.
  u = _swan(helpers.normal((8, 4), 0), whitening=whitening)
  np.testing.assert_allclose(u.T @ u, np.eye(4), atol=tol)


def test_swan_wide_update_is_orthogonal_off_the_mean_direction():
  # fan_in 4 < fan_out 8: centering each column over the 4 inputs removes
  # the all-ones input direction, so U U^T = I - 11^T/4.
  u = _swan(helpers.normal((4, 8), 1), whitening='exact')
  np.testing.assert_allclose(u @ u.T, np.eye(4) - np.ones((4, 4)) / 4,
                             atol=1e-4)


def test_swan_is_polar_factor_of_standardized_gradient():
  g = helpers.normal((8, 4), 2)
  scale = np.array([0.5, 2.0, 3.0, 7.0], np.float32)
  shift = np.array([1.0, -2.0, 0.0, 4.0], np.float32)
  u1 = _swan(g, whitening='exact')
  np.testing.assert_allclose(_swan(g * scale + shift, whitening='exact'), u1,
                             atol=1e-5)
  x = g.astype(np.float64)
  x = (x - x.mean(0)) / x.std(0)
  uu, _, vt = np.linalg.svd(x, full_matrices=False)
  np.testing.assert_allclose(u1, uu @ vt, atol=1e-5)
  # 'fan_out' standardizes each row; that leaves rank 3 here.
  u3 = _swan(g + np.arange(8.0, dtype=np.float32)[:, None],
             whitening='exact', norm_over='fan_out')
  x = g.astype(np.float64)
  x = (x - x.mean(1, keepdims=True)) / x.std(1, keepdims=True)
  uu, _, vt = np.linalg.svd(x, full_matrices=False)
  np.testing.assert_allclose(u3, uu[:, :3] @ vt[:3], atol=1e-4)


def test_swan_fallback_and_quintic():
  params = {'w': np.ones((6, 3), np.float32), 'b': np.ones(3, np.float32)}
  grads = {'w': helpers.normal((6, 3), 3), 'b': np.array([1.0, -2.0, 0.5])}
  tx = scale_by_swan(whitening='quintic', fallback=optax.scale_by_sign())
  u, _ = jax.jit(tx.update)(grads, tx.init(params))
  np.testing.assert_array_equal(u['b'], [1.0, -1.0, 1.0])
  s = np.linalg.svd(np.asarray(u['w']), compute_uv=False)
  assert 0.6 < s.min() and s.max() < 1.3, s


def test_swan_newton_schulz_runs_inside_the_worker_shard_map():
  """The Newton-Schulz loop carries an identity that must be typed as
  varying over the worker axis like the gradient it multiplies."""
  mesh = parallel.make_worker_mesh(4, data=2)
  tx = loc_opt.diloco(swan(1e-2), sync_every=2)
  params = {'w': jnp.ones((4, 16, 8)), 'b': jnp.zeros((4, 8))}
  sharding = jax.NamedSharding(mesh, jax.P('worker'))
  params = jax.device_put(params, sharding)
  grads = jax.device_put(jax.tree.map(
      lambda p: jax.random.normal(jax.random.key(0), p.shape), params),
      sharding)
  state = jax.jit(jax.vmap(tx.init))(params)
  step = jax.jit(parallel.shard_map_workers(tx.update, mesh))
  updates, _ = step(grads, state, params)
  want, _ = jax.jit(jax.vmap(tx.update, axis_name='worker'))(
      grads, state, params)
  np.testing.assert_allclose(updates['w'], want['w'], rtol=1e-4, atol=1e-6)


# Checks every matrix optimizer passes.


def test_trees_without_matrices_or_without_vectors():
  helpers.check_trees_without_matrices_or_vectors(swan)


def test_descent_on_least_squares():
  helpers.check_descent_on_least_squares(swan(0.1))
