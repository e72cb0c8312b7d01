"""Tests of loc_opt.diloco: conformance, equivalences, analytic cases."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import compression
from loc_opt import parallel
from tests import optax_conformance as conf
from tests.outer import _helpers as helpers

M = helpers.M


def make_diloco(learning_rate, sync_every=3):
  return loc_opt.diloco(optax.adam(learning_rate), sync_every=sync_every,
                        axis_name=None)


def test_conformance(tmp_path):
  conf.check_all(make_diloco, tmp_path)


def test_conformance_sync_every_step(tmp_path):
  conf.check_all(functools.partial(make_diloco, sync_every=1), tmp_path,
                 inject=False)


def test_inject_hyperparams_on_inner():
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  tx = loc_opt.diloco(inner, sync_every=10, axis_name=None)
  params = conf.example_params()
  state = tx.init(params)
  grads = conf.example_grads(params, 0)
  u1, _ = tx.update(grads, state, params)
  state.inner_state.hyperparams['learning_rate'] = jnp.asarray(0.3)
  u2, _ = tx.update(grads, state, params)
  conf.assert_trees_close(jax.tree.map(lambda x: 3 * x, u1), u2)


def test_one_worker_plain_outer_equals_inner_alone():
  inner = optax.adam(1e-2)
  tx = loc_opt.diloco(inner, sync_every=3, outer=optax.sgd(1.0))
  got, state = helpers.run_workers(tx, 10, m=1)
  want = conf.example_params()
  inner_state = inner.init(want)
  for i in range(10):
    batch = jax.tree.map(lambda x: x[0], helpers.worker_batches(i, 1))
    g = jax.grad(helpers.quad_loss)(want, batch)
    u, inner_state = inner.update(g, inner_state, want)
    want = optax.apply_updates(want, u)
  conf.assert_trees_close(jax.tree.map(lambda x: x[0], got), want)
  assert int(state.num_syncs[0]) == 3


def test_plain_outer_is_parameter_averaging():
  inner = optax.adam(1e-2)
  tx = loc_opt.diloco(inner, sync_every=4, outer=optax.sgd(1.0))
  got, _ = helpers.run_workers(tx, 4)
  # Each worker alone for 4 steps, then average the parameters.
  finals = []
  for m in range(M):
    p = conf.example_params()
    s = inner.init(p)
    for i in range(4):
      batch = jax.tree.map(lambda x: x[m], helpers.worker_batches(i))
      u, s = inner.update(jax.grad(helpers.quad_loss)(p, batch), s, p)
      p = optax.apply_updates(p, u)
    finals.append(p)
  want = jax.tree.map(lambda *xs: sum(xs) / M, *finals)
  for m in range(M):
    conf.assert_trees_close(jax.tree.map(lambda x: x[m], got), want)
  # local_sgd is this transform: the same step jaxpr, so bit-identical.
  alias_tx = loc_opt.local_sgd(inner, sync_every=4)
  assert helpers.step_jaxpr(alias_tx) == helpers.step_jaxpr(tx)
  alias, _ = helpers.run_workers(alias_tx, 4)
  conf.assert_trees_close(alias, got, rtol=0, atol=0)


def test_sync_every_step_with_sgd_is_data_parallel_sgd():
  tx = loc_opt.diloco(optax.sgd(0.1), sync_every=1, outer=optax.sgd(1.0))
  got, _ = helpers.run_workers(tx, 5)
  want = conf.example_params()
  for i in range(5):
    grads = jax.vmap(jax.grad(helpers.quad_loss), in_axes=(None, 0))(
        want, helpers.worker_batches(i))
    mean = jax.tree.map(lambda g: g.mean(0), grads)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, want, mean)
  for m in range(M):
    conf.assert_trees_close(jax.tree.map(lambda x: x[m], got), want)


def test_nesterov_outer_step_arithmetic():
  # Inner SGD lr 1 on gradient 1 moves theta by -1, so delta = phi - theta' =
  # +1 on every worker; from zero momentum the Nesterov step is
  # -0.7 * (1 + 0.9 * 1) = -1.33.
  tx = loc_opt.diloco(optax.sgd(1.0), sync_every=1)

  def step(params, state):
    grads = jax.tree.map(jnp.ones_like, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = helpers.stack({'w': jnp.zeros((3,))})
  state = jax.vmap(tx.init)(params)
  params, state = jax.jit(parallel.vmap_workers(step))(params, state)
  np.testing.assert_allclose(params['w'], -1.33, rtol=1e-6)
  np.testing.assert_allclose(state.anchor['w'], -1.33, rtol=1e-6)


def test_pseudo_gradient_sign_moves_anchor_toward_workers():
  tx = loc_opt.diloco(optax.adam(1e-2), sync_every=3, outer=optax.sgd(0.5))
  before = helpers.stack(conf.example_params())
  local, _ = helpers.run_workers(
      loc_opt.diloco(optax.adam(1e-2), sync_every=10**6), 3)
  got, state = helpers.run_workers(tx, 3)
  mean_local = jax.tree.map(lambda x: x.mean(0), local)
  # lr 0.5: the anchor moves halfway from the start to the workers' mean.
  want = jax.tree.map(lambda b, l: 0.5 * b[0] + 0.5 * l, before, mean_local)
  conf.assert_trees_close(jax.tree.map(lambda x: x[0], got), want)
  conf.assert_trees_close(jax.tree.map(lambda x: x[0], state.anchor), want)


def test_workers_identical_after_sync_and_distinct_between():
  tx = loc_opt.diloco(optax.adam(1e-2), sync_every=3)
  p2, _ = helpers.run_workers(tx, 2)
  assert not np.allclose(p2['w'][0], p2['w'][1])
  p3, _ = helpers.run_workers(tx, 3)
  for m in range(1, M):
    np.testing.assert_allclose(p3['w'][m], p3['w'][0], atol=1e-7)


def test_static_sync_programs_equal_cond_program():
  tx = loc_opt.diloco(optax.adam(1e-2), sync_every=3)

  def step(params, state, batch, sync):
    grads = jax.grad(helpers.quad_loss)(params, batch)
    updates, state = tx.update(grads, state, params, sync=sync)
    return optax.apply_updates(params, updates), state

  programs = {s: jax.jit(parallel.vmap_workers(
      functools.partial(step, sync=s), in_axes=(0, 0, 0)))
              for s in (True, False)}
  params = helpers.stack(conf.example_params())
  state = jax.vmap(tx.init)(params)
  for i in range(7):
    sync = loc_opt.outer.next_step_syncs(3, i, i % 3)
    params, state = programs[sync](params, state, helpers.worker_batches(i))
  want, want_state = helpers.run_workers(tx, 7)
  # Static-phase programs against the lax.cond program: other programs,
  # equal to float32 rounding (as helpers.check_plan_matches_cond).
  conf.assert_trees_close(params, want, rtol=1e-6, atol=1e-7)
  assert int(state.num_syncs[0]) == int(want_state.num_syncs[0]) == 2


def test_sync_every_schedule_equals_int():
  a, _ = helpers.run_workers(
      loc_opt.diloco(optax.adam(1e-2), sync_every=2), 6)
  b, _ = helpers.run_workers(
      loc_opt.diloco(optax.adam(1e-2), sync_every=lambda count: 2), 6)
  # The schedule's period is computed in the program: another program,
  # equal to float32 rounding.
  conf.assert_trees_close(a, b, rtol=1e-6, atol=1e-7)
  # Another period trains elsewhere: the check bites.
  c, _ = helpers.run_workers(
      loc_opt.diloco(optax.adam(1e-2), sync_every=lambda count: 3), 6)
  assert not np.allclose(c['w'], a['w'], rtol=1e-6, atol=1e-7)


def test_shard_map_runner_matches_vmap_runner():
  tx = loc_opt.diloco(optax.adam(1e-2), sync_every=3)
  want, _ = helpers.run_workers(tx, 5)
  got, state = helpers.run_sharded(tx, 5)
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
  assert state.count.sharding.spec == jax.P('worker')


def test_bf16_params_keep_fp32_anchor():
  tx = make_diloco(1e-2)
  state = tx.init(conf.example_params(jnp.bfloat16))
  assert state.anchor['w'].dtype == jnp.float32


@pytest.mark.parametrize('bad', [0, -3])
def test_sync_every_must_be_positive(bad):
  with pytest.raises(ValueError, match='sync_every'):
    loc_opt.diloco(optax.sgd(0.1), sync_every=bad)


@pytest.mark.parametrize('bad', [2.5, '10', True])
def test_sync_every_must_be_int(bad):
  with pytest.raises(TypeError, match='sync_every'):
    loc_opt.diloco(optax.sgd(0.1), sync_every=bad)


def test_cond_program_has_the_sync_collective_only_in_one_branch():
  mesh = parallel.make_worker_mesh(M, data=2)
  tx = loc_opt.diloco(optax.adam(1e-2), sync_every=3)

  def step(params, state, batch):
    grads = jax.grad(helpers.quad_loss)(params, batch)
    updates, state = tx.update(grads, state, params)  # lax.cond on the count
    return optax.apply_updates(params, updates), state

  params = helpers.stack(conf.example_params())
  state = jax.vmap(tx.init)(params)
  compiled = jax.jit(parallel.shard_map_workers(step, mesh)).lower(
      params, state, helpers.worker_batches(0)).compile()
  report = parallel.collective_bytes(compiled, mesh)
  n = sum(x[0].size for x in jax.tree.leaves(params))
  assert report.cross_worker_bytes == 0  # nothing crosses unconditionally
  # The sync branch all-reduces the fp32 pseudo-gradient on all 8 devices
  # (a plain pmean: each data replica sends its copy); the inner branch
  # moves nothing. Inside the sync branch, the recovery round for a
  # non-finite mean (the values again, with each worker's weight) is a
  # conditional of its own, taken only when the mean is not finite.
  plain, recovery = 4 * n * 8, 4 * (n + 1) * 8
  assert sorted(sorted(b) for b in report.branches.values()) == [
      [0, recovery], [0, plain + recovery]]
  assert report.cross_worker_bytes_range == (0, plain + recovery)


# ------------------------------------------------- dropout and non-finite ---
def _one_sync(tx, grads, present=None, mesh=None):
  """One sync step (H=1, sgd inner) of M workers from identical params
  with per-worker ``grads``; ``present`` per worker or None."""
  params = helpers.stack(conf.example_params())
  state = jax.vmap(tx.init)(params)

  def step(params, state, grads, present):
    updates, state = tx.update(grads, state, params, sync=True,
                               present=present)
    return optax.apply_updates(params, updates), state

  if mesh is None:
    run = jax.vmap(step, axis_name='worker',
                   in_axes=(0, 0, 0, None if present is None else 0))
  else:
    run = parallel.shard_map_workers(
        step, mesh, in_axes=(0, 0, 0, None if present is None else 0))
  return jax.jit(run)(params, state, grads, present)


def _worker_grads(bad=None):
  grads = helpers.stack(conf.example_params())
  grads = jax.tree.map(
      lambda g: g * jnp.arange(1., M + 1).reshape((M,) + (1,) * (g.ndim - 1)),
      grads)
  if bad is not None:
    grads['w'] = grads['w'].at[bad].set(jnp.nan)
  return grads


def _expected_anchor(grads, workers, lr=0.1, outer_lr=0.7):
  """Plain outer SGD after one inner SGD step: the anchor minus ``outer_lr``
  times the mean over ``workers`` of ``lr * grad``."""
  params = conf.example_params()
  return jax.tree.map(
      lambda p, g: p - outer_lr * lr * jnp.mean(g[jnp.asarray(workers)], 0),
      params, grads)


def test_absent_worker_is_left_out_of_the_mean_and_rejoins_at_the_anchor():
  tx = loc_opt.diloco(optax.sgd(0.1), sync_every=1, outer=optax.sgd(0.7))
  grads = _worker_grads()
  present = jnp.asarray([True, False, True, True])
  params, state = _one_sync(tx, grads, present)
  want = _expected_anchor(grads, [0, 2, 3])
  for m in range(M):  # every worker, the absent one too, is at the anchor
    conf.assert_trees_close(helpers.worker(params, m), want, rtol=1e-6)
  np.testing.assert_array_equal(state.left_out, [0, 1, 0, 0])
  # All present: the plain mean (no worker left out).
  params, state = _one_sync(tx, grads, jnp.ones([M], bool))
  conf.assert_trees_close(helpers.worker(params, 0),
                          _expected_anchor(grads, range(M)), rtol=1e-6)
  np.testing.assert_array_equal(state.left_out, [0] * M)


def test_no_worker_present_leaves_the_anchor_where_it_was():
  tx = loc_opt.diloco(optax.sgd(0.1), sync_every=1, outer=optax.sgd(0.7))
  params, state = _one_sync(tx, _worker_grads(), jnp.zeros([M], bool))
  conf.assert_trees_close(helpers.worker(params, 2), conf.example_params())
  np.testing.assert_array_equal(state.left_out, [1] * M)


@pytest.mark.parametrize('on_mesh', [False, True])
def test_non_finite_pseudo_gradient_is_left_out(on_mesh):
  mesh = parallel.make_worker_mesh(M, data=2) if on_mesh else None
  reduce_fn = parallel.worker_mean() if on_mesh else None
  tx = loc_opt.diloco(optax.sgd(0.1), sync_every=1, outer=optax.sgd(0.7),
                      reduce_fn=reduce_fn)
  grads = _worker_grads(bad=2)
  params, state = _one_sync(tx, grads, mesh=mesh)
  want = _expected_anchor(grads, [0, 1, 3])
  for m in range(M):  # the NaN worker is reset to the finite anchor
    conf.assert_trees_close(helpers.worker(params, m), want, rtol=1e-6)
  np.testing.assert_array_equal(state.left_out, [0, 0, 1, 0])


@pytest.mark.parametrize('inside', [None, 'data', 'fsdp'])
def test_leafwise_recovery_equals_the_tree_recovery(inside):
  """The fp32 codec (elementwise) recovers from a NaN worker leaf by leaf
  (one conditional per leaf, issue 46); the values, the left-out count and
  a finite sync are those of the plain pmean's whole-tree recovery (to
  float32 rounding: a conditional per leaf is another program)."""
  mesh = parallel.make_worker_mesh(M, **{inside: 2}) if inside else None
  assert compression.as_compressor(compression.identity()).elementwise
  for bad in (2, None):
    grads = _worker_grads(bad=bad)
    got = _one_sync(loc_opt.diloco(
        optax.sgd(0.1), sync_every=1, outer=optax.sgd(0.7),
        codec=compression.identity()), grads, mesh=mesh)
    want = _one_sync(loc_opt.diloco(
        optax.sgd(0.1), sync_every=1, outer=optax.sgd(0.7)), grads, mesh=mesh)
    conf.assert_trees_close(got[0], want[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got[1].left_out, want[1].left_out)
    assert int(got[1].left_out.sum()) == (bad is not None)


@pytest.mark.parametrize('aggregate', ['mean', 'median'])
def test_a_worker_whose_parameters_went_nan_rejoins_at_the_anchor(aggregate):
  # Worker 2's gradient is NaN on inner step 0, so its parameters are NaN
  # from then on; every sync leaves it out. optax.apply_updates cannot
  # bring it back (NaN + (anchor - NaN) is NaN); diloco_apply_updates sets
  # it to the anchor exactly, and it trains on with the others.
  tx = loc_opt.diloco(optax.sgd(0.1), sync_every=2, aggregate=aggregate)

  def run(apply, steps=6):
    params = helpers.stack(conf.example_params())
    state = jax.vmap(tx.init)(params)

    def step(p, s, batch, t):
      g = jax.grad(helpers.quad_loss)(p, batch)
      bad = (jax.lax.axis_index('worker') == 2) & (t == 0)
      g = jax.tree.map(lambda x: jnp.where(bad, jnp.nan, x), g)
      u, s = tx.update(g, s, p)
      return apply(p, u, s), s

    f = jax.jit(jax.vmap(step, axis_name='worker', in_axes=(0, 0, 0, None)))
    for t in range(steps):
      params, state = f(params, state, helpers.worker_batches(t), t)
    return params, state

  plain, _ = run(lambda p, u, s: optax.apply_updates(p, u))
  assert np.isnan(plain['w'][2]).all()  # the library loop loses it
  params, state = run(loc_opt.diloco_apply_updates)
  # after the last sync (step 5) every worker is exactly at the anchor
  for m in range(M):
    for got, want in zip(jax.tree.leaves(helpers.worker(params, m)),
                         jax.tree.leaves(helpers.worker(state.anchor, m))):
      np.testing.assert_array_equal(got, want)
  assert np.isfinite(params['w']).all()
  # left out of the first sync only: it rejoined and took part after
  np.testing.assert_array_equal(state.left_out, [0, 0, 1, 0])
  mid, _ = run(loc_opt.diloco_apply_updates, steps=3)
  assert np.isfinite(mid['w'][2]).all()  # an inner step from the anchor


def test_a_huge_worker_lands_on_the_anchor_exactly():
  # a worker far from the anchor (1e9 away), left out of the sync: its
  # update anchor - params loses the anchor's digits in float32
  tx = loc_opt.diloco(optax.sgd(0.1), sync_every=1, outer=optax.sgd(0.7),
                      axis_name=None)
  params = jax.tree.map(lambda x: x + 1e9, conf.example_params())
  state = tx.init(conf.example_params())
  grads = jax.tree.map(jnp.zeros_like, params)
  u, state = tx.update(grads, state, params, present=jnp.bool_(False))
  approx = optax.apply_updates(params, u)
  assert not np.array_equal(approx['w'], state.anchor['w'])  # rounding
  exact = loc_opt.diloco_apply_updates(params, u, state)
  np.testing.assert_array_equal(exact['w'], state.anchor['w'])
  # an inner step (no sync) is optax.apply_updates
  tx2 = loc_opt.diloco(optax.sgd(0.1), sync_every=2, axis_name=None)
  p = conf.example_params()
  s = tx2.init(p)
  g = jax.tree.map(jnp.ones_like, p)
  u, s = tx2.update(g, s, p)
  conf.assert_trees_close(loc_opt.diloco_apply_updates(p, u, s),
                          optax.apply_updates(p, u), rtol=0, atol=0)


def test_absent_worker_keeps_its_codec_state():
  tx = loc_opt.diloco(optax.sgd(0.1), sync_every=1, outer=optax.sgd(0.7),
                      codec=compression.error_feedback(
                          compression.as_compressor(compression.int8())))
  grads = _worker_grads()
  present = jnp.asarray([True, True, False, True])
  params, state = _one_sync(tx, grads, present)
  errors = jax.tree.leaves(state.codec_state.error)
  for e in errors:  # the absent worker sent nothing: its buffer stays zero
    np.testing.assert_array_equal(e[2], jnp.zeros_like(e[2]))
    assert float(jnp.max(jnp.abs(e[0]))) > 0  # the others kept a residual
  conf.assert_trees_close(helpers.worker(params, 2),
                          _expected_anchor(grads, [0, 1, 3]), rtol=2e-2,
                          atol=1e-3)


def test_methods_without_dropout_refuse_present():
  tx = loc_opt.eager_diloco(optax.sgd(0.1), sync_every=1, axis_name=None)
  params = conf.example_params()
  with pytest.raises(ValueError, match='does not support worker dropout'):
    tx.update(params, tx.init(params), params, sync=True,
              present=jnp.bool_(True))
