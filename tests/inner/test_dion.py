"""Tests of Dion (loc_opt.inner.dion)."""

import functools

import jax
import numpy as np

from loc_opt.inner.dion import dion
from loc_opt.inner.dion import scale_by_dion
from tests import optax_conformance as conf
from tests.inner import _helpers as helpers

# A small variant that exercises the low-rank path on the conformance tree
# ({'w': (4, 3), 'b': (3,)}).
SMALL = functools.partial(dion, rank=2)


def test_conformance(tmp_path):
  conf.check_all(lambda learning_rate: SMALL(learning_rate), tmp_path)


def test_every_numeric_hyperparameter_can_be_injected():
  helpers.check_injectable(dion, ('rank',), rank=2)


def test_dion_rank_r_gradient_gives_orthonormal_basis_of_its_spaces():
  left = np.linalg.qr(helpers.normal((8, 2), 7))[0]
  right = np.linalg.qr(helpers.normal((6, 2), 8))[0]
  g = (left @ np.diag([3.0, 1.0]) @ right.T).astype(np.float32)  # Rank 2.
  params = {'w': np.zeros((8, 6), np.float32)}
  tx = scale_by_dion(rank=2)
  _, state, updates, _ = helpers.run(tx, params, {'w': np.stack([g] * 8)})
  core = helpers.core(state)
  assert core.basis['w'].shape == (8, 2) and core.momentum['w'].shape == (8, 6)
  scale = np.sqrt(6 / 8)  # sqrt(fan_out / fan_in).
  for w in np.asarray(updates['w'], np.float64) / scale:
    # Column space of g on the left, row space of g on the right; rank 2.
    np.testing.assert_allclose(left @ left.T @ w @ right @ right.T, w,
                               atol=1e-5)
    s = np.linalg.svd(w, compute_uv=False)
    assert s[1] > 0.1 and s[2] < 1e-5
  # Warm-started power iteration: orthonormal, the polar factor of g.
  np.testing.assert_allclose(w.T @ w, right @ right.T, atol=1e-5)
  np.testing.assert_allclose(w, left @ right.T, atol=1e-5)
  # Error feedback keeps mu of the captured part: M_t = mu (M_{t-1} + G).
  np.testing.assert_allclose(core.momentum['w'], 0.95 / 0.05 * g * (
      1 - 0.95 ** 8), rtol=1e-4, atol=1e-5)


def test_dion_rank_and_orientation():
  shapes = {'a': (3, 7), 'c': (2, 3, 5), 'b': (3,)}
  params = helpers.tree(shapes, 0)
  core = helpers.core(scale_by_dion(rank=2).init(params))
  assert core.basis['a'].shape == (3, 2)
  assert core.basis['c'].shape == (6, 2)
  tx = scale_by_dion(rank_fraction=0.5)
  core = helpers.core(tx.init(params))
  assert core.basis['a'].shape == (3, 2) and core.basis['c'].shape == (6, 3)
  updates, _ = jax.jit(tx.update)(helpers.tree(shapes, 1), tx.init(params))
  assert jax.tree.map(np.shape, updates) == shapes


# Checks every matrix optimizer passes.


def test_trees_without_matrices_or_without_vectors():
  helpers.check_trees_without_matrices_or_vectors(SMALL)


def test_descent_on_least_squares():
  helpers.check_descent_on_least_squares(dion(0.1, rank=2))


def test_inside_diloco():
  helpers.check_inside_diloco(SMALL(1e-2))
