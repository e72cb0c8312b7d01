"""Tests of EDiT: DiLoCo equivalence, anomaly drop, weights, clip, bytes."""

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
DIRECTION = jnp.array([0.6, 0.8])  # a unit vector


def make_edit(learning_rate):
  return outer.edit_diloco(optax.adam(learning_rate), sync_every=3,
                           axis_name=None, warmup_syncs=1, clip_norm=1.0)


def test_conformance(tmp_path):
  conf.check_all(make_edit, tmp_path)


def test_no_penalty_is_diloco():
  kw = dict(sync_every=3)
  got, state = helpers.run_workers(
      outer.edit_diloco(optax.adam(1e-2), z_threshold=float('inf'),
                        temperature=float('inf'), **kw), 10)
  want, want_state = helpers.run_workers(loc_opt.diloco(optax.adam(1e-2), **kw),
                                         10)
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
  conf.assert_trees_close(state.anchor, want_state.anchor, rtol=1e-6,
                          atol=1e-7)
  assert int(state.num_syncs[0]) == 3
  np.testing.assert_allclose(state.weight, 1 / M)
  np.testing.assert_array_equal(state.total_dropped, 0)


def run_syncs(tx, norms, m=M):
  """H = 1 and inner SGD lr 1: worker k's pseudo-gradient at sync s is
  ``norms[s][k] * DIRECTION``. Returns the params and state after each
  sync."""

  step = helpers.grads_step(tx)
  params = helpers.stack({'x': jnp.array([1.0, -2.0])}, m)
  state = jax.vmap(tx.init)(params)
  out = [(params, state)]
  for row in norms:
    grads = {'x': jnp.asarray(row)[:, None] * DIRECTION}
    params, state = step(params, state, grads)
    out.append((params, state))
  return out


def test_softmax_weights_by_hand():
  tx = outer.edit_diloco(optax.sgd(1.0), sync_every=1, outer=optax.sgd(1.0),
                         z_threshold=float('inf'), temperature=2.0)
  (_, _), (p1, s1) = run_syncs(tx, [[1.0, 2.0, 3.0, 4.0]])
  # w_m = exp(-n_m / 2) / sum_j exp(-n_j / 2), larger norm => less weight.
  want_w = [0.45505423, 0.27600434, 0.1674051, 0.10153632]
  np.testing.assert_allclose(s1.weight, want_w, rtol=1e-5)
  # phi_1 = phi_0 - sum_m w_m n_m d, with sum_m w_m n_m = 1.9154235.
  want = jnp.array([1.0, -2.0]) - 1.9154235 * DIRECTION
  np.testing.assert_allclose(p1['x'], np.broadcast_to(want, (M, 2)),
                             rtol=1e-5)
  np.testing.assert_allclose(outer.edit_eval_params(s1, p1)['x'], p1['x'])


# Norms at four syncs; worker 3 spikes 100x at the fourth.
NORMS = [[1.0] * 4, [1.2] * 4, [0.8] * 4, [1.1, 1.1, 1.1, 110.0]]


def test_spiking_worker_is_dropped_after_warmup():
  tx = outer.edit_diloco(optax.sgd(1.0), sync_every=1, outer=optax.sgd(1.0),
                         warmup_syncs=3, temperature=float('inf'))
  out = run_syncs(tx, NORMS)
  for s in range(1, 4):  # equal norms: equal weights, nobody dropped
    np.testing.assert_array_equal(out[s][1].num_dropped, 0)
  (p3, s3), (p4, s4) = out[3], out[4]
  # Detector after the warmup: mean 1.0, variance 0.08 / 3 (exact).
  np.testing.assert_allclose(s3.norm_mean, 1.0, rtol=1e-6)
  np.testing.assert_allclose(s3.norm_var, 0.08 / 3, rtol=1e-5)
  # Worker 3 (z ~ 670) is dropped; the others (z = 0.61) average alone.
  np.testing.assert_array_equal(s4.num_dropped, 1)
  np.testing.assert_array_equal(s4.total_dropped, 1)
  np.testing.assert_allclose(s4.weight, [1 / 3, 1 / 3, 1 / 3, 0.0])
  np.testing.assert_allclose(p4['x'] - p3['x'],
                             np.broadcast_to(-1.1 * DIRECTION, (M, 2)),
                             rtol=1e-5)
  # The flagged norm does not enter worker 3's statistics.
  np.testing.assert_array_equal(s4.num_norms, [4, 4, 4, 3])
  np.testing.assert_allclose(s4.norm_mean[3], 1.0, rtol=1e-6)


def test_no_drop_during_warmup_and_all_dropped_falls_back_to_mean():
  tx = outer.edit_diloco(optax.sgd(1.0), sync_every=1, outer=optax.sgd(1.0),
                         warmup_syncs=4, temperature=float('inf'))
  *_, (p3, _), (p4, s4) = run_syncs(tx, NORMS)
  np.testing.assert_array_equal(s4.num_dropped, 0)  # still warming up
  np.testing.assert_allclose(p4['x'][0] - p3['x'][0],
                             -(3.3 + 110) / 4 * DIRECTION, rtol=1e-5)
  # One worker: its spike is flagged, but with nobody left it is kept.
  tx = outer.edit_diloco(optax.sgd(1.0), sync_every=1, outer=optax.sgd(1.0),
                         warmup_syncs=3, axis_name=None)
  params = {'x': jnp.zeros(2)}
  state = tx.init(params)
  for norm in (1.0, 1.2, 0.8, 110.0):
    before = params
    updates, state = tx.update({'x': norm * DIRECTION}, state, params)
    params = optax.apply_updates(params, updates)
  np.testing.assert_allclose(params['x'] - before['x'], -110.0 * DIRECTION,
                             rtol=1e-5)
  assert int(state.num_dropped) == 0 and int(state.num_norms) == 3


@pytest.mark.parametrize('clip_norm, moved', [(0.5, 0.5), (10.0, 2.5)])
def test_clip_bounds_the_aggregate(clip_norm, moved):
  tx = outer.edit_diloco(optax.sgd(1.0), sync_every=1, outer=optax.sgd(1.0),
                         temperature=float('inf'), clip_norm=clip_norm)
  (p0, _), (p1, _) = run_syncs(tx, [[1.0, 2.0, 3.0, 4.0]])
  # The mean pseudo-gradient has norm 2.5; the outer step moves phi by it.
  np.testing.assert_allclose(p0['x'] - p1['x'],
                             np.broadcast_to(moved * DIRECTION, (M, 2)),
                             rtol=1e-5)


def test_plan_matches_cond_program():
  tx = outer.edit_diloco(optax.adam(1e-2), sync_every=3, warmup_syncs=1,
                         temperature=0.01, clip_norm=0.05)
  state = helpers.check_plan_matches_cond(tx, outer.edit_plan(3), 9)
  assert int(state.num_syncs[0]) == 3
  # The weights are not uniform (temperature 0.01 on differing norms).
  assert np.ptp(np.asarray(state.weight)) > 0.01


def test_shard_map_runner_matches_vmap_runner():
  tx = outer.edit_diloco(optax.adam(1e-2), sync_every=2, warmup_syncs=1,
                         temperature=0.01, clip_norm=0.05)
  want, want_state = helpers.run_workers(tx, 4)
  got, state = helpers.run_sharded(tx, 4)
  conf.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
  conf.assert_trees_close(state.weight, want_state.weight, rtol=1e-5)


def test_bad_arguments_raise():
  sgd = optax.sgd(0.1)
  for bad in (0, -1, 2.5, True):
    with pytest.raises(ValueError, match='sync_every'):
      outer.edit_diloco(sgd, sync_every=bad)
  cases = dict(ewma=[0.0, 1.5, True], warmup_syncs=[0, 2.0],
               z_threshold=[0.0, -1.0], temperature=[0.0, -2.0],
               clip_norm=[0.0, float('inf')])
  for name, values in cases.items():
    for bad in values:
      with pytest.raises(ValueError, match=name):
        outer.edit_diloco(sgd, sync_every=2, **{name: bad})
  tx = make_edit(0.1)
  params = conf.example_params()
  with pytest.raises(ValueError, match='sync'):
    tx.update(params, tx.init(params), params, sync=(0, 1))
  with pytest.raises(ValueError, match='sync_every'):
    outer.edit_plan(0)


def test_hlo_bytes():
  tx = outer.edit_diloco(optax.sgd(0.1), sync_every=3, clip_norm=1.0)
  params = helpers.stack({'w': jnp.zeros((32, 16)), 'b': jnp.zeros(16)})
  theory = outer.edit_bytes(helpers.worker(params, 0))
  assert theory == 4 * (512 + 16) + 8
  helpers.check_two_phase_bytes(tx, params, theory)
