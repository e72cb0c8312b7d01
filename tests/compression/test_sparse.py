"""Top-k and random-k codecs: selection, wire format, bytes, error feedback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loc_opt import compression
from loc_opt import parallel
from loc_opt.compression import sparse


def _payload_nbytes(payload) -> int:
  return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(payload))


def _encode(codec, x, key=None):
  return jax.jit(codec.encode)(x, key)


def _decode(codec, payload, n, key=None):
  return jax.jit(codec.decode, static_argnums=1)(payload, n, key)


def _normal(seed, shape):
  return jax.random.normal(jax.random.key(seed), shape)


# ------------------------------------------------------------------ top-k ---
def test_global_topk_keeps_exactly_the_k_largest():
  x = _normal(0, (1000,))
  codec = sparse.topk_codec(density=0.03)
  payload = _encode(codec, x)
  assert payload['indices'].dtype == jnp.int32
  assert payload['values'].dtype == jnp.float32
  want = np.sort(np.argsort(-np.abs(np.asarray(x)))[:30])
  got = np.asarray(payload['indices']).reshape(-1)
  np.testing.assert_array_equal(np.sort(got), want)
  y = np.asarray(_decode(codec, payload, x.size))
  expected = np.zeros(1000, np.float32)
  expected[want] = np.asarray(x)[want]
  np.testing.assert_array_equal(y, expected)
  assert _payload_nbytes(payload) == codec.payload_bytes(1000) == 30 * 8


def test_number_kept_rounds_up_and_is_clipped():
  assert sparse.num_kept(12288, density=0.01) == 123
  assert sparse.num_kept(100, density=0.07) == 7  # 0.07 * 100 is 7.000...01
  assert sparse.num_kept(10, density=1e-4) == 1
  assert sparse.num_kept(10, k=50) == 10
  codec = sparse.topk_codec(k=50)
  x = _normal(1, (20,))
  np.testing.assert_array_equal(_decode(codec, _encode(codec, x), 20), x)
  with pytest.raises(ValueError, match='exactly one'):
    sparse.topk_codec(density=0.1, k=3)
  with pytest.raises(ValueError, match='exceeds'):
    sparse.topk_codec(k=300, chunk=256)


def test_topk_ties_go_to_the_lower_index():
  x = jnp.array([1.0, -2.0, 2.0, -1.0, 2.0, 0.5])
  payload = _encode(sparse.topk_codec(k=2), x)
  np.testing.assert_array_equal(np.asarray(payload['indices']).ravel(), [1, 2])
  np.testing.assert_array_equal(np.asarray(payload['values']).ravel(),
                                [-2.0, 2.0])


@pytest.mark.parametrize('chunk,k,dtype', [
    (256, 3, np.uint8), (1024, 10, np.uint16), (64, 1, np.uint8)])
def test_chunked_topk_keeps_the_k_largest_of_every_chunk(chunk, k, dtype):
  n = 4 * 1024
  x = _normal(2, (n,))
  codec = sparse.topk_codec(k=k, chunk=chunk)
  assert codec.block_size == chunk
  payload = _encode(codec, x)
  assert payload['indices'].dtype == dtype
  assert payload['indices'].shape == (n // chunk, k)
  rows = np.asarray(x).reshape(-1, chunk)
  for r, (row, idx) in enumerate(zip(rows, np.asarray(payload['indices']))):
    want = np.sort(np.argsort(-np.abs(row))[:k])
    np.testing.assert_array_equal(np.sort(idx), want, err_msg=f'chunk {r}')
  y = np.asarray(_decode(codec, payload, n)).reshape(-1, chunk)
  assert np.all((y != 0).sum(1) == k)
  np.testing.assert_array_equal(y[y != 0], rows[y != 0])
  assert _payload_nbytes(payload) == codec.payload_bytes(n)
  assert codec.payload_bytes(n) == (n // chunk) * k * (4 + dtype().itemsize)


def test_uint12_indices_pack_two_in_three_bytes():
  idx = jax.random.randint(jax.random.key(3), (7, 5), 0, 4096)
  packed = jax.jit(sparse.pack_uint12)(idx)
  assert packed.dtype == jnp.uint8 and packed.shape == (3 * 18,)
  unpack = jax.jit(sparse.unpack_uint12, static_argnums=1)
  np.testing.assert_array_equal(unpack(packed, 35),
                                np.asarray(idx).ravel())
  n, k = 3 * 4096, 40
  x = _normal(4, (n,))
  packed_codec = sparse.topk_codec(k=k, chunk=4096, index_dtype='uint12')
  plain_codec = sparse.topk_codec(k=k, chunk=4096)
  payload = _encode(packed_codec, x)
  np.testing.assert_array_equal(_decode(packed_codec, payload, n),
                                _decode(plain_codec,
                                        _encode(plain_codec, x), n))
  assert _payload_nbytes(payload) == packed_codec.payload_bytes(n) \
      == 3 * k * 4 + 3 * k * 3 // 2
  with pytest.raises(ValueError, match='4096'):
    sparse.topk_codec(k=4, chunk=8192, index_dtype='uint12')
  with pytest.raises(ValueError, match='cannot hold'):
    sparse.topk_codec(k=4, chunk=512, index_dtype=jnp.uint8)


def test_value_codec_quantizes_the_kept_values():
  n, chunk, k = 2048, 128, 4
  x = _normal(5, (n,))
  value_codec = compression.int8(block_size=16)
  codec = sparse.topk_codec(k=k, chunk=chunk, value_codec=value_codec)
  plain = sparse.topk_codec(k=k, chunk=chunk)
  assert codec.randomness == 'none' and not codec.linear
  payload = _encode(codec, x)
  assert payload['values']['codes'].dtype == jnp.int8
  kept = (n // chunk) * k
  assert _payload_nbytes(payload) == codec.payload_bytes(n) \
      == kept * 1 + kept + 4 * (kept // 16)
  exact = np.asarray(_decode(plain, _encode(plain, x), n))
  got = np.asarray(_decode(codec, payload, n))
  np.testing.assert_array_equal(got != 0, exact != 0)
  step = np.abs(exact).max() / 127
  assert 0 < np.abs(got - exact).max() <= step / 2 * 1.001


def test_topk_with_error_feedback_loses_nothing_over_time():
  workers, n, steps = 4, 512, 60
  codec = sparse.topk_codec(k=4, chunk=64)
  with_ef = compression.error_feedback(compression.from_codec(codec))
  without = compression.from_codec(codec)
  comm = compression.Comm('w')
  drift = _normal(6, (workers, n))

  def step(x, state, plain_state):
    key = jax.random.key(0)
    mean, sent, new = with_ef.mean(x, state, comm, key)
    _, plain_sent, _ = without.mean(x, plain_state, comm, key)
    return mean, sent, new, plain_sent

  run = jax.jit(jax.vmap(step, axis_name='w'))
  state = jax.vmap(with_ef.init)(jnp.zeros((workers, n)))
  plain_state = jax.vmap(without.init)(jnp.zeros((workers, n)))
  total_in = np.zeros((workers, n))
  total_sent = np.zeros((workers, n))
  total_plain = np.zeros((workers, n))
  for t in range(steps):
    g = drift + _normal(100 + t, (workers, n))
    mean, sent, new, plain_sent = run(g, state, plain_state)
    np.testing.assert_allclose(state.error + g, sent + new.error, atol=1e-5)
    assert np.all((np.asarray(sent) != 0).sum(-1) == 4 * n // 64)
    for w in range(workers):
      np.testing.assert_allclose(mean[w], np.asarray(sent).mean(0),
                                 atol=1e-6)
    total_in += np.asarray(g)
    total_sent += np.asarray(sent)
    total_plain += np.asarray(plain_sent)
    state = new
  np.testing.assert_allclose(total_in - total_sent, state.error, atol=1e-3)
  lost = np.linalg.norm(total_in - total_sent) / np.linalg.norm(total_in)
  lost_plain = np.linalg.norm(total_in - total_plain) / np.linalg.norm(
      total_in)
  # Top-k alone drops ~15/16 of every step; with feedback only the last
  # buffer is missing, which stays bounded while the input grows with t.
  assert lost < 0.3, lost
  assert lost_plain > 0.6, lost_plain


# --------------------------------------------------------------- random-k ---
def test_randomk_mask_is_shared_by_workers_and_changes_with_the_key():
  workers, n = 3, 1000
  codec = sparse.randomk_codec(density=0.05)
  x = _normal(7, (workers, n)) + 3.0  # No zeros: the mask shows in the output.

  @jax.jit
  def masks(key):
    own = jax.vmap(lambda v: codec.decode(codec.encode(v, key), n, key))(x)
    return own != 0

  base = jax.random.key(8)
  # Step keys as compressed_all_reduce derives them from its counter.
  first = np.asarray(masks(jax.random.fold_in(base, 0)))
  second = np.asarray(masks(jax.random.fold_in(base, 1)))
  for m in (first, second):
    assert np.all(m.sum(1) == 50)
    for w in range(1, workers):
      np.testing.assert_array_equal(m[w], m[0])
  assert (first[0] != second[0]).any()
  payload = jax.eval_shape(codec.encode, x[0], base)
  assert payload.shape == (1, 50) and payload.dtype == jnp.float32
  assert codec.payload_bytes(n) == 200
  with pytest.raises(ValueError, match='key'):
    codec.encode(x[0])


def test_randomk_mean_is_the_masked_mean_of_the_inputs():
  workers, n = 4, 600
  codec = sparse.randomk_codec(k=5, chunk=60)
  x = _normal(9, (workers, n))
  key = jax.random.key(10)
  mean = jax.jit(jax.vmap(
      lambda v: compression.compressed_mean(v, codec, 'w', key=key),
      axis_name='w'))
  got = np.asarray(mean(x))
  # The same key keeps the same coordinates of any input, e.g. all ones.
  mask = np.asarray(mean(jnp.ones((workers, n))))[0] != 0
  assert np.all(mask.reshape(-1, 60).sum(1) == 5)
  want = np.where(mask, np.asarray(x).mean(0), 0.0)
  for w in range(workers):
    np.testing.assert_allclose(got[w], want, rtol=1e-6, atol=1e-7)
  other = jax.jit(jax.vmap(lambda v: compression.compressed_mean(
      v, codec, 'w', key=jax.random.key(11)), axis_name='w'))
  assert (np.asarray(other(x))[0] != 0).sum() == 50
  assert ((np.asarray(other(x))[0] != 0) != mask).any()


def test_randomk_expectation_with_and_without_rescaling():
  chunk, k, draws = 16, 4, 4000
  x = np.asarray(_normal(11, (chunk,)))
  # One key draws an independent mask for each of the many copies of x.
  tiled = jnp.tile(jnp.asarray(x), draws)
  key = jax.random.key(12)

  @jax.jit
  def decoded():
    out = []
    for unbiased in (True, False):
      codec = sparse.randomk_codec(k=k, chunk=chunk, unbiased=unbiased)
      out.append(codec.decode(codec.encode(tiled, key), tiled.size, key))
    return out

  scaled, plain = (np.asarray(v).reshape(draws, chunk) for v in decoded())
  assert np.all((plain != 0).sum(1) == k)
  np.testing.assert_allclose(scaled[plain != 0], 4 * plain[plain != 0],
                             rtol=1e-6)
  # Each entry is kept with probability 1/4: E[scaled] = x, E[plain] = x / 4.
  sd = np.abs(x) * np.sqrt(3.0) / np.sqrt(draws)
  assert np.all(np.abs(scaled.mean(0) - x) <= 5 * sd + 1e-6)
  assert np.all(np.abs(plain.mean(0) - x / 4) <= 5 * sd / 4 + 1e-6)


def test_sparse_codecs_registry():
  assert set(sparse.SPARSE_CODECS) == {'topk', 'topk_chunked', 'randomk'}
  codec = sparse.SPARSE_CODECS['topk_chunked'](density=0.01)
  assert codec.block_size == 256 and codec.payload_bytes(512) == 2 * 3 * 5


# ---------------------------------------------------- bytes on the wire ---
@pytest.mark.parametrize('codec', [
    sparse.topk_codec(density=0.01),
    sparse.topk_codec(density=0.01, chunk=256),
    sparse.randomk_codec(density=0.01, chunk=256),
], ids=['topk', 'topk_chunked', 'randomk'])
def test_sparse_mean_under_shard_map_moves_only_the_payload(codec):
  mesh = parallel.make_worker_mesh(4, data=2)
  n = 4096 * 3
  x = jax.device_put(_normal(13, (4, n)),
                     jax.NamedSharding(mesh, jax.P('worker')))
  key = jax.random.key(14)

  def mean(v):
    return compression.compressed_mean(v, codec, 'worker', key=key)

  fn = jax.jit(parallel.shard_map_workers(mean, mesh))
  report = parallel.collective_bytes(fn.lower(x).compile(), mesh)
  sent = report.cross_worker_bytes_per_worker
  theory = codec.payload_bytes(n)
  assert theory <= 0.025 * 4 * n  # 1% density: 2% of fp32 bytes.
  assert 0.9 * theory <= sent <= 1.1 * theory, (sent, theory)
  want = jax.jit(jax.vmap(mean, axis_name='worker'))(x)
  np.testing.assert_allclose(fn(x), want, rtol=1e-6, atol=1e-6)
  nonzero = (np.asarray(want[0]) != 0).sum()
  assert 0 < nonzero <= 4 * 3 * 48  # At most 4 workers times what each keeps.
