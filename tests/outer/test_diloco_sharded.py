"""Tests of diloco(outer_state_layout='sharded'): equal to the replicated
layout, a reduce-scatter + all-gather sync, 1/M of the state per worker."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import parallel
from loc_opt.outer import _sharded
from tests import optax_conformance as conf
from tests.outer import _helpers as helpers

M = helpers.M


def make(layout, **kwargs):
  return loc_opt.diloco(optax.adam(3e-2), sync_every=3,
                        outer_state_layout=layout, **kwargs)


def train(layout, steps, runner=parallel.vmap_workers, present=None,
          tx=None):
  """Trains M workers of the 4 -> 3 model (``w`` 4 x 3 and ``b`` 3: ``b``
  pads to 4 rows) with ``tx`` (default ``make(layout)``); returns
  (stacked params, state, eval params)."""
  tx = make(layout) if tx is None else tx

  def step(params, state, batch, present):
    grads = jax.grad(helpers.quad_loss)(params, batch)
    updates, state = tx.update(grads, state, params, present=present)
    return optax.apply_updates(params, updates), state

  def evaluate(state, params):
    return loc_opt.diloco_eval_params(state, params,
                                      outer_state_layout=layout)

  axes = (0, 0, 0, None if present is None else 0)
  fn = jax.jit(runner(step, in_axes=axes))
  params = helpers.stack(conf.example_params())
  # A one-element tuple: the runner maps a bare NamedTuple as outputs.
  (state,) = jax.jit(runner(lambda p: (tx.init(p),)))(params)
  for i in range(steps):
    params, state = fn(params, state, helpers.worker_batches(i), present)
  return params, state, jax.jit(runner(evaluate))(state, params)


def test_state_holds_one_shard_per_worker():
  _, state, _ = train('sharded', 0)
  assert state.anchor['w'].shape == (M, 1, 3)  # 4 rows / 4
  assert state.anchor['b'].shape == (M, 1)  # 3 rows padded to 4
  assert state.outer_state[0].trace['w'].shape == (M, 1, 3)
  # The shards, in order, are the parameters' rows.
  np.testing.assert_array_equal(
      state.anchor['w'].reshape(4, 3), conf.example_params()['w'])


@pytest.mark.parametrize('runner', ['vmap', 'shard_map'])
def test_equals_replicated_over_several_syncs(runner):
  runner = (parallel.vmap_workers if runner == 'vmap' else functools.partial(
      parallel.shard_map_workers, mesh=helpers.worker_mesh()))
  got, state, got_eval = train('sharded', 10, runner)
  want, want_state, want_eval = train('replicated', 10, runner)
  assert int(state.num_syncs[0]) == 3
  conf.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
  conf.assert_trees_close(got_eval, want_eval, rtol=1e-5, atol=1e-6)
  # The Nesterov momentum shards are the replicated momentum's pieces.
  trace = want_state.outer_state[0].trace['w'][0].reshape(M, 1, 3)
  np.testing.assert_allclose(state.outer_state[0].trace['w'], trace,
                             rtol=1e-4, atol=1e-6)
  assert float(jnp.abs(trace).max()) > 1e-3  # momentum is not zero


def test_dropout_equals_replicated():
  present = jnp.asarray([True, False, True, True])
  got, state, _ = train('sharded', 6, present=present)
  want, want_state, _ = train('replicated', 6, present=present)
  conf.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(state.left_out, want_state.left_out)
  np.testing.assert_array_equal(state.left_out, [0, 2, 0, 0])


def test_nonfinite_worker_left_out():
  tx = make('sharded')
  params = helpers.stack(conf.example_params())
  state = jax.jit(parallel.vmap_workers(tx.init))(params)
  grads = jax.tree.map(jnp.ones_like, params)
  grads['b'] = grads['b'].at[1, 0].set(jnp.nan)

  @jax.jit
  @parallel.vmap_workers
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params, sync=True)
    return optax.apply_updates(params, updates), state

  params, state = step(params, state, grads)
  assert bool(jnp.all(jnp.isfinite(params['b'])))
  np.testing.assert_array_equal(state.left_out, [0, 1, 0, 0])


def test_sync_is_reduce_scatter_and_all_gather():
  """The sync's operands: the reduce-scatter sends what the replicated
  all-reduce sends (plus padding), the all-gather 1/M of it; a ring
  all-reduce is these two halves, so the wire bytes are equal."""
  params = helpers.stack({'w': jnp.zeros((64, 32)), 'b': jnp.zeros((30,))})
  mesh = helpers.worker_mesh()

  def report(layout, sync):
    tx = loc_opt.diloco(optax.sgd(0.1), sync_every=2,
                        outer_state_layout=layout)
    return helpers.phase_report(tx, params, sync, mesh)

  sharded = report('sharded', True).by_kind(True)
  replicated = report('replicated', True).by_kind(True)
  devices = 8
  padding = 2 * 4 * devices  # b: 30 -> 32 fp32 elements, on every device
  assert replicated == {'all-reduce': (64 * 32 + 30) * 4 * devices}
  assert sharded['reduce-scatter'] == replicated['all-reduce'] + padding
  assert sharded['all-gather'] * M == sharded['reduce-scatter']
  assert sharded['all-reduce'] == 4 * devices  # the present count
  assert report('sharded', False).cross_worker_bytes_range == (0, 0)
  # Deciding on device: the sync's collectives only in its cond branch.
  cond = report('sharded', None)
  assert cond.cross_worker_bytes == 0
  (branches,) = cond.branches.values()
  assert sorted(branches) == [0, sum(sharded.values())]


def test_refuses_what_it_cannot_shard():
  for kwargs in ({'codec': 'int8'}, {'aggregate': 'median'},
                 {'axis_name': None}, {'reduce_fn': lambda t: t}):
    with pytest.raises(ValueError, match='sharded'):
      make('sharded', **kwargs)
  with pytest.raises(ValueError, match='outer_state_layout'):
    make('zero')
  with pytest.raises(NameError, match='worker'):
    make('sharded').init(conf.example_params())


def test_state_bytes():
  params = {'w': jnp.zeros((64, 32)), 'b': jnp.zeros((30,))}
  replicated = _sharded.state_bytes(params, M, layout='replicated')
  sharded = _sharded.state_bytes(params, M, layout='sharded')
  assert replicated == 2 * (64 * 32 + 30) * 4  # anchor + momentum
  assert sharded == 2 * (64 // M * 32 + 8) * 4
  # Agrees with the state init builds.
  tx = make('sharded')
  state = jax.eval_shape(parallel.vmap_workers(tx.init), helpers.stack(params))
  built = sum(x.size * x.dtype.itemsize
              for x in jax.tree.leaves((state.anchor, state.outer_state)))
  assert built == M * sharded
  # Within a worker: divided like the parameters (replicated layout).
  split = loc_opt.outer.outer_state_bytes(
      params, M, layout='replicated', divisors={'w': 2, 'b': 1})
  assert split == 2 * (64 * 32 // 2 + 30) * 4


def test_local_sgd_sharded_equals_replicated():
  def tx(layout):
    return loc_opt.local_sgd(optax.sgd(0.1), sync_every=2,
                             outer_state_layout=layout)

  got, _, _ = train('sharded', 4, tx=tx('sharded'))
  want, _, _ = train('replicated', 4, tx=tx('replicated'))
  conf.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('inside', ['fsdp', 'data'])
def test_param_specs_send_each_devices_block(inside):
  """With FSDP inside a worker, GSPMD gathers a leaf inside the worker
  before the reduce-scatter (every device sends it whole); with
  ``param_specs`` each device reduce-scatters and all-gathers its own block
  (manual over the axes inside the worker), and data-parallel replicas
  each send half of theirs: the same values, half the leaf per
  device in both cases. ``b`` (30 rows, not a multiple of M) keeps the
  gathered path. (Two programs with other collectives: compared to float32
  rounding, bit for bit on some CPUs.)"""
  mesh = parallel.make_worker_mesh(M, **{inside: 2})
  params = helpers.stack({'w': jax.random.normal(jax.random.key(0),
                                                 (64, 32)),
                          'b': jnp.arange(30.)})
  params = jax.tree.map(lambda x: x * (1 + jnp.arange(M).reshape(
      (M,) + (1,) * (x.ndim - 1))), params)  # the workers differ
  specs = {'w': jax.P('fsdp'), 'b': jax.P()}
  split = {'w': jax.NamedSharding(mesh, jax.P(parallel.WORKER, 'fsdp')),
           'b': jax.NamedSharding(mesh, jax.P(parallel.WORKER))}
  params = jax.device_put(params, split)

  def compiled(layout, param_specs=None):
    kwargs = {} if param_specs is None else {'param_specs': param_specs}
    tx = loc_opt.diloco(optax.sgd(0.1), sync_every=2,
                        outer_state_layout=layout, **kwargs)
    (state,) = jax.jit(parallel.vmap_workers(lambda p: (tx.init(p),)))(
        params)

    def step(params, state, grads):
      updates, state = tx.update(grads, state, params, sync=True)
      return optax.apply_updates(params, updates), state

    fn = jax.jit(parallel.shard_map_workers(step, mesh),
                 in_shardings=(split, None, split))
    program = fn.lower(params, state, params).compile()
    return program(params, state, params), parallel.collective_bytes(
        program, mesh)

  (got, got_state), blocks = compiled('sharded', specs)
  (want, want_state), gathered = compiled('sharded')
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
  conf.assert_trees_close(got_state, want_state, rtol=1e-6, atol=1e-7)
  devices, b_rows = 8, 32  # b: 30 -> 32 fp32 rows, whole on every device
  sent = blocks.by_kind(True)
  assert sent['reduce-scatter'] == (64 * 32 // 2 + b_rows) * 4 * devices
  assert sent['all-gather'] * M == sent['reduce-scatter']
  # Without the specs w crosses whole from both of its devices.
  assert gathered.by_kind(True)['reduce-scatter'] == \
      (64 * 32 + b_rows) * 4 * devices
  if inside == 'fsdp':  # and after a gather inside the worker
    _, replicated = compiled('replicated')
    assert replicated.by_kind(True) == {
        'all-reduce': (64 * 32 // 2 + 30) * 4 * devices}
    assert 'all-gather' in gathered.by_kind(False)
    assert 'all-gather' not in blocks.by_kind(False)
