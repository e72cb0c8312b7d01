"""Tests of eager updates: M = 1 equivalence, hand-computed proxy, bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import outer
from tests import optax_conformance as conf
from tests.outer import _helpers as helpers

M = helpers.M


def make_eager(learning_rate):
  return outer.eager_diloco(optax.adam(learning_rate), sync_every=3,
                            axis_name=None)


def test_conformance(tmp_path):
  conf.check_all(make_eager, tmp_path)


@pytest.mark.parametrize('axis_name', [None, 'worker'])
def test_one_worker_is_diloco(axis_name):
  kw = dict(sync_every=3, axis_name=axis_name)
  got, state = helpers.run_workers(
      outer.eager_diloco(optax.adam(1e-2), **kw), 10, m=1)
  want, want_state = helpers.run_workers(
      loc_opt.diloco(optax.adam(1e-2), **kw), 10, m=1)
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
  conf.assert_trees_close(state.anchor, want_state.anchor, rtol=1e-6,
                          atol=1e-7)
  assert int(state.num_syncs[0]) == 3


# Two workers, one leaf, inner SGD lr 1, H = 2, outer SGD lr 0.5 (no
# momentum). Round 1 gradients g1, round 2 gradients g2 (constant within a
# round), so Delta^(r)_m = 2 g^(r)_m and mean(Delta^(1)) = 2 gbar1 = [4, 2].
TH0 = jnp.array([1.0, 2.0])
G1 = jnp.array([[1.0, 0.0], [3.0, 2.0]])
G2 = jnp.array([[0.0, 1.0], [2.0, -1.0]])


def two_rounds(naive):
  tx = outer.eager_diloco(optax.sgd(1.0), sync_every=2,
                          outer=optax.sgd(0.5), naive=naive)
  step = helpers.grads_step(tx)
  params = helpers.stack(TH0, 2)
  state = jax.vmap(tx.init)(params)
  out = []
  for grads in (G1, G1, G2, G2):
    params, state = step(params, state, grads)
    out.append((params, state))
  return out[1], out[3]


def test_eager_proxy_by_hand():
  (p1, s1), (p2, s2) = two_rounds(naive=False)
  # Round 1: proxy = Delta_m / 2 = g1_m; phi_m = th0 - 0.5 g1_m.
  np.testing.assert_allclose(p1, [[0.5, 2.0], [-0.5, 1.0]])
  np.testing.assert_allclose(s1.prev_mean, [[4.0, 2.0]] * 2)
  np.testing.assert_allclose(s1.prev_sent, 2 * G1)
  # Round 2: proxy = g2_m + 2 gbar1 - g1_m, so
  # phi_m = th0 - 0.5 g2_m - gbar1 = [[-1, 0.5], [-2, 1.5]].
  np.testing.assert_allclose(p2, [[-1.0, 0.5], [-2.0, 1.5]])
  np.testing.assert_allclose(outer.eager_eval_params(s2, p2), p2)
  np.testing.assert_allclose(s2.prev_mean, [[2.0, 0.0]] * 2)
  np.testing.assert_array_equal(s2.num_syncs, [2, 2])


def test_naive_delayed_by_hand():
  (p1, _), (p2, _) = two_rounds(naive=True)
  # Round 1 applies the zero stale mean; round 2 applies mean(Delta^(1)).
  np.testing.assert_allclose(p1, [[1.0, 2.0]] * 2)
  np.testing.assert_allclose(p2, [[-1.0, 1.0]] * 2)


def test_plan_matches_cond_program():
  tx = outer.eager_diloco(optax.adam(1e-2), sync_every=3)
  state = helpers.check_plan_matches_cond(tx, outer.eager_plan(3), 8)
  assert int(state.num_syncs[0]) == 2
  # Workers' outer parameters differ by construction.
  assert not np.allclose(state.anchor['w'][0], state.anchor['w'][1])


def test_bad_arguments_raise():
  for bad in (0, -1, 2.5, True):
    with pytest.raises(ValueError, match='sync_every'):
      outer.eager_diloco(optax.sgd(0.1), sync_every=bad)
  with pytest.raises(ValueError, match='axis_name'):
    outer.eager_diloco(optax.sgd(0.1), sync_every=2, axis_name=None,
                       codec=loc_opt.compression.int8())
  tx = make_eager(0.1)
  params = conf.example_params()
  with pytest.raises(ValueError, match='sync'):
    tx.update(params, tx.init(params), params, sync=(0, 1))


def test_hlo_bytes():
  tx = outer.eager_diloco(optax.sgd(0.1), sync_every=3)
  params = helpers.stack({'w': jnp.zeros((32, 16)), 'b': jnp.zeros(16)})
  theory = outer.eager_bytes(helpers.worker(params, 0))
  assert theory == 4 * (512 + 16)
  helpers.check_two_phase_bytes(tx, params, theory)
