"""Tests of FRUGAL (loc_opt.inner.frugal)."""

import functools

import jax
import numpy as np
import optax

from loc_opt.inner.frugal import frugal
from loc_opt.inner.frugal import scale_by_frugal
from tests import optax_conformance as conf
from tests.inner import _helpers as helpers

# A small variant that exercises the periodic and low-rank paths on the
# conformance tree ({'w': (4, 3), 'b': (3,)}).
SMALL = functools.partial(frugal, update_gap=2, projector='columns', rank=2)


def test_conformance(tmp_path):
  conf.check_all(lambda learning_rate: SMALL(learning_rate), tmp_path)


def test_every_numeric_hyperparameter_can_be_injected():
  helpers.check_injectable(frugal)
  helpers.check_injectable(frugal, ('rank',), projector='svd', rank=2)


def test_frugal_full_subspace_is_adam():
  params = helpers.tree(helpers.MANY, 0)
  grads = helpers.tree(helpers.MANY, 10, (7,))
  tx = frugal(1e-2, density=1.0, update_gap=3)
  got, state, _, _ = helpers.run(tx, params, grads)
  want, _, _, _ = helpers.run(optax.adam(1e-2), params, grads)
  conf.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
  assert all(jax.tree.leaves(helpers.inner(state).active))


def test_frugal_empty_subspace_is_sign_sgd():
  # (The SGD state-free rule is checked in the SVD test below.)
  params = helpers.tree(helpers.MANY, 0)
  grads = helpers.tree(helpers.MANY, 10, (3,))
  tx = frugal(0.1, density=0.0, free_scale=0.5)
  _, state, updates, _ = helpers.run(tx, params, grads)
  for k in ('a', 'c', 'e'):
    np.testing.assert_allclose(updates[k], -0.05 * np.sign(grads[k]))
  assert not any(jax.tree.leaves(helpers.inner(state).active))


def test_frugal_blockwise_picks_density_of_leaves_per_period():
  params = helpers.tree(helpers.MANY, 0)
  grads = helpers.tree(helpers.MANY, 10, (9,))
  tx = scale_by_frugal(density=0.5, update_gap=3)
  _, _, _, states = helpers.run(tx, params, grads)
  active = np.stack(jax.tree.leaves(helpers.core(states).active),
                    axis=1)  # (9, 3)
  picks = [tuple(row) for row in active]
  assert all(sum(p) == 2 for p in picks)  # round(0.5 * 3) of 3 leaves.
  assert picks[0] == picks[1] == picks[2] and picks[3] == picks[5]
  assert len(set(picks)) > 1


def test_frugal_svd_splits_subspace_and_residual():
  # The (5, 3) leaf is tall: the basis spans r directions of the 3 columns.
  params = {'w': np.zeros((5, 3), np.float32)}
  grads = helpers.tree({'w': (5, 3)}, 1, (4,))
  tx = scale_by_frugal(projector='svd', rank=1, free_scale=0.3,
                       free_update='sgd', update_gap=2)
  _, state, updates, states = helpers.run(tx, params, grads)
  bases = np.asarray(helpers.core(states).basis['w'])  # (4, 3, 1)
  for i in range(4):
    complement = np.eye(3) - bases[i] @ bases[i].T
    # Outside the subspace: the state-free SGD step, scaled.
    np.testing.assert_allclose(np.asarray(updates['w'][i]) @ complement,
                               0.3 * grads['w'][i] @ complement, atol=1e-6)
  assert helpers.core(state).mu['w'].shape == (5, 1)
  # Refreshed on steps 0 and 2 (an SVD of that step's gradient), kept else.
  np.testing.assert_array_equal(bases[0], bases[1])
  np.testing.assert_array_equal(bases[2], bases[3])
  top = np.linalg.svd(grads['w'][2])[2][0]
  np.testing.assert_allclose(np.abs(bases[2][:, 0] @ top), 1.0, atol=1e-5)
  # Moments reset at the refresh on step 2.
  np.testing.assert_array_equal(helpers.core(states).moment_count['w'],
                                [1, 2, 1, 2])


# Checks every matrix optimizer passes.


def test_trees_without_matrices_or_without_vectors():
  helpers.check_trees_without_matrices_or_vectors(SMALL)


def test_descent_on_least_squares():
  helpers.check_descent_on_least_squares(
      frugal(0.1, density=0.5, update_gap=10, projector='svd'))
