"""Codecs and compressed means: round trips, bounds, bytes on the wire."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import compression
from loc_opt import parallel


def test_identity_round_trip_is_exact():
  codec = compression.identity()
  x = jnp.linspace(-3, 3, 10)
  np.testing.assert_array_equal(codec.decode(codec.encode(x), 10), x)
  assert codec.payload_bytes(10) == 40 and codec.exact


def test_int8_error_at_most_half_a_step_per_block():
  codec = compression.int8(block_size=64)
  x = jax.random.normal(jax.random.key(0), (64 * 5,)) * \
      jnp.repeat(jnp.array([1e-3, 1.0, 30.0, 0.0, 5.0]), 64)
  payload = codec.encode(x)
  assert payload['codes'].dtype == jnp.int8
  assert payload['codes'].shape == (5, 64)
  y = codec.decode(payload, x.size)
  step = np.asarray(jnp.abs(x).reshape(5, 64).max(1) / 127)
  err = np.abs(np.asarray(y - x)).reshape(5, 64).max(1)
  assert np.all(err <= step / 2 * (1 + 1e-6))
  np.testing.assert_array_equal(y[192:256], 0.0)  # an all-zero block
  assert codec.payload_bytes(320) == 320 + 4 * 5


def test_unknown_codec_names_the_argument_and_the_choices():
  # The library names its own argument; config fields are the launcher's.
  with pytest.raises(ValueError, match=r"unknown codec 'int3' for codec; "
                     r"choose one of \[.*'int4'.*'int8'"):
    compression.make_codec('int3')


def test_compressed_mean_under_vmap():
  x = jax.random.normal(jax.random.key(1), (4, 300))
  exact = jax.vmap(lambda v: compression.compressed_mean(
      v, compression.identity(), 'w'), axis_name='w')(x)
  np.testing.assert_allclose(exact, np.broadcast_to(x.mean(0), x.shape),
                             rtol=1e-6)
  q = jax.vmap(lambda v: compression.compressed_mean(
      v, compression.int8(), 'w'), axis_name='w')(x)
  for m in range(1, 4):
    np.testing.assert_array_equal(q[m], q[0])  # same mean on every worker
  bound = float(jnp.abs(x).max()) / 127 / 2
  assert np.abs(np.asarray(q[0] - x.mean(0))).max() <= bound * 1.001


@pytest.mark.parametrize('data', [1, 2])
def test_int8_mean_moves_a_quarter_of_fp32(data):
  mesh = parallel.make_worker_mesh(8 // data, data=data)
  workers = 8 // data
  n = 4096 * 3
  x = jax.device_put(
      jax.random.normal(jax.random.key(2), (workers, n)),
      jax.NamedSharding(mesh, jax.P('worker')))
  codec = compression.int8(block_size=256)
  fn = jax.jit(parallel.shard_map_workers(
      parallel.worker_mean(codec=codec), mesh))
  report = parallel.collective_bytes(fn.lower(x).compile(), mesh)
  assert report.cross_worker_bytes_per_worker == codec.payload_bytes(n)
  assert report.cross_worker_bytes_per_worker <= 0.26 * 4 * n
  assert {c.shape.split('[')[0] for c in report.collectives
          if c.cross_worker} == {'s8', 'f32'}
  want = jax.jit(parallel.shard_map_workers(
      lambda v: jax.lax.pmean(v, 'worker'), mesh))(x)
  got = fn(x)
  np.testing.assert_allclose(got, want, atol=float(jnp.abs(x).max()) / 254)


def test_diloco_with_identity_codec_equals_plain_diloco():
  def run(reduce_fn):
    tx = loc_opt.diloco(optax.adam(1e-2), sync_every=2, reduce_fn=reduce_fn)

    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    p = {'w': jnp.ones((4, 50))}
    s = jax.vmap(tx.init)(p)
    for i in range(4):
      g = {'w': jax.random.normal(jax.random.key(i), (4, 50))}
      p, s = jax.vmap(step, axis_name='worker')(p, s, g)
    return p

  plain = run(None)
  ident = run(lambda t: compression.compressed_mean(
      t, compression.identity(), 'worker'))
  # The identity payload's mean and pmean are other operations: equal to
  # float32 rounding.
  np.testing.assert_allclose(ident['w'], plain['w'], rtol=1e-6, atol=1e-7)
  q = run(lambda t: compression.compressed_mean(
      t, compression.int8(), 'worker'))
  np.testing.assert_allclose(q['w'], plain['w'], atol=2e-3)
