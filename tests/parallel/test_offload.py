"""Tests of loc_opt.parallel.offload: DiLoCo's outer state on the host."""

import jax
import numpy as np
import optax

import loc_opt
from loc_opt import parallel
from tests import optax_conformance as conf
from tests.outer import _helpers as helpers


def test_offloaded_outer_state_equals_on_device():
  mesh = helpers.worker_mesh()
  tx = loc_opt.diloco(optax.adam(3e-2), sync_every=3)

  def step(params, state, batch):
    grads = jax.grad(helpers.quad_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = helpers.stack(conf.example_params())
  state = jax.vmap(tx.init)(params)
  worker = jax.NamedSharding(mesh, jax.P(parallel.WORKER))
  on_device = jax.tree.map(lambda _: worker, state)
  at_rest = parallel.host_shardings(on_device, ('anchor', 'outer_state'))
  mapped = parallel.shard_map_workers(step, mesh)
  plain = jax.jit(mapped)
  moved = jax.jit(parallel.offloaded(mapped, on_device, at_rest),
                  in_shardings=(worker, at_rest, worker),
                  out_shardings=(worker, at_rest))
  want, want_state = params, state
  got, got_state = params, jax.device_put(state, at_rest)
  for i in range(7):  # two syncs
    want, want_state = plain(want, want_state, helpers.worker_batches(i))
    got, got_state = moved(got, got_state, helpers.worker_batches(i))
  assert got_state.anchor['w'].sharding.memory_kind == 'pinned_host'
  assert got_state.inner_state[0].mu['w'].sharding.memory_kind == 'device'
  assert int(got_state.num_syncs[0]) == 2
  # The same arithmetic in another program (the host transfers around
  # it): equal to float32 rounding, bit for bit on some CPUs.
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
  conf.assert_trees_close(got_state, want_state, rtol=1e-6, atol=1e-7)
  # The syncs moved the anchor far more than that: the check bites.
  assert float(np.max(np.abs(np.asarray(got_state.anchor['w'])
                            - np.asarray(state.anchor['w'])))) > 1e-3


def test_host_arguments_tells_a_pass_through_from_a_read():
  mesh = helpers.worker_mesh()
  device = jax.NamedSharding(mesh, jax.P(parallel.WORKER))
  host = device.with_memory_kind('pinned_host')
  x = jax.ShapeDtypeStruct((mesh.shape[parallel.WORKER], 4), 'float32',
                           sharding=device)
  h = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host)

  def passes(p, a):
    return p * 2, a

  def reads(p, a):
    return p * 2, jax.device_put(jax.device_put(a, device) + 1, host)

  def compile_(fn):
    return jax.jit(fn, in_shardings=(device, host),
                   out_shardings=(device, host),
                   donate_argnums=(0, 1)).lower(x, h).compile()

  # Argument 1 rests in host memory; argument 0 is not listed. Donated,
  # a pass-through is aliased to its output: read by the output tuple only.
  assert parallel.host_arguments(compile_(passes)) == {1: ('tuple',)}
  users = parallel.host_arguments(compile_(reads))
  assert list(users) == [1] and users[1] != ('tuple',)
  with_text = parallel.host_arguments(compile_(passes).as_text())
  assert with_text == {1: ('tuple',)}
