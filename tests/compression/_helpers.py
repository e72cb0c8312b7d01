"""Helpers shared by the compression tests (not a test module).

Per-worker data, runners of a compressor's ``mean`` under ``jax.vmap`` over a
named worker axis, and the check that a compressor's mean under
``jax.shard_map`` on a 4 x 2 mesh equals the simulated one.
"""

import jax
import jax.numpy as jnp
import numpy as np

from loc_opt import compression
from loc_opt import parallel

W = 4  # workers


def normal(seed, shape):
  """Standard normal test data from NumPy (cheaper than compiling PRNGs)."""
  return jnp.asarray(
      np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def mean_runner(compressor):
  """``(tree, state, key) -> (mean, sent, state)`` of ``compressor.mean``
  over stacked per-worker trees and states, jitted; ``key`` is shared."""
  comm = compression.Comm('worker')
  return jax.jit(jax.vmap(lambda t, s, k: compressor.mean(t, s, comm, k),
                          in_axes=(0, 0, None), axis_name='worker'))


def one_mean(scheme, x, state):
  """``scheme.mean`` of the per-worker values ``x`` under vmap."""
  comm = compression.Comm('worker')
  key = jax.random.key(3)
  fn = jax.vmap(lambda v, s: scheme.mean(v, s, comm, key), axis_name='worker')
  # One compiled program, not one per primitive (op-by-op dispatch compiles
  # every primitive at every shape it meets).
  return jax.jit(fn)(x, state)


def mesh_step(tx, mesh, n=8192):
  """A compiled per-worker step applying ``tx`` on a mesh, and its inputs."""
  params = {'w': jnp.zeros((W, n // 64, 64)), 'b': jnp.zeros((W, 64))}
  sharding = jax.NamedSharding(mesh, jax.P('worker'))
  params = jax.device_put(params, sharding)
  state = jax.jit(jax.vmap(tx.init))(params)
  grads = jax.device_put(
      jax.tree.map(lambda p: jax.random.normal(jax.random.key(1), p.shape),
                   params), sharding)
  fn = jax.jit(parallel.shard_map_workers(
      lambda g, s, p: tx.update(g, s, p), mesh))
  return fn, (grads, state, params)


def sharded_mean(compressor, tree):
  """The stateless mean of per-worker ``tree`` on a 4 x 2 worker mesh.

  Returns:
    ``(got, want, report)``: the mean under ``shard_map``, the same mean
    simulated under ``vmap``, and the compiled program's
    :class:`~loc_opt.parallel.CollectiveReport`.
  """
  mesh = parallel.make_worker_mesh(4, data=2)

  def mean(t):
    return compression.compressed_mean(t, compressor, 'worker')

  sharded = jax.device_put(tree, jax.NamedSharding(mesh, jax.P('worker')))
  fn = jax.jit(parallel.shard_map_workers(mean, mesh))
  report = parallel.collective_bytes(fn.lower(sharded).compile(), mesh)
  want = jax.jit(jax.vmap(mean, axis_name='worker'))(tree)
  return fn(sharded), want, report


def worker_slice(tree):
  """One worker's slice of a per-worker tree."""
  return jax.tree.map(lambda x: x[0], tree)
