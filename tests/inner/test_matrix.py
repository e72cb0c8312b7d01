"""Tests of loc_opt.inner._matrix: shared matrix functions and routing."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loc_opt.inner import _matrix


def _singular_values(x):
  return np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)


def test_as_matrix_merges_leading_axes():
  x = jnp.arange(2 * 3 * 5.).reshape(2, 3, 5)
  assert _matrix.as_matrix(x).shape == (6, 5)
  assert _matrix.matrix_shape((2, 3, 5)) == (6, 5)
  with pytest.raises(ValueError):
    _matrix.as_matrix(jnp.ones(3))


def test_labels_default_and_mask():
  params = {'w': jnp.ones((3, 2)), 'b': jnp.ones(2), 'e': jnp.ones((4, 3))}
  assert _matrix.matrix_labels(params) == {
      'w': 'matrix', 'b': 'other', 'e': 'matrix'}
  mask = lambda p: {'w': True, 'b': False, 'e': False}
  assert _matrix.matrix_labels(params, mask) == {
      'w': 'matrix', 'b': 'other', 'e': 'other'}
  with pytest.raises(ValueError, match='two dimensions'):
    _matrix.matrix_labels(params, {'w': True, 'b': True, 'e': True})


def test_split_by_kind_routes_leaves():
  tx = _matrix.split_by_kind(optax.scale(2.0), optax.scale(-1.0))
  params = {'w': jnp.ones((3, 2)), 'b': jnp.ones(2)}
  updates, _ = tx.update(params, tx.init(params))
  np.testing.assert_array_equal(updates['w'], 2.0)
  np.testing.assert_array_equal(updates['b'], -1.0)


@pytest.mark.parametrize('method', ['newton_schulz', 'exact'])
def test_inverse_sqrt(method):
  a = jax.random.normal(jax.random.key(0), (6, 6))
  a = a @ a.T + 0.5 * jnp.eye(6)
  got = _matrix.inverse_sqrt(a, method=method, steps=30)
  np.testing.assert_allclose(got @ a @ got, np.eye(6), atol=1e-4)


@pytest.mark.parametrize('shape', [(7, 3), (3, 7)])
def test_polar_factor_matches_svd(shape):
  x = jax.random.normal(jax.random.key(1), shape)
  u, _, vt = np.linalg.svd(np.asarray(x), full_matrices=False)
  for method, tol in [('exact', 1e-5), ('newton_schulz', 1e-4)]:
    got = _matrix.polar_factor(x, method=method, steps=20)
    np.testing.assert_allclose(got, u @ vt, atol=tol)


def test_quintic_orthogonalize_is_rough_polar():
  x = jax.random.normal(jax.random.key(2), (9, 5))
  s = _singular_values(_matrix.orthogonalize(x))
  assert 0.6 < s.min() and s.max() < 1.3, s


def test_subspace_bases_are_orthonormal():
  key = jax.random.key(3)
  x = jax.random.normal(key, (8, 5))
  v = _matrix.top_right_singular_vectors(x, 2)
  _, s, vt = np.linalg.svd(np.asarray(x))
  np.testing.assert_allclose(np.abs(v.T @ vt[:2].T), np.eye(2), atol=1e-5)
  for q in (_matrix.random_orthonormal(key, 5, 3),
            _matrix.random_coordinates(key, 5, 3)):
    assert q.shape == (5, 3)
    np.testing.assert_allclose(q.T @ q, np.eye(3), atol=1e-6)
  sel = np.asarray(_matrix.random_coordinates(key, 5, 3))
  assert set(np.unique(sel)) <= {0.0, 1.0}


def test_gathered_keeps_shardings_on_explicit_mesh():
  mesh = jax.make_mesh((2,), ('fsdp',),
                       axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:2])
  sharding = jax.NamedSharding(mesh, jax.P('fsdp', None))

  def polar(updates, state, params=None):
    del params
    return jax.tree.map(lambda g: _matrix.polar_factor(g), updates), state

  tx = _matrix.gathered(optax.GradientTransformation(optax.init_empty_state,
                                                     polar))
  g = jax.device_put(jax.random.normal(jax.random.key(4), (4, 3)), sharding)
  with jax.set_mesh(mesh):
    u, _ = jax.jit(tx.update)(g, tx.init(g))
  assert u.sharding.spec == jax.P('fsdp', None)
  np.testing.assert_allclose(u, _matrix.polar_factor(np.asarray(g)),
                             atol=1e-5)
