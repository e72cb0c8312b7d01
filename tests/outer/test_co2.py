"""Tests of CO2: local SGD equivalence, hand-computed stale trace, bytes."""

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


def make_co2(learning_rate):
  return outer.co2(optax.adam(learning_rate), sync_every=3, axis_name=None)


def test_conformance(tmp_path):
  conf.check_all(make_co2, tmp_path)


def test_fresh_plain_outer_is_local_sgd():
  tx = outer.co2(optax.adam(1e-2), sync_every=3, stale=False, momentum=0.0,
                 staleness_penalty=1.0, outer_lr=1.0, clip=None)
  got, state = helpers.run_workers(tx, 8)
  want, _ = helpers.run_workers(
      loc_opt.local_sgd(optax.adam(1e-2), sync_every=3), 8)
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
  assert int(state.num_syncs[0]) == 2
  # Between syncs the workers differ; the anchor is the last average.
  assert not np.allclose(got['w'][0], got['w'][1])
  p6, _ = helpers.run_workers(tx, 6)
  conf.assert_trees_close(outer.co2_eval_params(state, got), p6, rtol=1e-6,
                          atol=1e-6)


# Two workers, one leaf, H = 2, inner SGD lr 0.5 and gradients constant
# within a round, so theta'_m = phi - g_m and xbar_r = phi - gbar_r.
TH0 = jnp.array([1.0, 2.0])
GRADS = (jnp.array([[1.0, 0.0], [3.0, 2.0]]),   # gbar_1 = [2, 1]
         jnp.array([[0.0, 1.0], [2.0, -1.0]]),  # gbar_2 = [1, 0]
         jnp.array([[1.0, 1.0], [1.0, 1.0]]))   # gbar_3 = [1, 1]


def three_rounds(**kw):
  kw = dict(outer_lr=0.5, momentum=0.5, staleness_penalty=2.0, clip=None,
            sync_every=2) | kw
  tx = outer.co2(optax.sgd(0.5), **kw)
  step = helpers.grads_step(tx)
  params = helpers.stack(TH0, 2)
  state = jax.vmap(tx.init)(params)
  out = []
  for grads in GRADS:
    for _ in range(2):
      params, state = step(params, state, grads)
    out.append((params, state))
  return out


def test_stale_trace_by_hand():
  (p1, s1), (p2, s2), (p3, s3) = three_rounds()
  # Round 1: the stale average is phi_0, so m = 0 and phi stays [1, 2];
  # xbar_1 = phi_0 - gbar_1 = [-1, 1] is launched.
  np.testing.assert_allclose(p1, [[1.0, 2.0]] * 2)
  np.testing.assert_allclose(s1.outer_momentum, [[0.0, 0.0]] * 2)
  np.testing.assert_allclose(s1.stale_mean, [[-1.0, 1.0]] * 2)
  # Round 2: m = (phi_1 - xbar_1) / 2 = [1, 0.5];
  # phi_2 = [1, 2] - 0.5 m = [0.5, 1.75]; xbar_2 = [1, 2] - [1, 0] = [0, 2].
  np.testing.assert_allclose(s2.outer_momentum, [[1.0, 0.5]] * 2)
  np.testing.assert_allclose(p2, [[0.5, 1.75]] * 2)
  np.testing.assert_allclose(s2.stale_mean, [[0.0, 2.0]] * 2)
  # Round 3: m = 0.5 [1, 0.5] + ([0.5, 1.75] - [0, 2]) / 2 = [0.75, 0.125];
  # phi_3 = [0.5, 1.75] - 0.5 m = [0.125, 1.6875];
  # xbar_3 = [0.5, 1.75] - [1, 1] = [-0.5, 0.75].
  np.testing.assert_allclose(s3.outer_momentum, [[0.75, 0.125]] * 2)
  np.testing.assert_allclose(p3, [[0.125, 1.6875]] * 2)
  np.testing.assert_allclose(s3.anchor, p3)
  np.testing.assert_allclose(s3.stale_mean, [[-0.5, 0.75]] * 2)
  np.testing.assert_array_equal(s3.num_syncs, [3, 3])


def test_clip_binds_elementwise():
  _, (p2, s2), _ = three_rounds(clip=0.3)
  # Round 2's momentum [1, 0.5] is clipped to [0.3, 0.3]:
  # phi_2 = [1, 2] - 0.5 [0.3, 0.3].
  np.testing.assert_allclose(s2.outer_momentum, [[0.3, 0.3]] * 2)
  np.testing.assert_allclose(p2, [[0.85, 1.85]] * 2)


def test_fresh_trace_by_hand():
  (p1, s1), _, _ = three_rounds(stale=False)
  # m = (phi_0 - xbar_1) / 2 = [1, 0.5]; phi_1 = [1, 2] - 0.5 m.
  np.testing.assert_allclose(s1.outer_momentum, [[1.0, 0.5]] * 2)
  np.testing.assert_allclose(p1, [[0.5, 1.75]] * 2)


def test_plan_matches_cond_program():
  tx = outer.co2(optax.adam(1e-2), sync_every=3, clip=0.01)
  state = helpers.check_plan_matches_cond(tx, outer.co2_plan(3), 9)
  assert int(state.num_syncs[0]) == 3
  # The clip bound the momentum somewhere.
  assert np.max(np.abs(state.outer_momentum['w'])) == pytest.approx(0.01)


def test_shard_map_runner_matches_vmap_runner():
  tx = outer.co2(optax.adam(1e-2), sync_every=2)
  want, _ = helpers.run_workers(tx, 6)
  got, _ = helpers.run_sharded(tx, 6)
  conf.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


def test_bad_arguments_raise():
  sgd = optax.sgd(0.1)
  for bad in (0, -1, 2.5, True):
    with pytest.raises(ValueError, match='sync_every'):
      outer.co2(sgd, sync_every=bad)
  cases = dict(outer_lr=[0.0, -1.0], momentum=[-0.1, 1.0],
               staleness_penalty=[0.0, -2.0], clip=[0.0, -1.0])
  for name, values in cases.items():
    for bad in values:
      with pytest.raises(ValueError, match=name):
        outer.co2(sgd, sync_every=2, **{name: bad})
  tx = make_co2(0.1)
  params = conf.example_params()
  with pytest.raises(ValueError, match='sync'):
    tx.update(params, tx.init(params), params, sync='yes')
  with pytest.raises(ValueError, match='sync_every'):
    outer.co2_plan(-3)


def test_hlo_bytes():
  tx = outer.co2(optax.sgd(0.1), sync_every=3)
  params = helpers.stack({'w': jnp.zeros((32, 16)), 'b': jnp.zeros(16)})
  theory = outer.co2_bytes(helpers.worker(params, 0))
  assert theory == 4 * (512 + 16)
  helpers.check_two_phase_bytes(tx, params, theory)
