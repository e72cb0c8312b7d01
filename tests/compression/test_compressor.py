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
from tests.compression._helpers import normal
from tests.compression._helpers import one_mean
from tests.compression._helpers import sharded_mean
from tests.compression._helpers import W
from tests.compression._helpers import worker_slice


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
  # The identity codec's payload path is another program around the same
  # mean: equal to float32 rounding (the lossy codec below is far off).
  np.testing.assert_allclose(ident['w'], plain['w'], rtol=1e-6, atol=1e-7)
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


# E3M0 magnitudes (a power of two from 2**-2 to 2**4, or zero) and the
# midpoints between neighbours, at which nearest rounding goes up.
_E3M0 = np.array([0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0])


def _fp4_e3m0_reference(x):
  """NumPy float64 nearest-rounding fp4 e3m0 with one absmax scale for
  the whole of ``x``: ``s = max|x| / 16``, ``x_hat = s R(x / s)``."""
  x = np.asarray(x, np.float64)
  s = np.abs(x).max() / 16.0
  mids = (_E3M0[:-1] + _E3M0[1:]) / 2
  idx = (np.abs(x / s)[..., None] >= mids).sum(-1)
  return np.sign(x) * _E3M0[idx] * s


@pytest.mark.parametrize('name', ['fp4_e3m0', 'int8', 'two_bit'])
def test_block_size_none_scales_each_tensor_on_its_own(name):
  """With ``block_size=None`` every tensor of the tree has its own scale: a
  tensor of values around 1e-3 beside an N(0, 1) one is not rounded to 0
  (one scale for the concatenated tree sent it as exactly 0)."""
  scheme = compression.as_compressor((name, {'block_size': None}))
  big = np.random.default_rng(0).standard_normal(64)
  small = np.array([4.2e-4, 6e-5, -1.7e-3, 7.5e-4])
  x = {'big': jnp.asarray(np.stack([big] * W), jnp.float32),
       'small': jnp.asarray(np.stack([small] * W), jnp.float32)}
  mean, sent, _ = one_mean(scheme, x, ())
  alone, _, _ = one_mean(scheme, {'small': x['small']}, ())
  # The small tensor is coded as it would be alone, and not as zeros (in
  # another program, with another leaf: to float32 rounding).
  np.testing.assert_allclose(mean['small'], alone['small'], rtol=1e-6,
                             atol=1e-7)
  np.testing.assert_allclose(sent['small'], alone['small'], rtol=1e-6,
                             atol=1e-7)
  assert np.all(np.asarray(mean['small'][0]) != 0)
  if name == 'fp4_e3m0':
    for key, value in (('big', big), ('small', small)):
      np.testing.assert_allclose(mean[key][0], _fp4_e3m0_reference(value),
                                 rtol=1e-6, atol=0)
  # Bytes: each tensor's codes and its own scale (and, 2-bit, its table).
  per_scale = {'fp4_e3m0': 4, 'int8': 4, 'two_bit': 20}[name]
  bits = {'fp4_e3m0': 4, 'int8': 8, 'two_bit': 2}[name]
  tree = {'big': big, 'small': small}
  assert scheme.payload_bytes(tree) == (64 + 4) * bits // 8 + 2 * per_scale
  with pytest.raises(ValueError, match='block_size'):
    compression.from_codec(compression.fp4_codec('e3m0', block_size=None),
                           reduce='two_phase', workers=W)


def test_per_tensor_bytes_on_a_mesh_are_exact():
  """The compiled all-gather of a per-tensor fp4 payload on the 4 x 2 mesh
  moves exactly its codes and one fp32 scale per tensor."""
  scheme = compression.as_compressor(('fp4_e3m0', {'block_size': None}))
  tree = {'w': normal(1, (W, 64, 32)), 'b': normal(2, (W, 32))}
  got, want, report = sharded_mean(scheme, tree)
  for k in tree:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7)
  one = worker_slice(tree)
  assert scheme.payload_bytes(one) == (64 * 32 + 32) // 2 + 2 * 4
  assert report.cross_worker_bytes_per_worker == scheme.payload_bytes(one)


def test_a_codec_over_buckets_is_each_buckets_mean():
  """A tree larger than the bucket size goes through the codec bucket by
  bucket (leaves in order, a larger leaf alone, the key folded with the
  bucket's index): each leaf's mean is that of its bucket sent alone, and
  on a 2 x fsdp 4 mesh it is what the simulation gives, each bucket's
  payload crossing once (issue 46)."""
  compressor = compression.from_codec(compression.int8(block_size=16))
  x = {'a': normal(0, (W, 64, 32)), 'b': normal(1, (W, 16)),
       'c': normal(2, (W, 8, 4)), 'd': normal(3, (W, 40, 32))}
  comm = compression.Comm('worker', bucket_size=1024)
  assert comm.buckets(jax.tree.leaves(worker_slice(x))) == [[0], [1, 2],
                                                           [3]]
  key = jax.random.key(3)

  def bucketed(t):
    return compressor.mean(t, (), comm, key)[0]

  got = jax.jit(jax.vmap(bucketed, axis_name='worker'))(x)
  alone = compression.Comm('worker')
  for names, b in ((('a',), 0), (('b', 'c'), 1), (('d',), 2)):
    part = {n: x[n] for n in names}
    k = key if b == 0 else jax.random.fold_in(key, b)
    want = jax.jit(jax.vmap(lambda t, k=k: compressor.mean(
        t, (), alone, k)[0], axis_name='worker'))(part)
    for n in names:
      np.testing.assert_array_equal(got[n], want[n])
  # int8 is deterministic and every leaf here is whole 16-element blocks:
  # the blocks fall where the one-buffer mean puts them, same values to
  # float32 rounding (another program's fusions).
  whole = jax.jit(jax.vmap(lambda t: compressor.mean(t, (), alone, key)[0],
                           axis_name='worker'))(x)
  for n in x:
    np.testing.assert_allclose(got[n], whole[n], rtol=1e-6, atol=1e-6)
  mesh = parallel.make_worker_mesh(2, fsdp=4)
  y = jax.tree.map(lambda v: v[:2], x)
  fn = jax.jit(parallel.shard_map_workers(bucketed, mesh))
  sharded = jax.device_put(y, jax.NamedSharding(mesh, jax.P('worker')))
  on_mesh = fn(sharded)
  sim = jax.jit(jax.vmap(bucketed, axis_name='worker'))(y)
  for n in x:
    np.testing.assert_allclose(on_mesh[n], sim[n], rtol=1e-6, atol=1e-6)
  report = parallel.collective_bytes(fn.lower(sharded).compile(), mesh)
  want_bytes = sum(compressor.payload_bytes([worker_slice(y)[n] for n in g])
                   for g in (('a',), ('b', 'c'), ('d',)))
  assert report.cross_worker_bytes_per_worker >= want_bytes
  assert report.cross_worker_bytes_per_worker <= 1.05 * want_bytes
