"""Tests of SparseLoCo (loc_opt.outer.sparseloco): EF invariant, the
DiLoCo equivalence, aggregation, plans, and bytes on the compiled program."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import outer
from loc_opt import parallel
from tests import optax_conformance as conf
from tests.outer import _helpers as helpers

M = helpers.M
# DeMo's tests' model: helpers.TILE_SHAPES, a 16 x 8 weight (one 16 x 8
# tile at tile 16) and a bias of 8, with helpers.tile_grads.


def make_sparseloco(learning_rate):
  return outer.sparseloco(optax.adam(learning_rate), sync_every=2,
                          axis_name=None)


def test_conformance(tmp_path):
  conf.check_all(make_sparseloco, tmp_path)




@functools.lru_cache(maxsize=None)
def compiled_step(tx, mode='vmap', sync=None):
  """The jitted per-worker step of tx (a static phase or ``None``)."""

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params, sync=sync)
    return optax.apply_updates(params, updates), state

  if mode == 'vmap':
    return jax.jit(parallel.vmap_workers(step))
  return jax.jit(parallel.shard_map_workers(
      step, parallel.make_worker_mesh(M, data=2)))


def run_workers(tx, steps, m=M, mode='vmap', plan=None,
                grads=helpers.tile_grads):
  """Trains m workers; ``plan`` picks a static program per step."""
  params = helpers.stack(helpers.tile_params(), m)
  state = jax.vmap(tx.init)(params)
  for i in range(steps):
    sync = None if plan is None else plan(i)
    params, state = compiled_step(tx, mode, sync)(params, state,
                                                  grads(i, m))
  return params, state


# A default SparseLoCo on small tiles: 8 x 8 tiles of w (k 2), 8-long
# segments of b (k 1), 2-bit values.
TX = outer.sparseloco(optax.sgd(0.1), sync_every=2, topk=128, tile=8)


def test_error_feedback_invariant_and_two_bit_messages():
  # One worker, lr 1: the anchor moves by exactly the transmitted
  # reconstruction s, and ef_decay e_old + delta == s + e_new.
  beta = 0.9
  tx = outer.sparseloco(optax.sgd(0.1), sync_every=1, ef_decay=beta,
                        topk=512, tile=8, axis_name=None)
  params = helpers.tile_params()
  state = tx.init(params)
  step = jax.jit(tx.update)
  for i in range(3):
    grads = jax.tree.map(lambda g: g[0], helpers.tile_grads(i, 1))
    updates, new = step(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    for k in helpers.TILE_SHAPES:
      delta = state.anchor[k] - (params[k] - 0.1 * grads[k])
      sent = state.anchor[k] - new.anchor[k]
      np.testing.assert_allclose(beta * state.error[k] + delta,
                                 sent + new.error[k], rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(new_params[k], new.anchor[k], atol=1e-6)
      # k = 512 of 4096 scales to 8 of an 8 x 8 tile and 1 of an 8-long
      # segment; the values take at most 4 levels (2 bits) per tensor.
      s = np.asarray(sent).reshape(-1, 8) if k == 'b' else np.asarray(
          sent).reshape(2, 8, 1, 8).transpose(0, 2, 1, 3).reshape(2, 64)
      nonzero = np.abs(s) > 1e-7
      assert nonzero.sum(axis=1).max() <= (1 if k == 'b' else 8)
      assert len(np.unique(np.round(s[nonzero], 5))) <= 4
      assert np.abs(np.asarray(new.error[k])).max() > 1e-3
    params, state = new_params, new
  assert int(state.num_syncs) == 3


def test_dense_unquantized_no_decay_equals_diloco_with_outer_sgd():
  inner = optax.adam(1e-2)
  dense = outer.sparseloco(inner, sync_every=3, ef_decay=0.0,
                           topk=4096, tile=8, value_codec=None)
  got, state = run_workers(dense, 7)
  want, want_state = run_workers(
      loc_opt.diloco(inner, sync_every=3, outer=optax.sgd(1.0)), 7)
  conf.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
  conf.assert_trees_close(state.anchor, want_state.anchor, rtol=1e-5,
                          atol=1e-6)
  assert int(state.num_syncs[0]) == 2
  for x in jax.tree.leaves(state.error):  # everything was sent
    assert np.abs(np.asarray(x)).max() < 1e-6


def hand_grads(step, m=M):
  # With inner SGD lr 1 from the anchor, the pseudo-gradient is the
  # gradient. Worker 0 and 1 both pick entry 0 (5 and 3), worker 2 entry 7
  # (2), worker 3 entry 9 (-4); everything else is below 0.01.
  del step
  g = np.full((m, 16), 0.001, np.float32)
  g[0, 0], g[1, 0], g[2, 7], g[3, 9] = 5.0, 3.0, 2.0, -4.0
  return {'v': jnp.asarray(g)}


@pytest.mark.parametrize('aggregate,want', [
    ('mean_of_selected', {0: 4.0, 7: 2.0, 9: -4.0}),
    ('mean_over_workers', {0: 2.0, 7: 0.5, 9: -1.0})])
def test_aggregation_on_a_hand_case(aggregate, want):
  # One 16-long segment, k = round(256 * 16 / 4096) = 1 entry per worker.
  tx = outer.sparseloco(optax.sgd(1.0), sync_every=1, ef_decay=0.0,
                        topk=256, tile=16, value_codec=None,
                        aggregate=aggregate)
  params = helpers.stack({'v': jnp.zeros((16,))})
  state = jax.vmap(tx.init)(params)
  params, state = compiled_step(tx)(params, state, hand_grads(0))
  expected = np.zeros(16, np.float32)
  for i, v in want.items():
    expected[i] = -v
  for m in range(M):
    np.testing.assert_array_equal(params['v'][m], expected)
  # What was not sent stays in each worker's buffer.
  np.testing.assert_allclose(state.error['v'][0, 1:], 0.001)
  assert float(state.error['v'][0, 0]) == 0.0


def test_learning_rate_is_applied_once():
  # Dense, unquantized, no decay, lr 0.5, one worker: the anchor moves
  # halfway to the local parameters and the buffer is emptied (the
  # reference code would move a quarter of the way: lr^2).
  tx = outer.sparseloco(optax.sgd(1.0), sync_every=1, ef_decay=0.0,
                        topk=4096, tile=8, value_codec=None,
                        learning_rate=0.5, axis_name=None)
  params = helpers.tile_params()
  grads = jax.tree.map(lambda g: g[0], helpers.tile_grads(0, 1))
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  conf.assert_trees_close(
      optax.apply_updates(params, updates),
      jax.tree.map(lambda p, g: p - 0.5 * g, params, grads))
  conf.assert_trees_close(state.error, jax.tree.map(jnp.zeros_like, grads))


def test_plan_phases_equal_the_device_decision():
  plan = outer.sparseloco_plan(2)
  assert [plan(c) for c in range(5)] == [False, True, False, True, False]
  assert plan.phases(5) == (False, True)
  want, want_state = run_workers(TX, 5)
  got, state = run_workers(TX, 5, plan=plan)
  # Equal up to XLA fusing the separate programs differently.
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
  conf.assert_trees_close(state.error, want_state.error, rtol=1e-6,
                          atol=1e-7)
  assert int(state.num_syncs[0]) == 2
  # After the sync at count 3 the workers hold the anchor (the eval
  # weights, within one rounding of theta + (phi - theta)); the step at
  # count 4 moves them apart again.
  three, three_state = run_workers(TX, 4, plan=plan)
  for m in range(M):
    conf.assert_trees_close(
        jax.tree.map(lambda x: x[m], three),
        outer.sparseloco_eval_params(
            jax.tree.map(lambda x: x[m], three_state),
            jax.tree.map(lambda x: x[m], three)), rtol=0, atol=1e-6)
  assert not np.allclose(got['w'][0], got['w'][1])


def test_shard_map_runner_matches_vmap_runner():
  want, _ = run_workers(TX, 2)
  got, state = run_workers(TX, 2, mode='shard_map')
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
  assert state.count.sharding.spec == jax.P('worker')


def test_compiled_programs_move_the_compact_payload_only():
  mesh = parallel.make_worker_mesh(M, data=2)
  shapes = {'w': (64, 128), 'b': (128,)}
  tx = outer.sparseloco(optax.sgd(0.1), sync_every=3)  # 128 / 4096
  params = {k: jnp.zeros((M,) + s) for k, s in shapes.items()}

  def report(sync):
    return helpers.phase_report(tx, params, sync, mesh)

  n = sum(int(np.prod(s)) for s in shapes.values())
  theory = outer.sparseloco_payload_bytes(
      {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()})
  # w: 2 tiles x 128 entries, b: 2 segments x 2; 12-bit indices, 2-bit
  # codes, 20 bytes of shift and table per tensor.
  assert theory == (3 * 256 // 2 + 256 // 4 + 20) + (3 * 4 // 2 + 1 + 20)
  assert report(False).cross_worker_bytes == 0
  sent = report(True).cross_worker_bytes_per_worker
  assert 0.9 * theory <= sent <= 1.1 * theory, (sent, theory)
  assert sent < 4 * n / 30, sent / (4 * n)
  # The device-decided program holds the gather in one branch only.
  cond = report(None)
  assert cond.cross_worker_bytes == 0
  low, high = cond.cross_worker_bytes_range
  assert low == 0 and 0.9 * theory * M <= high <= 1.1 * theory * M


def test_bf16_params_keep_fp32_anchor_and_buffer():
  tx = make_sparseloco(1e-2)
  state = tx.init(conf.example_params(jnp.bfloat16))
  assert state.anchor['w'].dtype == jnp.float32
  assert state.error['w'].dtype == jnp.float32


@pytest.mark.parametrize('kwargs,name', [
    ({'sync_every': 0}, 'sync_every'), ({'sync_every': 2.5}, 'sync_every'),
    ({'topk': 0}, 'topk'), ({'tile': 0}, 'tile'),
    ({'tile': 128}, 'index_dtype'), ({'ef_decay': 1.5}, 'ef_decay'),
    ({'value_codec': 'int8'}, 'value_codec'),
    ({'aggregate': 'sum'}, 'aggregate')])
def test_bad_arguments_raise(kwargs, name):
  kwargs = {'sync_every': 3, **kwargs}
  with pytest.raises(ValueError, match=name):
    outer.sparseloco(optax.sgd(0.1), **kwargs)
