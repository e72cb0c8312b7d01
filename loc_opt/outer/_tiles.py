r"""Per-tile top-k messages: the wire format of DeMo and SparseLoCo.

A tensor is cut into tiles by the divisor rule of
:mod:`loc_opt.compression.dct` (and, for DeMo, DCT-transformed); each tile's
``k`` largest-magnitude entries are kept and sent as tile-local indices
(12-bit packed by default) plus values (a float dtype or a value codec).
Every worker's messages are all-gathered (:func:`exchange`) and averaged
entry by entry with :func:`loc_opt.compression.dct.scatter_mean`.
:class:`SparseTiles` is shared by :mod:`loc_opt.outer.demo` and
:mod:`loc_opt.outer.sparseloco`.

References:
  Peng, Quesnelle, Kingma, *DeMo: Decoupled Momentum Optimization*, 2024.
  https://arxiv.org/abs/2411.19870

  Sarfi, Thérien, Lidin, Belilovsky, *Communication Efficient LLM
  Pre-training with SparseLoCo*, 2025. https://arxiv.org/abs/2508.15706
"""

from collections.abc import Callable
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loc_opt import _checks
from loc_opt import compression
from loc_opt.compression import dct
from loc_opt.compression import sparse

UINT12 = sparse.UINT12


def _index_format(index_dtype: Any, block_elems: int):
  """``(encode, decode, nbytes)`` for tile-local indices below
  ``block_elems``; ``nbytes(m)`` is the wire size of ``m`` indices."""
  if isinstance(index_dtype, str) and index_dtype == UINT12:
    if block_elems > 1 << 12:
      raise ValueError(
          f'index_dtype {UINT12!r} holds tiles of up to 4096 elements, got '
          f'{block_elems} (lower chunk/tile or pick a wider index_dtype)')
    return (sparse.pack_uint12,
            lambda w, shape: sparse.unpack_uint12(
                w, math.prod(shape)).reshape(shape),
            lambda m: 3 * math.ceil(m / 2))
  dtype = (sparse.index_dtype_for(block_elems) if index_dtype is None
           else np.dtype(index_dtype))
  if not np.issubdtype(dtype, np.integer):
    raise ValueError(f'index_dtype must be an integer dtype or {UINT12!r}, '
                     f'got {dtype}')
  if np.iinfo(dtype).max < block_elems - 1:
    raise ValueError(f'index_dtype {dtype} cannot hold tile positions up to '
                     f'{block_elems - 1}')
  return (lambda idx: idx.astype(dtype),
          lambda w, shape: w.astype(jnp.int32).reshape(shape),
          lambda m: dtype.itemsize * m)


def _check_index_dtype(index_dtype: Any) -> None:
  if isinstance(index_dtype, str):
    if index_dtype != UINT12:
      raise ValueError(f'index_dtype must be an integer dtype or {UINT12!r}, '
                       f'got {index_dtype!r}')
    return
  if index_dtype is not None and not np.issubdtype(np.dtype(index_dtype),
                                                  np.integer):
    raise ValueError(f'index_dtype must be an integer dtype or {UINT12!r}, '
                     f'got {index_dtype!r}')


def _unsharded(x: jax.Array) -> jax.Array:
  """``x`` replicated when its type carries an explicit sharding (top-k
  cannot run along a sharded axis); unchanged otherwise."""
  spec = getattr(jax.typeof(x).sharding, 'spec', None)
  if spec is not None and any(s is not None for s in spec):
    return jax.reshard(x, jax.P())
  return x


@dataclasses.dataclass(frozen=True)
class SparseTiles:
  """Per-tile top-k messages: what DeMo and SparseLoCo put on the wire.

  A tensor is cut into tiles by the divisor rule of
  :mod:`loc_opt.compression.dct` (optionally DCT-transformed), the ``k``
  largest-magnitude entries of each tile are kept, and the message is
  ``{'indices': tile-local positions, 'values': the kept values}``. Indices
  are packed 12 bits each (``'uint12'``) or stored in an integer dtype;
  values are cast to ``value_dtype`` (sent as their bit pattern when
  narrower than 32 bits, since XLA on CPU widens low-precision float
  collectives) or encoded by ``value_codec`` (e.g. the 2-bit quantizer),
  flattened per tensor and padded to the codec's block size.

  Attributes:
    k: ``block_elems -> k``, the entries kept in a tile of that size.
    chunk: the largest tile side.
    use_dct: select DCT-II coefficients (DeMo) instead of raw entries.
    index_dtype: ``'uint12'``, an integer dtype, or ``None`` (narrowest).
    value_dtype: float dtype of the values when there is no value codec.
    value_codec: a :class:`loc_opt.compression.Codec` for the values.
  """

  k: Callable[[int], int]
  chunk: int = 64
  use_dct: bool = True
  index_dtype: Any = UINT12
  value_dtype: Any = jnp.float32
  value_codec: compression.Codec | None = None

  def info(self, shape) -> dct.BlockInfo:
    """The tiling of a tensor of ``shape``."""
    return dct.block_info(tuple(shape), self.chunk)

  def kept(self, shape) -> tuple[int, int]:
    """``(num_blocks, k)`` of a tensor of ``shape``."""
    info = self.info(shape)
    return info.num_blocks, max(1, min(int(self.k(info.block_elems)),
                                       info.block_elems))

  def _values(self, m: int):
    """``(encode(v, key), decode(wire, shape, key), nbytes)`` for ``m``
    values."""
    codec = self.value_codec
    if codec is not None:
      padded = m + (-m) % codec.block_size

      def encode(v, key):
        return codec.encode(compression.pad_to(v.reshape(-1),
                                               codec.block_size), key)

      def decode(wire, shape, key):
        return codec.decode(wire, padded, key)[:m].reshape(shape)

      return encode, decode, codec.payload_bytes(padded)
    dtype = np.dtype(self.value_dtype)
    if dtype.itemsize >= 4:
      return (lambda v, key: v.astype(dtype),
              lambda w, shape, key: w.astype(jnp.float32).reshape(shape),
              dtype.itemsize * m)
    bits = np.dtype(f'uint{8 * dtype.itemsize}')
    return (lambda v, key: jax.lax.bitcast_convert_type(v.astype(dtype),
                                                        bits),
            lambda w, shape, key: jax.lax.bitcast_convert_type(
                w, dtype).astype(jnp.float32).reshape(shape),
            dtype.itemsize * m)

  def encode(self, x: jax.Array, key: jax.Array | None = None):
    """One tensor's message and what it stands for.

    Args:
      x: the tensor (any float dtype; selected in float32).
      key: PRNG key for a stochastic value codec.

    Returns:
      ``(message, transmitted)``: the message pytree, and the float32
      tensor of ``x.shape`` that receivers decode from it (what error
      feedback subtracts).
    """
    return _jit_encode(self, x, key)

  def _encode(self, x, key):
    x = _unsharded(x)
    info = self.info(x.shape)
    num_blocks, k = self.kept(x.shape)
    values, idx = dct.dct_topk_encode(x, k, self.chunk, use_dct=self.use_dct,
                                      index_dtype=np.int32)
    idx_enc, _, _ = _index_format(self.index_dtype, info.block_elems)
    val_enc, val_dec, _ = self._values(num_blocks * k)
    message = {'indices': idx_enc(idx), 'values': val_enc(values, key)}
    sent = val_dec(message['values'], (num_blocks, k), key)
    transmitted = dct.dct_topk_decode(sent, idx, x.shape, self.chunk,
                                      use_dct=self.use_dct)
    return message, transmitted

  def mean(self, gathered: Any, shape, key: jax.Array | None = None, *,
           aggregate: str = 'mean_of_selected') -> jax.Array:
    """The float32 tensor that the messages of all workers average to.

    Args:
      gathered: the messages of every worker, stacked on a leading axis.
      shape: the tensor's shape.
      key: the key the values were decoded with (shared codecs).
      aggregate: ``'mean_of_selected'`` or ``'mean_over_workers'`` (see
        :func:`loc_opt.compression.dct.scatter_mean`).

    Returns:
      float32 tensor of ``shape``.
    """
    return _jit_mean(self, gathered, tuple(shape), key, aggregate)

  def _mean(self, gathered, shape, key, aggregate):
    info = self.info(shape)
    num_blocks, k = self.kept(shape)
    _, idx_dec, _ = _index_format(self.index_dtype, info.block_elems)
    _, val_dec, _ = self._values(num_blocks * k)
    idx = jax.vmap(lambda w: idx_dec(w, (num_blocks, k)))(
        gathered['indices'])
    values = jax.vmap(lambda w: val_dec(w, (num_blocks, k), key))(
        gathered['values'])
    return dct.dct_topk_decode_mean(idx, values, tuple(shape), self.chunk,
                                    use_dct=self.use_dct, aggregate=aggregate)

  def payload_bytes(self, shape) -> int:
    """Bytes of one tensor's message (one worker, one exchange)."""
    info = self.info(shape)
    num_blocks, k = self.kept(shape)
    m = num_blocks * k
    return _index_format(self.index_dtype, info.block_elems)[2](m) + (
        self._values(m)[2])


# Jitted so that eager calls (one op at a time otherwise) run as one program;
# under an outer jit, vmap or shard_map they are inlined.
# pylint: disable=protected-access
_jit_encode = jax.jit(SparseTiles._encode, static_argnums=0)
_jit_mean = jax.jit(SparseTiles._mean, static_argnums=(0, 2, 4))
# pylint: enable=protected-access


def exchange(messages: Any, comm: compression.Comm | None) -> Any:
  """Every worker's message, stacked on a leading axis: one all-gather of
  all leaves packed into a byte buffer, spread over each worker's devices
  (a length-1 axis without a worker axis)."""
  if comm is None:
    return jax.tree.map(lambda x: x[None], messages)
  return comm.all_gather_packed(messages)


def tree_bytes(tiles: SparseTiles, params: Any) -> int:
  """Bytes of the messages of every leaf of ``params`` (one worker)."""
  return sum(tiles.payload_bytes(jnp.shape(x))
             for x in jax.tree.leaves(params))


def check_tile_args(topk: int, chunk: int, index_dtype: Any) -> None:
  """Raises ValueError naming a bad ``topk``, ``chunk`` or ``index_dtype``
  (``'uint12'`` needs tiles of at most 4096 elements)."""
  _checks.positive_int(topk, 'topk', arrays=True)
  chunk = _checks.positive_int(chunk, 'chunk', arrays=True)
  _check_index_dtype(index_dtype)
  if isinstance(index_dtype, str) and chunk * chunk > 1 << 12:
    raise ValueError(f'index_dtype {UINT12!r} holds tiles of up to 4096 '
                     f'elements; tile side {chunk} makes {chunk * chunk}')
