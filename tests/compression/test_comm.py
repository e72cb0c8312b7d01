"""Collectives over the worker axis: the mesh's inner axes, packed gathers."""

import jax
import jax.numpy as jnp
import numpy as np

from loc_opt import compression
from loc_opt import parallel
from tests.compression._helpers import W


def test_inner_axes_match_the_mesh():
  assert compression.comm.INNER_AXES == parallel.mesh.INNER_AXES


def test_packed_all_gather_is_one_collective_with_the_same_result():
  tree = {'idx': jnp.arange(12, dtype=jnp.uint16).reshape(3, 4),
          'val': jnp.linspace(-1.0, 1.0, 7, dtype=jnp.float32),
          'code': jnp.arange(5, dtype=jnp.uint8),
          'shift': jnp.float32(0.5)}

  def per_worker(t):
    comm = compression.Comm('worker')
    return comm.all_gather_packed(t), comm.all_gather(t)

  # Different values on every worker.
  stacked = jax.tree.map(
      lambda x: jnp.stack([x + i for i in range(W)]).astype(x.dtype), tree)
  packed, plain = jax.jit(parallel.vmap_workers(per_worker))(stacked)
  for a, b in zip(jax.tree.leaves(packed), jax.tree.leaves(plain)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  mesh = parallel.make_worker_mesh(4, data=2)
  compiled = jax.jit(parallel.shard_map_workers(
      lambda t: per_worker(t)[0], mesh)).lower(stacked).compile()
  report = parallel.collective_bytes(compiled, mesh)
  cross = [c for c in report.collectives if c.cross_worker]
  assert [c.kind for c in cross] == ['all-gather']
  payload = 24 + 28 + 5 + 4  # bytes of the tree
  assert payload <= report.cross_worker_bytes_per_worker <= payload + 8
