"""Tests of Drop-Muon (loc_opt.inner.drop_muon)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loc_opt.inner.drop_muon import drop_muon
from loc_opt.inner.drop_muon import scale_by_drop_muon
from tests import optax_conformance as conf
from tests.inner import _helpers as helpers


def test_conformance(tmp_path):
  conf.check_all(lambda learning_rate: drop_muon(learning_rate), tmp_path)


def test_every_numeric_hyperparameter_can_be_injected():
  helpers.check_injectable(drop_muon)


def test_drop_muon_without_drops_is_muon():
  # Muon: 2-D only.
  shapes = {k: v for k, v in helpers.MANY.items() if k != 'e'}
  params, grads = helpers.tree(shapes, 0), helpers.tree(shapes, 10, (5,))
  tx = drop_muon(0.02, drop_prob=0.0, sampler='bernoulli')
  got, _, _, _ = helpers.run(tx, params, grads)
  want, _, _, _ = helpers.run(optax.contrib.muon(0.02), params, grads)
  conf.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


def test_drop_muon_bernoulli_fraction_and_frozen_layers():
  params, grads = helpers.tree(helpers.MANY, 0), helpers.tree(helpers.MANY, 10)
  tx = scale_by_drop_muon(drop_prob=0.3, sampler='bernoulli')

  per_leaf = lambda s: jax.tree.structure(params).flatten_up_to(
      s.inner_states)

  @jax.jit
  def run(params, grads):
    def body(state, _):
      updates, new = tx.update(grads, state, params)
      zero = jnp.stack([jnp.all(u == 0) for u in jax.tree.leaves(updates)])
      same = jnp.stack([
          jnp.all(jnp.stack([jnp.all(a == b) for a, b in zip(
              jax.tree.leaves(s_new), jax.tree.leaves(s_old))]))
          for s_new, s_old in zip(per_leaf(new), per_leaf(state))])
      return new, (new.active, zero, same)

    _, out = jax.lax.scan(body, tx.init(params), length=300)
    return out

  active, zero, same = (np.asarray(x) for x in run(params, grads))
  # Each leaf is its own layer: inactive ones emit zeros and keep state.
  assert np.all(zero[~active]) and np.all(same[~active])
  assert not np.any(zero[active])
  assert abs(active.mean() - 0.7) < 0.05, active.mean()


def test_drop_muon_progressive_activates_suffixes():
  shapes = {'l0': (3, 3), 'l1': (3, 3), 'l2': (3, 3), 'l2_bias': (3,)}
  layers = {'l0': 0, 'l1': 1, 'l2': 2, 'l2_bias': 2}
  tx = scale_by_drop_muon(layers=layers)
  grads = jax.tree.map(lambda x: np.broadcast_to(x, (300,) + x.shape),
                       helpers.tree(shapes, 1))
  _, _, _, states = helpers.run(tx, helpers.tree(shapes, 0), grads)
  active = np.asarray(states.active)  # (300, 3)
  assert np.all(np.diff(active.astype(int), axis=1) >= 0)  # Suffixes.
  # P(layer i active) = P(start <= i) = (i + 1) / 3.
  np.testing.assert_allclose(active.mean(0), [1 / 3, 2 / 3, 1.0], atol=0.07)


# Checks every matrix optimizer passes.


def test_trees_without_matrices_or_without_vectors():
  helpers.check_trees_without_matrices_or_vectors(drop_muon)


def test_descent_on_least_squares():
  helpers.check_descent_on_least_squares(drop_muon(0.1))


def test_inside_diloco():
  helpers.check_inside_diloco(drop_muon(1e-2))
