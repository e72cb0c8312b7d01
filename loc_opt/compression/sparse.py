r"""Sparsification codecs: top-k and random-k.

A sparsifier keeps ``k`` of the ``n`` entries of a flat array and sends only
those. Two ways of choosing them:

* **top-k** (:func:`topk_codec`) keeps the ``k`` entries of largest
  magnitude. The receivers cannot guess which ones, so each kept value
  travels with its index. Globally over the array the index needs 4 bytes;
  per contiguous chunk of ``c`` elements (``chunk=c``) it needs only
  ``log2 c`` bits (one byte for ``c <= 256``, 12 bits for ``c <= 4096``), the
  compact format SparseLoCo counts in its compression ratios. Top-k is
  biased but contractive, ``||x - C(x)||^2 <= (1 - k/n) ||x||^2``, so it is
  meant to run under error feedback
  (:func:`~loc_opt.compression.error_feedback`).
* **random-k** (:func:`randomk_codec`) keeps ``k`` entries drawn from a key
  that all workers share. Every worker keeps the *same* coordinates, so no
  index is sent, the payloads of all workers line up and are averaged with an
  all-reduce (the codec is linear), and decoding regenerates the coordinates
  from the key.

Payloads are pytrees whose dtypes are what crosses the wire: float32 values
(or the payload of a ``value_codec`` that quantizes them) and integer indices
of the narrowest width that holds a chunk-local position.

References:
  Aji, Heafield, *Sparse Communication for Distributed Gradient Descent*,
  2017.
  Lin, Han, Mao, Wang, Dally, *Deep Gradient Compression: Reducing the
  Communication Bandwidth for Distributed Training*, 2018.
  Stich, Cordonnier, Jaggi, *Sparsified SGD with Memory*, 2018 (top-k and
  random-k with error feedback).
  Wangni, Wang, Liu, Zhang, *Gradient Sparsification for
  Communication-Efficient Distributed Optimization*, 2018 (rescaled random
  sparsification is unbiased).
  Sarfi, Thérien, Lidin, Belilovsky, *Communication Efficient LLM
  Pre-training with SparseLoCo*, 2025 (chunk-wise top-k, compact indices,
  2-bit values).
"""

from collections.abc import Callable, Mapping
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loc_opt import _checks
from loc_opt.compression import codecs as codecs_lib
from loc_opt.compression import comm as comm_lib

Codec = codecs_lib.Codec

# Packed 12-bit indices: two indices in three bytes.
UINT12 = 'uint12'


# ----------------------------------------------------------------- sizes ---
def num_kept(size: int, density: float | None = None,
             k: int | None = None) -> int:
  """Entries kept out of ``size``: ``k``, or ``ceil(density * size)``.

  The result is clipped to ``[1, size]`` (a leaf or chunk smaller than ``k``
  is sent whole). Exactly one of ``density`` and ``k`` is given.

  Args:
    size: elements to choose from (an array or one chunk).
    density: fraction of entries to keep, in ``(0, 1]``.
    k: number of entries to keep, ``>= 1``.

  Returns:
    The static number of kept entries.
  """
  if (density is None) == (k is None):
    raise ValueError('give exactly one of density and k')
  if k is not None:
    want = int(k)
  else:
    # The rounding guards products such as 0.07 * 100 = 7.000000000000001.
    want = math.ceil(round(density * size, 9))
  return max(1, min(want, size))


def index_dtype_for(size: int) -> np.dtype:
  """The narrowest integer dtype for positions ``0 .. size - 1``.

  ``uint8`` up to 256 positions, ``uint16`` up to 65,536, ``int32`` beyond.

  Args:
    size: number of positions (a chunk's length).

  Returns:
    A NumPy dtype.
  """
  if size <= 1 << 8:
    return np.dtype(np.uint8)
  if size <= 1 << 16:
    return np.dtype(np.uint16)
  return np.dtype(np.int32)


def pack_uint12(indices: jax.Array) -> jax.Array:
  """Packs integers in ``[0, 4096)`` two to three bytes.

  Index ``2j`` fills byte ``3j`` and the low half of byte ``3j + 1``; index
  ``2j + 1`` the high half of byte ``3j + 1`` and byte ``3j + 2``.

  Args:
    indices: integer array of any shape, values below 4096.

  Returns:
    Flat ``uint8[3 * ceil(m / 2)]`` for ``m = indices.size``.
  """
  flat = comm_lib.pad_to(indices.reshape(-1).astype(jnp.uint32), 2)
  a, b = flat[0::2], flat[1::2]
  packed = jnp.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], axis=1)
  return packed.reshape(-1).astype(jnp.uint8)


def unpack_uint12(packed: jax.Array, m: int) -> jax.Array:
  """Inverse of :func:`pack_uint12`: the first ``m`` indices as int32."""
  triples = packed.reshape(-1, 3).astype(jnp.int32)
  a = triples[:, 0] | ((triples[:, 1] & 0xF) << 8)
  b = (triples[:, 1] >> 4) | (triples[:, 2] << 4)
  return jnp.stack([a, b], axis=1).reshape(-1)[:m]


def _index_format(index_dtype: Any, size: int | None):
  """``(encode, decode, bytes_of(m))`` for ``m`` indices below ``size``.

  ``size=None`` (global top-k) checks the range when the length is known.
  """
  if index_dtype == UINT12:
    if size is not None and size > 1 << 12:
      raise ValueError(f'uint12 indices hold chunks of up to 4096, got {size}')

    def encode(idx):
      return pack_uint12(idx)

    def decode(payload, shape):
      return unpack_uint12(payload, math.prod(shape)).reshape(shape)

    return encode, decode, lambda m: 3 * math.ceil(m / 2)

  dtype = np.dtype(index_dtype if index_dtype is not None else
                   (np.int32 if size is None else index_dtype_for(size)))
  if not np.issubdtype(dtype, np.integer):
    raise ValueError(f'index_dtype must be an integer dtype or {UINT12!r}, '
                     f'got {dtype}')
  if size is not None and np.iinfo(dtype).max < size - 1:
    raise ValueError(f'index_dtype {dtype} cannot hold positions up to '
                     f'{size - 1}')

  def encode_plain(idx):
    return idx.astype(dtype)

  def decode_plain(payload, shape):
    return payload.astype(jnp.int32).reshape(shape)

  return encode_plain, decode_plain, lambda m: dtype.itemsize * m


def _value_format(value_codec: Codec | None):
  """``(encode, decode, bytes_of(m))`` for ``m`` kept float32 values.

  Without a value codec values travel as float32. With one, the flat values
  are zero-padded to its block size and encoded by it.
  """
  if value_codec is None:
    return (lambda v, key: v,
            lambda p, shape, key: p.astype(jnp.float32),
            lambda m: 4 * m)
  block = value_codec.block_size

  def encode(values, key):
    return value_codec.encode(comm_lib.pad_to(values.reshape(-1), block), key)

  def decode(payload, shape, key):
    m = math.prod(shape)
    padded = m + (-m) % block
    return value_codec.decode(payload, padded, key)[:m].reshape(shape)

  return encode, decode, lambda m: value_codec.payload_bytes(m + (-m) % block)


def _chunking(n: int, chunk: int | None) -> tuple[int, int]:
  """``(num_chunks, chunk_length)``; ``chunk=None`` is one chunk of ``n``."""
  if chunk is None:
    return 1, n
  return math.ceil(n / chunk), chunk


def _rows(x: jax.Array, chunk: int | None) -> jax.Array:
  """``x`` as ``[num_chunks, chunk]`` float32 (zero-padded)."""
  flat = jnp.ravel(x).astype(jnp.float32)
  if chunk is None:
    return flat[None]
  return comm_lib.pad_to(flat, chunk).reshape(-1, chunk)


def _scatter_rows(values: jax.Array, idx: jax.Array, num_chunks: int,
                  length: int) -> jax.Array:
  """Dense ``[num_chunks, length]`` with ``values`` at ``idx`` per row."""
  rows = jnp.arange(num_chunks, dtype=jnp.int32)[:, None]
  return jnp.zeros((num_chunks, length), jnp.float32).at[rows, idx].set(
      values, unique_indices=True)


def _check_args(density, k, chunk):
  if (density is None) == (k is None):
    raise ValueError('give exactly one of density and k')
  if density is not None:
    _checks.in_interval(density, 'density', 0, 1, closed='right')
  if k is not None:
    _checks.positive_int(k, 'k', arrays=True)
  if chunk is not None:
    _checks.positive_int(chunk, 'chunk', arrays=True)
  if chunk is not None and k is not None and k > chunk:
    raise ValueError(f'k={k} exceeds the chunk length {chunk}')


# ----------------------------------------------------------------- top-k ---
def topk_codec(
    density: float | None = None,
    k: int | None = None,
    *,
    chunk: int | None = None,
    index_dtype: Any = None,
    value_codec: Codec | None = None,
) -> Codec:
  r"""Top-k sparsification: the largest-magnitude entries and their indices.

  .. math::

    C(x)_i = x_i \text{ if } |x_i| \text{ is among the } k \text{ largest of
    its chunk, else } 0.

  With ``chunk=None`` the ``k`` entries are chosen over the whole flat array
  and indexed with int32. With ``chunk=c`` the array is cut into contiguous
  chunks of ``c`` elements (the codec's ``block_size``) and ``k`` entries are
  kept in every chunk, indexed within the chunk: uint8 for ``c <= 256``,
  uint16 for ``c <= 65536``, or, with ``index_dtype='uint12'``, two 12-bit
  indices packed in three bytes for ``c <= 4096``. Choosing per chunk costs
  a little accuracy against the global choice but makes the indices compact
  and the selection parallel.

  Selection is ``jax.lax.top_k`` on ``|x|``: ties go to the lower index, so
  the result is deterministic; NaNs rank above every number and are kept
  (remove them upstream, e.g. with ``optax.zero_nans``).

  The payload is ``{'values': float32[chunks, k], 'indices': [chunks, k]}``
  (``indices`` flat uint8 when packed; ``values`` the ``value_codec``
  payload when given), of exactly
  ``chunks * k * (4 + index_bytes)`` bytes without a value codec.

  Args:
    density: fraction of entries kept per chunk (or of the array),
      ``k = ceil(density * length)``.
    k: entries kept per chunk (or in the array); exactly one of ``density``
      and ``k``. Arrays shorter than ``k`` are sent whole.
    chunk: chunk length, or ``None`` for a global top-k.
    index_dtype: integer dtype of the indices, or ``'uint12'``; default
      int32 (global) or the narrowest that fits (chunked).
    value_codec: optional codec (e.g. :func:`~loc_opt.compression.int8` or a
      2-bit quantizer) that encodes the kept values, flattened and padded to
      its block size; its metadata (scales) adds to the payload. A
      stochastic value codec makes this codec ``'per_worker'``.

  Returns:
    The codec (``linear=False``: payloads are all-gathered).

  Example::

    codec = topk_codec(density=0.01, chunk=256)   # 3 of 256, uint8 indices
    mean = compressed_mean(g, error_feedback(from_codec(codec)), 'worker')
  """
  _check_args(density, k, chunk)
  idx_encode, idx_decode, idx_bytes = _index_format(index_dtype, chunk)
  val_encode, val_decode, val_bytes = _value_format(value_codec)

  def kept(n):
    num_chunks, length = _chunking(n, chunk)
    return num_chunks, length, num_kept(length, density, k)

  def encode(x, key=None):
    rows = _rows(x, chunk)
    num_chunks, length = rows.shape
    if chunk is None:
      _index_format(index_dtype, length)  # Checks the range.
    kk = num_kept(length, density, k)
    _, idx = jax.lax.top_k(jnp.abs(rows), kk)
    values = jnp.take_along_axis(rows, idx, axis=1)
    return {'values': val_encode(values, key), 'indices': idx_encode(idx)}

  def decode(payload, n, key=None):
    num_chunks, length, kk = kept(n)
    shape = (num_chunks, kk)
    values = val_decode(payload['values'], shape, key)
    idx = idx_decode(payload['indices'], shape)
    return _scatter_rows(values, idx, num_chunks, length).reshape(-1)[:n]

  def payload_bytes(n):
    num_chunks, _, kk = kept(n)
    return idx_bytes(num_chunks * kk) + val_bytes(num_chunks * kk)

  name = 'topk' if chunk is None else 'topk_chunked'
  if value_codec is not None:
    name = f'{name}+{value_codec.name}'
  return Codec(
      name=name,
      encode=encode,
      decode=decode,
      payload_bytes=payload_bytes,
      block_size=1 if chunk is None else chunk,
      randomness='none' if value_codec is None else value_codec.randomness,
  )


def topk_chunked_codec(
    density: float | None = None,
    k: int | None = None,
    *,
    chunk: int = 256,
    index_dtype: Any = None,
    value_codec: Codec | None = None,
) -> Codec:
  """:func:`topk_codec` per chunk, 256 elements by default (uint8 indices)."""
  return topk_codec(density, k, chunk=chunk, index_dtype=index_dtype,
                    value_codec=value_codec)


# -------------------------------------------------------------- random-k ---
def random_indices(key: jax.Array, num_chunks: int, length: int,
                   k: int) -> jax.Array:
  """``k`` distinct positions per chunk, drawn uniformly from ``key``.

  The positions are the ``k`` largest of ``length`` uniform draws per chunk,
  so every ``k``-subset is equally likely (up to ties of the draws).

  Args:
    key: PRNG key (the same on every worker for a shared mask).
    num_chunks: number of chunks.
    length: elements per chunk.
    k: positions per chunk.

  Returns:
    int32 ``[num_chunks, k]``.
  """
  _, idx = jax.lax.top_k(jax.random.uniform(key, (num_chunks, length)), k)
  return idx


def randomk_codec(
    density: float | None = None,
    k: int | None = None,
    *,
    chunk: int | None = None,
    unbiased: bool = False,
) -> Codec:
  r"""Random-k sparsification with a mask shared by all workers.

  The ``k`` kept coordinates (per chunk of ``chunk`` elements, or over the
  whole array) are drawn from the key that every worker and the decoder
  share (``randomness='shared'``), so the payload is the ``k`` values only,
  ``4 k`` bytes, and it is linear: the mean of the payloads decodes to the
  masked mean of the inputs, and compressors average it with an all-reduce.

  By default the kept values are sent as they are, ``C(x) = m \odot x``
  (contractive in expectation, ``E||x - C(x)||^2 = (1 - k/n)||x||^2``), the
  form to use with error feedback. With ``unbiased=True`` the decoder scales
  them by ``n / k`` (per chunk ``c / k``), so ``E[C(x)] = x`` over the mask;
  its variance grows like ``n / k``, so use it without error feedback.

  SparseLoCo's reference random-k draws a different mask on each worker; that
  variant needs each payload decoded with its sender's key and is not this
  codec.

  Args:
    density: fraction of entries kept, ``k = ceil(density * length)``.
    k: entries kept per chunk (or in the array); exactly one of ``density``
      and ``k``.
    chunk: chunk length (``block_size``), or ``None`` for one mask over the
      whole array.
    unbiased: rescale by ``length / k`` at decoding.

  Returns:
    The codec (``linear=True``, ``randomness='shared'``).
  """
  _check_args(density, k, chunk)

  def kept(n):
    num_chunks, length = _chunking(n, chunk)
    return num_chunks, length, num_kept(length, density, k)

  def mask(key, n):
    if key is None:
      raise ValueError('randomk_codec needs the shared key to draw its mask')
    num_chunks, length, kk = kept(n)
    return random_indices(key, num_chunks, length, kk)

  def encode(x, key=None):
    rows = _rows(x, chunk)
    return jnp.take_along_axis(rows, mask(key, rows.size), axis=1)

  def decode(payload, n, key=None):
    num_chunks, length, kk = kept(n)
    values = payload.astype(jnp.float32)
    if unbiased:
      values = values * (length / kk)
    dense = _scatter_rows(values, mask(key, n), num_chunks, length)
    return dense.reshape(-1)[:n]

  def payload_bytes(n):
    num_chunks, _, kk = kept(n)
    return 4 * num_chunks * kk

  return Codec(
      name='randomk',
      encode=encode,
      decode=decode,
      payload_bytes=payload_bytes,
      block_size=1 if chunk is None else chunk,
      linear=True,
      randomness='shared',
  )


SPARSE_CODECS: Mapping[str, Callable[..., Codec]] = {
    'topk': topk_codec,
    'topk_chunked': topk_chunked_codec,
    'randomk': randomk_codec,
}
