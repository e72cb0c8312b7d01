"""Tests of Fira (loc_opt.inner.fira)."""

import functools

import jax
import numpy as np
import optax
import pytest

from loc_opt.inner import _matrix
from loc_opt.inner.fira import fira
from loc_opt.inner.fira import scale_by_fira
from tests import optax_conformance as conf
from tests.inner import _helpers as helpers

# A small variant that exercises the periodic and low-rank paths on the
# conformance tree ({'w': (4, 3), 'b': (3,)}).
SMALL = functools.partial(fira, update_proj_gap=2, rank=2)


def test_conformance(tmp_path):
  conf.check_all(lambda learning_rate: SMALL(learning_rate), tmp_path)


def test_every_numeric_hyperparameter_can_be_injected():
  helpers.check_injectable(fira, ('rank',), rank=2)
  tx = optax.inject_hyperparams(fira)(learning_rate=0.1, rank=2)
  with pytest.raises(ValueError, match=r"static_args=\('rank',\)"):
    jax.eval_shape(tx.init, helpers.tree({'w': (4, 3), 'b': (3,)}, 0))


def test_fira_full_rank_is_adam_in_rotated_coordinates():
  # A tall leaf (projected on the right) and a wide one (on the left).
  shapes = {'t': (4, 3), 'w': (3, 5), 'b': (3,)}
  params, grads = helpers.tree(shapes, 0), helpers.tree(shapes, 2, (5,))
  tx = scale_by_fira(update_proj_gap=1000, scale=1.0, eps=1e-12, rank=8)
  _, _, updates, states = helpers.run(tx, params, grads)
  core = helpers.core(states)
  for k in ('t', 'w'):
    shape = shapes[k]
    q = np.asarray(core.basis[k][0])  # Fixed after the first step.
    assert q.shape == (min(shape), min(shape))
    np.testing.assert_allclose(q.T @ q, np.eye(min(shape)), atol=1e-5)
    np.testing.assert_array_equal(core.basis[k][-1], q)
    tall = shape[0] >= shape[1]
    rotated = (grads[k] if tall else grads[k].transpose(0, 2, 1)) @ q
    _, _, want, _ = helpers.run(optax.scale_by_adam(eps=1e-12),
                                np.zeros(rotated.shape[1:], np.float32),
                                rotated)
    want = np.asarray(want) @ q.T
    np.testing.assert_allclose(updates[k],
                               want if tall else want.transpose(0, 2, 1),
                               atol=1e-5)
    assert np.all(core.residual_norm[k] < 1e-4)


def test_fira_low_rank_residual_and_compat_mode():
  params = {'w': np.zeros((6, 4), np.float32)}
  g = {'w': helpers.normal((6, 4), 4)}

  def first_update(**kw):
    tx = scale_by_fira(update_proj_gap=10, rank=1, **kw)
    return jax.jit(tx.update)(g, tx.init(params))

  u_clean, state = first_update(scale=0.25)
  u_compat, _ = first_update(scale=0.25, reference_compat=True)
  q = np.asarray(helpers.core(state).basis['w'], np.float64)
  gw = g['w'].astype(np.float64)
  # First step: m = (1-b1) R, v = (1-b2) R^2, N = m / (sqrt(v) + eps),
  # phi_i = ||N_i|| / ||R_i|| (rank 1: absolute values).
  low = gw @ q
  n = 0.1 * low / (np.sqrt(0.001) * np.abs(low) + 1e-6)
  phi = np.abs(n) / (np.abs(low) + 1e-8)
  factor = np.sqrt(0.001) / 0.1  # sqrt(1 - b2) / (1 - b1).
  want = factor * (0.25 * n @ q.T + (gw - low @ q.T) * phi)
  np.testing.assert_allclose(u_clean['w'], want, rtol=1e-4, atol=1e-6)
  # Compat leaks (1 - alpha) of the in-subspace gradient into the residual.
  leak = factor * (1 - 0.25) * (low @ q.T) * phi
  np.testing.assert_allclose(u_compat['w'], want + leak, rtol=1e-4,
                             atol=1e-6)
  # With alpha = 1 the two modes agree.
  np.testing.assert_allclose(
      first_update(scale=1.0)[0]['w'],
      first_update(scale=1.0, reference_compat=True)[0]['w'])


def test_fira_limiter_caps_residual_growth():
  params = {'w': np.zeros((6, 4), np.float32)}
  g0 = helpers.normal((6, 4), 5)
  q = np.asarray(_matrix.top_right_singular_vectors(g0, 1))  # Step 0 basis.
  # Grow only the part outside the (fixed) subspace: R, N and phi stay put
  # while the raw residual grows tenfold per step.
  e = helpers.normal((6, 4), 6)
  e = e - e @ q @ q.T
  grads = {'w': np.stack([g0 + (10.0 ** i if i else 0.0) * e
                          for i in range(4)])}
  tx = scale_by_fira(update_proj_gap=1000, rank=1, limiter_gamma=1.01)
  _, _, _, states = helpers.run(tx, params, grads)
  norms = np.asarray(helpers.core(states).residual_norm['w'])
  np.testing.assert_allclose(norms[1:] / norms[:-1], 1.01, rtol=1e-4)


# Checks every matrix optimizer passes.


def test_trees_without_matrices_or_without_vectors():
  helpers.check_trees_without_matrices_or_vectors(SMALL)


def test_descent_on_least_squares():
  helpers.check_descent_on_least_squares(
      fira(0.2, rank=2, update_proj_gap=10))
