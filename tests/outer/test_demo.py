"""Tests of DeMo (loc_opt.outer.demo): EF invariant, equivalences,
sign steps, identical workers, and the bytes on the compiled program."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loc_opt import outer
from loc_opt import parallel
from loc_opt.compression import dct
from tests import optax_conformance as conf
from tests.outer import _helpers as helpers

M = helpers.M
# The model is helpers.TILE_SHAPES: a 16 x 8 weight (tiles 8 x 8 at chunk
# 8) and a bias of 8, with helpers.tile_grads on every worker.


def make_demo(learning_rate):
  return outer.demo(learning_rate, topk=4, chunk=8, weight_decay=0.1,
                    axis_name=None)


def test_conformance(tmp_path):
  conf.check_all(make_demo, tmp_path)


# Shared transforms and compiled steps keep the file fast.
TX = outer.demo(0.01, topk=4, chunk=8)


@functools.lru_cache(maxsize=None)
def compiled_step(tx, mode='vmap', sync=None):
  """The jitted per-worker step of tx under vmap or shard_map."""

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params, sync=sync)
    return optax.apply_updates(params, updates), state, updates

  if mode == 'vmap':
    return jax.jit(parallel.vmap_workers(step))
  return jax.jit(parallel.shard_map_workers(
      step, parallel.make_worker_mesh(M, data=2)))


def run_workers(tx, steps, m=M, mode='vmap', sync=None):
  """Applies tx on m workers (per-worker gradients); returns params, state
  and the updates of every step."""
  fn = compiled_step(tx, mode, sync)
  params = helpers.stack(helpers.tile_params(), m)
  state = jax.vmap(tx.init)(params)
  history = []
  for i in range(steps):
    params, state, updates = fn(params, state, helpers.tile_grads(i, m))
    history.append(updates)
  return params, state, history


@pytest.mark.parametrize('form', ['lr_scaled', 'ema'])
def test_error_feedback_invariant(form):
  # One worker, no sign: the direction is the worker's own transmitted
  # reconstruction q, and beta m_old + c g == q + m_new (c = lr or 1-beta).
  lr, beta = 0.3, 0.9
  tx = outer.scale_by_demo(lr, beta=beta, topk=5, chunk=8, momentum=form,
                           sign=False, axis_name=None)
  params = helpers.tile_params()
  state = tx.init(params)
  step = jax.jit(tx.update)
  c = lr if form == 'lr_scaled' else 1 - beta
  for i in range(3):
    grads = jax.tree.map(lambda g: g[0], helpers.tile_grads(i, 1))
    q, new_state = step(grads, state, params)
    for k in helpers.TILE_SHAPES:
      np.testing.assert_allclose(
          beta * state.momentum[k] + c * grads[k],
          q[k] + new_state.momentum[k], rtol=1e-5, atol=1e-6)
      # q is sparse in the DCT domain: at most 5 coefficients per tile, and
      # the residual is not zero (something was held back).
      coeffs = np.asarray(dct.block_dct(q[k], 8))
      assert np.all(np.sum(np.abs(coeffs) > 1e-6, axis=1) <= 5)
      assert np.abs(np.asarray(new_state.momentum[k])).max() > 1e-3
    state = new_state
  assert int(state.count) == 3


@pytest.mark.parametrize('form', ['lr_scaled', 'ema'])
def test_whole_block_no_sign_is_data_parallel_sgd(form):
  # k = the whole tile: everything is sent, the residual is 0, and the
  # decoded mean is the mean LR-scaled gradient, so the step is data-parallel
  # SGD with step lr^2 (lr_scaled) or lr (1 - beta) (ema).
  lr, beta = 0.5, 0.9
  tx = outer.demo(lr, beta=beta, topk=64, chunk=8, momentum=form,
                  sign=False)
  got, state, _ = run_workers(tx, 3)
  step = lr * lr if form == 'lr_scaled' else lr * (1 - beta)
  want = helpers.tile_params()
  for i in range(3):
    mean = jax.tree.map(lambda g: g.mean(0), helpers.tile_grads(i))
    want = jax.tree.map(lambda p, g: p - step * g, want, mean)
  for m in range(M):
    conf.assert_trees_close(jax.tree.map(lambda x: x[m], got), want,
                            rtol=1e-5, atol=1e-6)
  for x in jax.tree.leaves(state[0].momentum):
    assert np.abs(np.asarray(x)).max() < 1e-5


def test_sign_step_moves_every_coordinate_by_exactly_lr():
  lr, wd = 0.01, 0.1
  # A schedule: the momentum and the step both read it at the step count.
  tx = outer.demo(optax.constant_schedule(lr), topk=4, chunk=8,
                  weight_decay=wd)
  params, _, _ = run_workers(tx, 2)
  _, _, updates = run_workers(tx, 3)
  for k in helpers.TILE_SHAPES:
    # update = -lr (sign(U) + wd theta), theta the params before the step.
    step = np.asarray(updates[-1][k]) + lr * wd * np.asarray(params[k])
    np.testing.assert_allclose(np.abs(step), lr, rtol=1e-5)


def test_workers_stay_identical_with_distinct_momenta():
  params, state, history = run_workers(TX, 3)
  momentum = state[0].momentum
  # Every worker applies the same aggregated update with the same
  # operations, in one program: bit-identical parameters.
  for m in range(1, M):
    for k in helpers.TILE_SHAPES:
      np.testing.assert_array_equal(params[k][m], params[k][0])
      assert not np.allclose(momentum[k][m], momentum[k][0])
  # Without weight decay every step is exactly +-lr per coordinate.
  for updates in history:
    for u in jax.tree.leaves(updates):
      np.testing.assert_array_equal(np.abs(u), np.float32(0.01))


def test_plan_phases_equal_the_device_decision():
  plan = outer.demo_plan()
  assert [plan(c) for c in range(5)] == [True] * 5
  assert plan.phases(5) == (False, True)
  want, _, _ = run_workers(TX, 3)
  got, _, _ = run_workers(TX, 3, sync=plan(0))
  # The static phase's program against the on-device decision's, and
  # below 4 stacked workers against one: other programs, equal to float32
  # rounding.
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
  # The no-exchange phase is the one-worker step: each worker alone.
  local, _, _ = run_workers(TX, 1, sync=False)
  alone, _, _ = run_workers(outer.demo(0.01, topk=4, chunk=8,
                                       axis_name=None), 1, m=1)
  conf.assert_trees_close(jax.tree.map(lambda x: x[:1], local), alone,
                          rtol=1e-6, atol=1e-7)
  assert not np.allclose(local['w'][0], local['w'][1])


def test_eval_params_are_the_params():
  params = helpers.tile_params()
  tx = make_demo(0.01)
  assert outer.demo_eval_params(tx.init(params), params) is params


def test_bf16_values_halve_value_bytes_and_feed_back_rounding():
  shapes = {'w': jax.ShapeDtypeStruct((128, 64), jnp.float32)}
  f32 = outer.demo_payload_bytes(shapes)
  b16 = outer.demo_payload_bytes(shapes, value_dtype=jnp.bfloat16)
  # 2 tiles x 32 coefficients: 64 x (4 + 1.5) vs 64 x (2 + 1.5) bytes.
  assert (f32, b16) == (64 * 4 + 96, 64 * 2 + 96)
  tx = outer.scale_by_demo(1.0, beta=0.5, topk=5, chunk=8, sign=False,
                           axis_name=None, value_dtype=jnp.bfloat16)
  params = helpers.tile_params()
  state = tx.init(params)
  grads = jax.tree.map(lambda g: g[0], helpers.tile_grads(0, 1))
  q, new = jax.jit(tx.update)(grads, state, params)
  coeffs = dct.block_dct(q['w'], 8)
  np.testing.assert_allclose(  # the sent coefficients sit on the bf16 grid
      coeffs.astype(jnp.bfloat16).astype(jnp.float32), coeffs, rtol=1e-4,
      atol=1e-6)
  np.testing.assert_allclose(grads['w'], q['w'] + new.momentum['w'],
                             rtol=1e-5, atol=1e-6)


def test_prime_dimension_is_sent_dense():
  # 67 has no divisor in [2, 64]: one-element tiles, each sent whole, with
  # its index: more bytes than fp32. 128 gets two 64-long segments.
  with pytest.warns(UserWarning, match='no divisor'):
    dense = outer.demo_payload_bytes(
        {'v': jax.ShapeDtypeStruct((67,), jnp.float32)})
  assert dense == 67 * 4 + 3 * 34 > 4 * 67
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    sparse = outer.demo_payload_bytes(
        {'v': jax.ShapeDtypeStruct((128,), jnp.float32)})
  assert sparse == 64 * 4 + 96


def test_shard_map_runner_matches_vmap_runner():
  want, _, _ = run_workers(TX, 2)
  got, state, _ = run_workers(TX, 2, mode='shard_map')
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
  assert state[0].count.sharding.spec == jax.P('worker')


def test_compiled_step_moves_the_compact_payload_only():
  mesh = parallel.make_worker_mesh(M, data=2)
  shapes = {'w': (64, 128), 'b': (128,)}
  tx = outer.demo(1e-3)  # topk 32 of 64 x 64, uint12 + fp32
  params = {k: jnp.zeros((M,) + s) for k, s in shapes.items()}

  def report(sync):
    return helpers.phase_report(tx, params, sync, mesh)

  n = sum(int(np.prod(s)) for s in shapes.values())
  theory = outer.demo_payload_bytes(
      {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()})
  # w: 2 tiles x 32; b: 2 segments x 32 (k clipped at the tile, not scaled).
  assert theory == (2 * 32 + 2 * 32) * 4 + 3 * (2 * 32 + 2 * 32) // 2
  sent = report(True).cross_worker_bytes_per_worker
  assert 0.9 * theory <= sent <= 1.1 * theory, (sent, theory)
  assert sent < 4 * n / 40  # an fp32 all-reduce sends about 2 x 4n
  assert report(False).cross_worker_bytes == 0


@pytest.mark.parametrize('kwargs,name', [
    ({'topk': 0}, 'topk'), ({'chunk': 0}, 'chunk'),
    ({'momentum': 'nesterov'}, 'momentum'), ({'beta': 1.0}, 'beta'),
    ({'index_dtype': 'uint7'}, 'index_dtype'),
    ({'chunk': 128}, 'index_dtype'), ({'value_dtype': jnp.int8}, 'value_dtype'),
    ({'aggregate': 'sum'}, 'aggregate')])
def test_bad_arguments_raise(kwargs, name):
  with pytest.raises(ValueError, match=name):
    outer.demo(0.01, **kwargs)
