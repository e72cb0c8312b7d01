"""Tests of the SPAM family's composable pieces (loc_opt.inner.clipping)."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loc_opt.inner import clipping
from tests import optax_conformance as conf
from tests.inner import _helpers as helpers


def make_pieces(learning_rate):
  return optax.chain(
      clipping.clip_by_moment_ratio(2.0, b2=0.999, delay=1),
      clipping.adaptive_max_clip(0.9),
      clipping.adaptive_grad_norm(0.7, 0.9),
      clipping.reset_every(optax.adam(learning_rate), 2),
  )


def test_conformance(tmp_path):
  conf.check_all(make_pieces, tmp_path)


def test_reset_every_restarts_the_inner_optimizer():
  params = conf.example_params()
  grads = helpers.random_grads(params, 7)
  got, state = helpers.run_updates(clipping.reset_every(optax.adam(0.1), 3),
                                   params, grads)
  # Updates 3 and 6 (1-based) are first updates of a fresh Adam.
  want = (helpers.run_updates(optax.adam(0.1), params, grads[:2])[0]
          + helpers.run_updates(optax.adam(0.1), params, grads[2:5])[0]
          + helpers.run_updates(optax.adam(0.1), params, grads[5:])[0])
  # Both run eagerly: Adam's operations one by one, on a state that the
  # lax.cond only selects (fresh zeros or the running state): the same
  # operations in the same order, bit for bit.
  helpers.assert_updates_close(got, want, rtol=0, atol=0)
  assert int(state.count) == 7
  # A non-positive period never resets.
  got, _ = helpers.run_updates(clipping.reset_every(optax.adam(0.1), 0),
                               params, grads)
  want, _ = helpers.run_updates(optax.adam(0.1), params, grads)
  # Both run eagerly: Adam's operations one by one, on a state that the
  # lax.cond only selects (fresh zeros or the running state): the same
  # operations in the same order, bit for bit.
  helpers.assert_updates_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize('s,want', [(2, 500.25), (10, 100.45), (100, 10.50),
                                    (1000, 1.58)])
def test_adaptive_max_clip_inflation(s, want):
  tx = clipping.adaptive_max_clip(0.999)
  g = {'w': jnp.array([1e6, -5.0, 2.0])}
  state = clipping.AdaptiveMaxClipState(
      count=jnp.asarray(s - 1, jnp.int32), max_ema={'w': jnp.asarray(1.0)})
  u, new_state = tx.update(g, state)
  inflation = u['w'][0] / new_state.max_ema['w']
  np.testing.assert_allclose(inflation, want, rtol=2e-3)
  # Proportional: the other entries are below the threshold, unchanged.
  np.testing.assert_array_equal(u['w'][1:], g['w'][1:])
