"""The two per-worker runners: vmap and shard_map over the worker axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loc_opt import parallel


def test_runners_agree_and_share_unmapped_arguments():
  mesh = parallel.make_worker_mesh(4, data=2)

  def fn(x, scale):
    return jax.lax.pmean(x * scale, 'worker'), x.sum() * scale

  x = jnp.arange(12.0).reshape(4, 3)
  kw = dict(in_axes=(0, None), out_axes=(None, 0))
  a = jax.jit(parallel.vmap_workers(fn, **kw))(x, 2.0)
  b = jax.jit(parallel.shard_map_workers(fn, mesh, **kw))(x, 2.0)
  np.testing.assert_allclose(a[0], 2 * x.mean(0))
  np.testing.assert_allclose(a[1], 2 * x.sum(1))
  for u, v in zip(a, b):
    np.testing.assert_allclose(u, v)


def test_shard_map_runner_errors():
  mesh = parallel.make_worker_mesh(4, data=2)
  with pytest.raises(ValueError, match="no worker axis 'replica'"):
    parallel.shard_map_workers(lambda x: x, mesh, axis_name='replica')
  run = parallel.shard_map_workers(lambda x: x, mesh, in_axes=(1,))
  with pytest.raises(ValueError, match='in_axes entries must be 0'):
    run(jnp.ones((4, 2)))
