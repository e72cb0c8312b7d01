"""The compressed all-reduce: build_compressor and the gradient transform."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loc_opt import compression
from loc_opt import parallel
from tests.compression._helpers import mesh_step
from tests.compression._helpers import one_mean
from tests.compression._helpers import W


def _grads(step, shapes=((16, 24), (24,))):
  keys = jax.random.split(jax.random.key(step), len(shapes))
  return {f'p{i}': jax.random.normal(k, (W,) + s)
          for i, (k, s) in enumerate(zip(keys, shapes))}


def _run_transform(tx, steps=4, shapes=((16, 24), (24,))):
  """Runs ``tx`` on per-worker gradients under vmap; returns outputs."""
  params = {f'p{i}': jnp.zeros((W,) + s) for i, s in enumerate(shapes)}
  state = jax.vmap(tx.init)(params)
  update = jax.jit(jax.vmap(tx.update, axis_name='worker'))
  outs = []
  for t in range(steps):
    g = _grads(t, shapes)
    u, state = update(g, state, params)
    outs.append((g, u))
  return outs, state


def test_identity_all_reduce_is_the_exact_mean():
  outs, _ = _run_transform(compression.compressed_all_reduce(
      compression.identity(), 'worker'))
  for g, u in outs:
    for k in g:
      np.testing.assert_allclose(
          u[k], np.broadcast_to(g[k].mean(0), g[k].shape), rtol=1e-6,
          atol=1e-7)


def test_every_worker_gets_the_same_lossy_mean():
  outs, _ = _run_transform(compression.compressed_all_reduce(
      compression.int8(block_size=32), 'worker'))
  for g, u in outs:
    for k in g:
      for m in range(1, W):
        np.testing.assert_array_equal(u[k][m], u[k][0])
      bound = float(jnp.abs(g[k]).max()) / 127 / 2
      assert np.abs(np.asarray(u[k][0] - g[k].mean(0))).max() <= bound * 1.01


def test_partition_sends_small_leaves_exactly_and_keeps_no_buffer():
  scheme = compression.build_compressor(
      compression.int8(block_size=16), error_feedback='ef',
      eligible=compression.min_size(100))
  x = {'big': jnp.zeros((W, 12, 16)), 'bias': jnp.zeros((W, 12))}
  state = jax.vmap(scheme.init)(x)
  assert [e.shape for e in jax.tree.leaves(state.error)] == [(W, 12, 16)]
  g = {'big': jax.random.normal(jax.random.key(0), (W, 12, 16)),
       'bias': jax.random.normal(jax.random.key(1), (W, 12))}
  mean, _, _ = one_mean(scheme, g, state)
  np.testing.assert_allclose(mean['bias'][0], g['bias'].mean(0), rtol=1e-6)
  assert scheme.payload_bytes({'big': x['big'][0], 'bias': x['bias'][0]}) \
      == compression.int8(16).payload_bytes(192) + 4 * 12


def test_start_step_uses_the_fp32_mean_first():
  tx = compression.compressed_all_reduce(
      compression.int8(block_size=16), 'worker', start_step=2,
      error_feedback='ef')
  outs, state = _run_transform(tx, steps=3)
  for t, (g, u) in enumerate(outs):
    err = float(jnp.abs(u['p0'][0] - g['p0'].mean(0)).max())
    assert (err < 1e-6) == (t < 2)
  assert int(state.count[0]) == 3


@pytest.mark.parametrize('scheme,ratio', [
    (compression.identity(), 1.0),
    (compression.int8(block_size=256), 0.28),
])
def test_compressed_all_reduce_bytes_on_a_mesh(scheme, ratio):
  mesh = parallel.make_worker_mesh(W, data=2)
  tx = compression.compressed_all_reduce(scheme, 'worker',
                                         error_feedback='ef')
  fn, args = mesh_step(tx, mesh)
  report = parallel.collective_bytes(fn.lower(*args).compile(), mesh)
  expected = compression.as_compressor(scheme).payload_bytes(
      jax.tree.map(lambda x: x[0], args[2]))
  assert expected <= report.cross_worker_bytes_per_worker \
      <= 1.1 * expected
  assert report.cross_worker_bytes_per_worker <= ratio * 4 * (8192 + 64)
  got, _ = fn(*args)
  want, _ = jax.jit(jax.vmap(tx.update, axis_name='worker'))(*args)
  for k in got:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6)


@functools.cache
def _abstract(tx):
  return jax.eval_shape(tx.init, {'w': jnp.zeros((8, 8))})


def test_states_are_abstract_friendly():
  tx = compression.compressed_all_reduce(
      compression.int8(block_size=16), 'worker', error_feedback='econtrol')
  state = _abstract(tx)
  assert jax.tree.leaves(state)[0].dtype == jnp.int32
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state)[1:])


def test_schemes_with_their_own_feedback_refuse_a_second_one():
  for scheme in (compression.powersgd(rank=2), compression.dgc(0.01),
                 compression.error_feedback(compression.from_codec(
                     compression.int8()))):
    assert scheme.feedback
    with pytest.raises(ValueError, match='own error feedback'):
      compression.build_compressor(scheme, error_feedback='ef')
  assert not compression.powersgd(rank=2, error_feedback=False).feedback
  compression.build_compressor(compression.powersgd(rank=2))
