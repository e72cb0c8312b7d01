"""Chunked DCT: divisor rule, tiling, transform, tile top-k, scatter-mean."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.fft

from loc_opt import compression
from loc_opt import parallel
from loc_opt.compression import dct


# Jitted entry points: one compilation each instead of op-by-op dispatch.
_block_dct = jax.jit(dct.block_dct, static_argnames='chunk')
_block_idct = jax.jit(dct.block_idct, static_argnames=('shape', 'chunk'))
_encode = jax.jit(dct.dct_topk_encode,
                  static_argnames=('k', 'chunk', 'use_dct'))
_decode = jax.jit(dct.dct_topk_decode,
                  static_argnames=('shape', 'chunk', 'use_dct'))
_scatter_mean = jax.jit(dct.scatter_mean,
                        static_argnames=('block_elems', 'aggregate'))


def _normal(seed, shape):
  return np.asarray(jax.random.normal(jax.random.key(seed), shape))


def test_chunk_is_the_largest_divisor_up_to_chunk():
  assert dct.chunk_size(4096) == 64
  assert dct.chunk_size(96) == 48
  assert dct.chunk_size(100) == 50
  assert dct.chunk_size(7) == 7
  assert dct.chunk_size(50257) == 29  # 29 x 1733
  assert dct.chunk_size(12, chunk=5) == 4
  assert dct.chunk_size(67) == 1
  assert dct.chunk_sizes((128, 96)) == (64, 48)
  assert dct.chunk_sizes((4, 6, 10)) == (4, 60)  # Tiled as (4, 60).
  assert dct.chunk_sizes((2, 8, 16)) == (2, 64)  # (2, 128).
  assert dct.chunk_sizes(()) == (1,)


def test_prime_dimension_gets_chunk_one_and_a_warning():
  with pytest.warns(UserWarning, match='no divisor'):
    assert dct.chunk_sizes((67, 128)) == (1, 64)
  with pytest.warns(UserWarning, match='67'):
    dct.chunk_sizes((67,))


def test_basis_is_the_orthonormal_dct_ii():
  for n in (1, 5, 64):
    d = np.asarray(dct.dct_basis(n))
    assert d.dtype == np.float32 and d.shape == (n, n)
    np.testing.assert_allclose(d @ d.T, np.eye(n), atol=1e-6)
    np.testing.assert_allclose(d, scipy.fft.dct(np.eye(n), norm='ortho',
                                                axis=0), atol=1e-6)
  np.testing.assert_allclose(np.asarray(dct.dct_basis(8))[0],
                             np.full(8, np.sqrt(1 / 8)), rtol=1e-6)


@pytest.mark.parametrize('shape', [(12, 20), (130,), (4, 6, 10)])
def test_tiles_are_contiguous_blocks_in_row_major_order(shape):
  x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
  blocks, info = dct.to_blocks(x, chunk=8)
  m = np.asarray(x).reshape(info.matrix)
  assert blocks.shape == (info.num_blocks, info.block_elems)
  if len(info.matrix) == 1:
    c = info.chunks[0]
    np.testing.assert_array_equal(blocks, m.reshape(-1, c))
  else:
    (gr, gc), (cr, cc) = info.grid, info.chunks
    for b in range(info.num_blocks):
      i, j = divmod(b, gc)
      np.testing.assert_array_equal(
          blocks[b], m[i * cr:(i + 1) * cr, j * cc:(j + 1) * cc].ravel())
  np.testing.assert_array_equal(dct.from_blocks(blocks, info), x)


def test_12_by_20_tiles_as_6_by_5():
  _, info = dct.to_blocks(jnp.zeros((12, 20)), chunk=8)
  assert info.chunks == (6, 5) and info.grid == (2, 4)


@pytest.mark.parametrize('shape', [(256,), (64, 96), (4, 6, 10), (128, 128)])
def test_block_dct_round_trip_is_below_1e_5(shape):
  x = jnp.asarray(_normal(0, shape))
  coeffs = _block_dct(x, 64)
  back = _block_idct(coeffs, shape, 64)
  assert back.dtype == jnp.float32 and back.shape == shape
  assert float(jnp.abs(back - x).max()) < 1e-5


def test_block_dct_is_separable_per_tile():
  x = _normal(1, (16, 24))
  coeffs = np.asarray(_block_dct(jnp.asarray(x), chunk=8))
  d = scipy.fft.dct(np.eye(8), norm='ortho', axis=0)
  tile = x[8:16, 16:24]  # Tile (1, 2) of the 2 x 3 grid.
  np.testing.assert_allclose(coeffs[5].reshape(8, 8), d @ tile @ d.T,
                             atol=1e-5)
  const = _block_dct(jnp.full((8, 8), 2.0), chunk=8)
  np.testing.assert_allclose(const[0, 0], 16.0, rtol=1e-6)  # Only DC.
  np.testing.assert_allclose(const[0, 1:], 0.0, atol=1e-5)


def test_topk_keeps_the_largest_coefficients_of_every_tile():
  shape, k = (32, 48), 5
  x = jnp.asarray(_normal(2, shape))
  values, idx = _encode(x, k, chunk=16)
  assert idx.dtype == jnp.uint8 and idx.shape == (6, k)  # 16 x 16 tiles.
  coeffs = np.asarray(_block_dct(x, chunk=16))
  for b in range(6):
    want = np.argsort(-np.abs(coeffs[b]))[:k]
    np.testing.assert_array_equal(np.sort(np.asarray(idx[b])), np.sort(want))
    np.testing.assert_allclose(values[b], coeffs[b][np.asarray(idx[b])],
                               rtol=1e-6)
  _, idx64 = jax.eval_shape(lambda v: dct.dct_topk_encode(v, 32),
                            jnp.zeros((64, 64)))
  assert idx64.dtype == jnp.uint16 and idx64.shape == (1, 32)
  # Keeping every coefficient reconstructs the tensor.
  full = _decode(*_encode(x, 256, chunk=16), shape,
                             chunk=16)
  assert float(jnp.abs(full - x).max()) < 1e-5
  # Decoding k of them equals zeroing the others before the inverse.
  kept = np.zeros_like(coeffs)
  np.put_along_axis(kept, np.asarray(idx).astype(int), np.asarray(values), 1)
  np.testing.assert_allclose(
      _decode(values, idx, shape, chunk=16),
      _block_idct(jnp.asarray(kept), shape, chunk=16), atol=1e-6)


def test_topk_without_dct_selects_raw_entries():
  x = jnp.asarray(_normal(3, (128,)))
  values, idx = _encode(x, 2, chunk=64, use_dct=False)
  rows = np.asarray(x).reshape(2, 64)
  for b in range(2):
    np.testing.assert_array_equal(np.sort(np.asarray(idx[b])),
                                  np.sort(np.argsort(-np.abs(rows[b]))[:2]))
  y = np.asarray(_decode(values, idx, (128,), use_dct=False))
  assert (y != 0).sum() == 4
  np.testing.assert_array_equal(y[y != 0], np.asarray(x)[y != 0])
  assert dct.scaled_k(128, 64) == 2 and dct.scaled_k(128, 4096) == 128
  assert dct.scaled_k(32, 16) == 1 and dct.scaled_k(9000, 4096) == 4096


def test_scatter_mean_averages_over_choosers_or_workers():
  # 3 workers, 2 tiles of 4 entries, 2 entries each.
  idx = jnp.array([[[0, 1], [3, 2]],
                   [[1, 2], [3, 0]],
                   [[1, 0], [1, 2]]], jnp.uint8)
  val = jnp.array([[[1., 2.], [3., 4.]],
                   [[5., 6.], [7., 8.]],
                   [[9., 10.], [11., 12.]]])
  total = np.zeros((2, 4))
  count = np.zeros((2, 4))
  for w in range(3):
    for b in range(2):
      for i, v in zip(np.asarray(idx[w, b]), np.asarray(val[w, b])):
        total[b, i] += v
        count[b, i] += 1
  selected = _scatter_mean(idx, val, 4)
  np.testing.assert_allclose(selected, total / np.maximum(count, 1),
                             rtol=1e-6)
  np.testing.assert_allclose(selected[0], [(1 + 10) / 2, (2 + 5 + 9) / 3,
                                           6, 0], rtol=1e-6)
  np.testing.assert_allclose(
      _scatter_mean(idx, val, 4, aggregate='mean_over_workers'),
      total / 3, rtol=1e-6)
  with pytest.raises(ValueError, match='aggregate'):
    dct.scatter_mean(idx, val, 4, aggregate='sum')


def test_decode_mean_of_one_worker_is_its_decode():
  x = jnp.asarray(_normal(4, (2, 8, 16)))

  @jax.jit
  def both(v):
    values, idx = dct.dct_topk_encode(v, 7, chunk=8)
    one = dct.dct_topk_decode(values, idx, v.shape, chunk=8)
    mean = dct.dct_topk_decode_mean(idx[None], values[None], v.shape, chunk=8)
    return one, mean

  one, mean = both(x)
  assert (np.asarray(one) != 0).any()
  # Two decode paths (a scatter and a mean over one worker before the
  # inverse transform's matmuls): equal to float32 rounding.
  np.testing.assert_allclose(mean, one, rtol=1e-6,
                             atol=1e-6 * float(np.abs(one).max()))


def test_dct_topk_mean_under_shard_map_moves_only_the_sparse_tiles():
  mesh = parallel.make_worker_mesh(4, data=2)
  shape, k = (128, 192), 32  # 6 tiles of 64 x 64, 32 of 4096 kept each.
  x = jax.device_put(jnp.asarray(_normal(5, (4,) + shape)),
                     jax.NamedSharding(mesh, jax.P('worker')))
  comm = compression.Comm('worker')

  def mean(v):
    values, idx = dct.dct_topk_encode(v, k)
    gathered = comm.all_gather({'values': values, 'indices': idx})
    return dct.dct_topk_decode_mean(gathered['indices'], gathered['values'],
                                    shape)

  fn = jax.jit(parallel.shard_map_workers(mean, mesh))
  report = parallel.collective_bytes(fn.lower(x).compile(), mesh)
  theory = 6 * k * (4 + 2)  # fp32 values and uint16 indices.
  sent = report.cross_worker_bytes_per_worker
  assert theory <= sent <= 1.1 * theory, (sent, theory)
  assert sent < 0.015 * 4 * np.prod(shape)  # 6 B per kept entry: 1.2%.
  want = jax.jit(jax.vmap(mean, axis_name='worker'))(x)
  got = fn(x)
  np.testing.assert_allclose(got, want, atol=1e-5)
  for w in range(1, 4):  # the same decode of the same gather, one program
    np.testing.assert_array_equal(got[w], got[0])
  # Reference: the mean over choosers of every worker's top coefficients.
  coeffs = np.stack([np.asarray(_block_dct(x[w], 64)) for w in range(4)])
  total = np.zeros_like(coeffs[0])
  count = np.zeros_like(coeffs[0])
  for w in range(4):
    top = np.argsort(-np.abs(coeffs[w]), axis=1)[:, :k]
    np.put_along_axis(total, top, np.take_along_axis(coeffs[w], top, 1)
                      + np.take_along_axis(total, top, 1), 1)
    np.put_along_axis(count, top, np.take_along_axis(count, top, 1) + 1, 1)
  ref = _block_idct(jnp.asarray(total / np.maximum(count, 1)), shape, 64)
  np.testing.assert_allclose(got[0], ref, atol=1e-5)
