"""Compressors from codecs (gather, two-phase) and as DiLoCo's codec."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import compression
from loc_opt import parallel
from tests.compression._helpers import mesh_step
from tests.compression._helpers import one_mean
from tests.compression._helpers import W


def test_two_phase_mean_matches_gather_within_two_roundings():
  codec = compression.int8(block_size=16)
  gather = compression.from_codec(codec)
  two = compression.from_codec(codec, reduce='two_phase', workers=W)
  x = {'w': jax.random.normal(jax.random.key(5), (W, 40, 24))}
  m1, _, _ = one_mean(gather, x, ())
  m2, sent, _ = one_mean(two, x, ())
  exact = x['w'].mean(0)
  step = float(jnp.abs(x['w']).max()) / 127
  for m in range(W):
    np.testing.assert_array_equal(m2['w'][m], m2['w'][0])
  assert float(jnp.abs(m1['w'][0] - exact).max()) <= step / 2 * 1.01
  assert float(jnp.abs(m2['w'][0] - exact).max()) <= step * 1.01
  assert float(jnp.abs(sent['w'] - x['w']).max()) <= step / 2 * 1.01
  with pytest.raises(ValueError, match='workers'):
    compression.from_codec(codec, reduce='two_phase')
  with pytest.raises(ValueError, match='built for 3'):
    one_mean(compression.from_codec(codec, reduce='two_phase', workers=3),
              x, ())


def test_two_phase_sends_about_two_payloads_whatever_the_workers():
  mesh = parallel.make_worker_mesh(W, data=2)
  codec = compression.int8(block_size=256)
  scheme = compression.from_codec(codec, reduce='two_phase', workers=W)
  tx = compression.compressed_all_reduce(scheme, 'worker')
  fn, args = mesh_step(tx, mesh, n=32768)
  report = parallel.collective_bytes(fn.lower(*args).compile(), mesh)
  expected = scheme.payload_bytes(jax.tree.map(lambda x: x[0], args[2]))
  sent = report.cross_worker_bytes_per_worker
  assert expected <= sent <= 1.1 * expected, (sent, expected)
  assert 'all-to-all' in report.by_kind(cross_worker=True)
  got, _ = fn(*args)
  want, _ = jax.jit(jax.vmap(tx.update, axis_name='worker'))(*args)
  for k in got:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


def _diloco_run(codec=None, reduce_fn=None, steps=6):
  tx = loc_opt.diloco(optax.adam(1e-2), sync_every=2, codec=codec,
                      reduce_fn=reduce_fn)

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  p = {'w': jnp.ones((W, 50))}
  s = jax.vmap(tx.init)(p)
  run = jax.jit(jax.vmap(step, axis_name='worker'))
  for i in range(steps):
    g = {'w': jax.random.normal(jax.random.key(i), (W, 50))}
    p, s = run(p, s, g)
  return p, s


def test_diloco_identity_codec_equals_plain_diloco():
  plain, _ = _diloco_run()
  ident, _ = _diloco_run(codec=compression.identity())
  np.testing.assert_array_equal(plain['w'], ident['w'])
  lossy, state = _diloco_run(codec=compression.error_feedback(
      compression.from_codec(compression.int8(block_size=10))))
  np.testing.assert_allclose(lossy['w'], plain['w'], atol=5e-3)
  assert not np.array_equal(lossy['w'], plain['w'])
  # the error buffer persists across syncs and is per worker
  assert float(jnp.abs(state.codec_state.error['w']).max()) > 0
  assert int(state.num_syncs[0]) == 3
  with pytest.raises(ValueError, match='not both'):
    loc_opt.diloco(optax.sgd(1.), sync_every=2, codec=compression.int8(),
                   reduce_fn=lambda t: t)


def test_diloco_codec_bytes_on_a_mesh():
  mesh = parallel.make_worker_mesh(W, data=2)
  codec = compression.int8(block_size=256)
  tx = loc_opt.diloco(optax.sgd(0.1), sync_every=1, codec=codec)
  fn, args = mesh_step(tx, mesh)
  report = parallel.collective_bytes(fn.lower(*args).compile(), mesh)
  params = jax.tree.map(lambda x: x[0], args[2])
  expected = loc_opt.outer.pseudo_gradient_bytes(params, codec=codec)
  lo, hi = report.cross_worker_bytes_range
  # The sync branch holds the recovery round for a non-finite mean (the
  # codec again, and each worker's weight) as a nested conditional whose
  # fast branch moves nothing: the sync's own bytes are the rest.
  recovery = min((max(b) for b in report.branches.values()), default=0)
  plain = hi - recovery
  assert expected <= plain / W <= 1.1 * expected
  assert plain <= recovery <= plain + 8 * 4 * W
  assert lo == 0  # the inner-only branch crosses no worker boundary
  assert expected < 0.26 * loc_opt.outer.pseudo_gradient_bytes(params)
