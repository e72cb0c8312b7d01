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


@pytest.mark.parametrize('inner', [dict(data=8), dict(fsdp=4, data=2)])
def test_one_worker_on_many_devices(inner):
  """M = 1 on a multi-device mesh: collectives over the size-1 worker axis
  would reach XLA as cross-partition all-reduces outside manual mode (a
  compile error); the runner makes them the identity."""
  import optax  # pylint: disable=g-import-not-at-top
  import loc_opt  # pylint: disable=g-import-not-at-top
  mesh = parallel.make_worker_mesh(1, **inner)
  tx = loc_opt.diloco(optax.sgd(0.1), sync_every=1,
                      reduce_fn=parallel.worker_mean())

  def step(p, s, g):
    u, s = tx.update(g, s, p, sync=True)
    return optax.apply_updates(p, u), s

  params = {'w': jnp.linspace(-1., 1., 128).reshape(1, 16, 8)}
  state = jax.vmap(tx.init)(params)
  got, _ = jax.jit(parallel.shard_map_workers(step, mesh))(
      params, state, params)
  want, _ = jax.jit(parallel.vmap_workers(step))(params, state, params)
  # sgd 0.1, then Nesterov outer (0.7, 0.9): w - 0.7 * 1.9 * 0.1 w.
  np.testing.assert_allclose(got['w'], want['w'], rtol=1e-6)
  np.testing.assert_allclose(got['w'], params['w'] * (1 - 0.133), rtol=1e-5)


def test_shard_map_runner_errors():
  mesh = parallel.make_worker_mesh(4, data=2)
  with pytest.raises(ValueError, match="no worker axis 'replica'"):
    parallel.shard_map_workers(lambda x: x, mesh, axis_name='replica')
  run = parallel.shard_map_workers(lambda x: x, mesh, in_axes=(1,))
  with pytest.raises(ValueError, match='in_axes entries must be 0'):
    run(jnp.ones((4, 2)))
