r"""Chunked DCT, tiles and per-tile top-k, as DeMo and SparseLoCo send them.

DeMo extracts the "fast" components of each worker's momentum with a
block-wise discrete cosine transform and sends the ``k`` largest
coefficients of every block; SparseLoCo sends the ``k`` largest entries of
every tile of its error-feedback buffer, without the transform. Both tile a
tensor the same way:

* per dimension of size ``s`` the chunk is the largest divisor of ``s`` that
  is at most ``chunk`` (64), so tiles cover the tensor exactly without
  padding;
* a 2-D tensor ``[R, C]`` is cut into ``c_r x c_c`` tiles, a 1-D tensor into
  segments of ``c``, and a tensor of higher rank is first reshaped to
  ``[dim0, prod(rest)]``;
* the transform of a tile is the separable orthonormal DCT-II,
  ``D_r X D_c^T`` (``D x`` for a segment), so the inverse is the transpose
  and the round trip is exact up to float rounding.

Tiles are laid out as ``[num_blocks, block_elems]`` (row-major over the grid
of tiles, each tile row-major), top-k runs along the last axis and its
indices are tile-local, hence compact (uint16 for a 64 x 64 tile, 12 bits
would do; see :func:`loc_opt.compression.sparse.pack_uint12`).
:func:`scatter_mean` averages the gathered ``(indices, values)`` of all
workers deterministically.

A dimension with no divisor between 2 and ``chunk`` (a prime above
``chunk``, e.g. 67) gets chunk 1: no transform along it, and along both axes
a tile of one element, whose top-1 is the whole tensor (dense transmission).
:func:`chunk_sizes` warns when that happens; pad such dimensions (a
vocabulary of 50257 = 29 x 1733 gets 29-wide chunks) or choose ``chunk``.

Everything is computed in float32 (the basis too), whatever the input dtype.

References:
  Ahmed, Natarajan, Rao, *Discrete Cosine Transform*, 1974.
  Peng, Quesnelle, Kingma, *DeMo: Decoupled Momentum Optimization*, 2024.
  Sarfi, Thérien, Lidin, Belilovsky, *Communication Efficient LLM
  Pre-training with SparseLoCo*, 2025.
"""

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from loc_opt import _checks
from loc_opt.compression import sparse

_HIGHEST = jax.lax.Precision.HIGHEST
AGGREGATES = ('mean_of_selected', 'mean_over_workers')


# -------------------------------------------------------------- chunking ---
def chunk_size(size: int, chunk: int = 64) -> int:
  """The largest divisor of ``size`` that is at most ``chunk``.

  Args:
    size: a dimension's length.
    chunk: the largest chunk allowed.

  Returns:
    The chunk (1 for a prime ``size`` above ``chunk``; 1 for ``size <= 1``).
  """
  _checks.positive_int(chunk, 'chunk', arrays=True)
  for c in range(min(size, chunk), 1, -1):
    if size % c == 0:
      return c
  return 1


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
  """The 1-D or 2-D shape a tensor is tiled as.

  Scalars become ``(1,)``, vectors stay, matrices stay, and higher ranks
  become ``(dim0, prod(rest))``.
  """
  shape = tuple(int(d) for d in shape)
  if not shape:
    return (1,)
  if len(shape) <= 2:
    return shape
  return (shape[0], math.prod(shape[1:]))


def chunk_sizes(shape: tuple[int, ...], chunk: int = 64) -> tuple[int, ...]:
  """Tile sides of a tensor: :func:`chunk_size` of each tiled dimension.

  Warns when a dimension longer than 1 gets chunk 1 (no divisor between 2
  and ``chunk``): the transform then does nothing along it.

  Args:
    shape: the tensor's shape.
    chunk: the largest tile side.

  Returns:
    ``(c,)`` for tensors tiled as vectors, ``(c_r, c_c)`` otherwise.
  """
  dims = matrix_shape(shape)
  out = tuple(chunk_size(d, chunk) for d in dims)
  for d, c in zip(dims, out):
    if c == 1 and d > 1:
      warnings.warn(
          f'dimension {d} of shape {tuple(shape)} has no divisor in '
          f'[2, {chunk}]: chunk 1, so no DCT along it (pad it or change '
          'chunk)', stacklevel=2)
  return out


@dataclasses.dataclass(frozen=True)
class BlockInfo:
  """How a tensor is cut into tiles (static, hashable).

  Attributes:
    shape: the tensor's shape.
    matrix: the 1-D or 2-D shape it is tiled as (:func:`matrix_shape`).
    chunks: the tile's sides, one per entry of ``matrix``.
  """

  shape: tuple[int, ...]
  matrix: tuple[int, ...]
  chunks: tuple[int, ...]

  @property
  def grid(self) -> tuple[int, ...]:
    """Tiles along each tiled dimension."""
    return tuple(m // c for m, c in zip(self.matrix, self.chunks))

  @property
  def num_blocks(self) -> int:
    """Number of tiles."""
    return math.prod(self.grid)

  @property
  def block_elems(self) -> int:
    """Elements per tile."""
    return math.prod(self.chunks)


def block_info(shape: tuple[int, ...], chunk: int = 64) -> BlockInfo:
  """The :class:`BlockInfo` of a tensor of ``shape``."""
  shape = tuple(int(d) for d in shape)
  return BlockInfo(shape, matrix_shape(shape), chunk_sizes(shape, chunk))


def to_blocks(x: jax.Array, chunk: int = 64) -> tuple[jax.Array, BlockInfo]:
  """Cuts ``x`` into tiles.

  Args:
    x: a tensor of any rank.
    chunk: the largest tile side.

  Returns:
    ``(blocks, info)``: ``blocks[b]`` is tile ``b`` flattened row-major,
    shape ``[num_blocks, block_elems]``, tiles in row-major grid order;
    ``info`` the static :class:`BlockInfo` for :func:`from_blocks`.
  """
  info = block_info(jnp.shape(x), chunk)
  m = jnp.reshape(x, info.matrix)
  if len(info.matrix) == 1:
    return m.reshape(info.num_blocks, info.block_elems), info
  (gr, gc), (cr, cc) = info.grid, info.chunks
  blocks = m.reshape(gr, cr, gc, cc).transpose(0, 2, 1, 3)
  return blocks.reshape(info.num_blocks, info.block_elems), info


def from_blocks(blocks: jax.Array, info: BlockInfo) -> jax.Array:
  """Inverse of :func:`to_blocks`: the tensor of shape ``info.shape``."""
  if len(info.matrix) == 1:
    return blocks.reshape(info.shape)
  (gr, gc), (cr, cc) = info.grid, info.chunks
  m = blocks.reshape(gr, gc, cr, cc).transpose(0, 2, 1, 3)
  return m.reshape(info.shape)


# ------------------------------------------------------------- transform ---
@functools.lru_cache(maxsize=None)
def _basis_np(n: int) -> np.ndarray:
  k = np.arange(n, dtype=np.float64)[:, None]
  i = np.arange(n, dtype=np.float64)[None, :]
  d = np.cos(np.pi * (2.0 * i + 1.0) * k / (2.0 * n)) * np.sqrt(2.0 / n)
  d[0] /= np.sqrt(2.0)
  out = d.astype(np.float32)
  out.setflags(write=False)
  return out


def dct_basis(n: int) -> jax.Array:
  r"""The orthonormal DCT-II matrix of size ``n`` in float32.

  .. math::

    D_{ki} = \alpha_k \cos\frac{\pi (2 i + 1) k}{2 n}, \quad
    \alpha_0 = \sqrt{1/n},\ \alpha_{k>0} = \sqrt{2/n},

  so ``D D^T = I``, the coefficients of ``x`` are ``D x`` and the inverse
  (DCT-III) is ``D^T``. Built in float64 and rounded once.

  Args:
    n: the transform length.

  Returns:
    float32 ``[n, n]``.
  """
  _checks.positive_int(n, 'DCT length', arrays=True)
  return jnp.asarray(_basis_np(n))


def _transform(blocks: jax.Array, chunks: tuple[int, ...],
               inverse: bool) -> jax.Array:
  """The (inverse) separable DCT of every tile of ``blocks``."""
  blocks = blocks.astype(jnp.float32)
  if len(chunks) == 1:
    d = dct_basis(chunks[0])
    spec = 'ji,bj->bi' if inverse else 'ij,bj->bi'
    return jnp.einsum(spec, d, blocks, precision=_HIGHEST)
  cr, cc = chunks
  dr, dc = dct_basis(cr), dct_basis(cc)
  tiles = blocks.reshape(-1, cr, cc)
  spec = 'ji,bjk,kl->bil' if inverse else 'ij,bjk,lk->bil'
  out = jnp.einsum(spec, dr, tiles, dc, precision=_HIGHEST)
  return out.reshape(blocks.shape)


def block_dct(x: jax.Array, chunk: int = 64) -> jax.Array:
  """The DCT-II coefficients of every tile of ``x``.

  Args:
    x: a tensor of any rank (cast to float32).
    chunk: the largest tile side.

  Returns:
    float32 ``[num_blocks, block_elems]``, laid out like :func:`to_blocks`.
  """
  blocks, info = to_blocks(x, chunk)
  return _transform(blocks, info.chunks, inverse=False)


def block_idct(coeffs: jax.Array, shape: tuple[int, ...],
               chunk: int = 64) -> jax.Array:
  """Inverse of :func:`block_dct`: the float32 tensor of ``shape``."""
  info = block_info(shape, chunk)
  return from_blocks(_transform(coeffs, info.chunks, inverse=True), info)


# ------------------------------------------------------ per-tile top-k ---
def scaled_k(k: int, block_elems: int, reference: int = 4096) -> int:
  """SparseLoCo's per-tile ``k`` for tiles of another size.

  ``k`` is given for tiles of ``reference`` elements (64 x 64); a tile of
  ``block_elems`` keeps ``round(k * block_elems / reference)``, at least 1
  and at most ``block_elems`` (a 64-long segment keeps 2 at ``k = 128``).
  """
  return max(1, min(block_elems, round(k * block_elems / reference)))


def dct_topk_encode(
    x: jax.Array,
    k: int,
    chunk: int = 64,
    *,
    use_dct: bool = True,
    index_dtype=None,
) -> tuple[jax.Array, jax.Array]:
  """The ``k`` largest-magnitude (DCT) coefficients of every tile.

  Ties go to the lower index (``jax.lax.top_k``), so the choice is
  deterministic.

  Args:
    x: a tensor of any rank.
    k: entries kept per tile (clipped to the tile's size).
    chunk: the largest tile side.
    use_dct: transform the tiles first (DeMo); ``False`` selects the raw
      entries of each tile (SparseLoCo).
    index_dtype: dtype of the tile-local indices; default the narrowest
      unsigned type that holds ``block_elems - 1`` (uint16 for 64 x 64).

  Returns:
    ``(values, indices)``: signed float32 values and tile-local indices,
    both ``[num_blocks, k]``.
  """
  blocks, info = to_blocks(jnp.asarray(x, jnp.float32), chunk)
  if use_dct:
    blocks = _transform(blocks, info.chunks, inverse=False)
  kk = max(1, min(int(k), info.block_elems))
  _, idx = jax.lax.top_k(jnp.abs(blocks), kk)
  values = jnp.take_along_axis(blocks, idx, axis=1)
  dtype = (sparse.index_dtype_for(info.block_elems) if index_dtype is None
           else np.dtype(index_dtype))
  if np.iinfo(dtype).max < info.block_elems - 1:
    raise ValueError(f'index_dtype {dtype} cannot hold tile positions up to '
                     f'{info.block_elems - 1}')
  return values, idx.astype(dtype)


def scatter_blocks(values: jax.Array, indices: jax.Array,
                   block_elems: int) -> jax.Array:
  """One worker's ``(values, indices)`` ``[num_blocks, k]`` as dense tiles."""
  num_blocks = values.shape[0]
  rows = jnp.arange(num_blocks, dtype=jnp.int32)[:, None]
  return jnp.zeros((num_blocks, block_elems), jnp.float32).at[
      rows, indices.astype(jnp.int32)].set(
          values.astype(jnp.float32), unique_indices=True)


def dct_topk_decode(
    values: jax.Array,
    indices: jax.Array,
    shape: tuple[int, ...],
    chunk: int = 64,
    *,
    use_dct: bool = True,
) -> jax.Array:
  """The tensor that one worker's :func:`dct_topk_encode` output stands for.

  Args:
    values: float ``[num_blocks, k]``.
    indices: tile-local integer ``[num_blocks, k]``.
    shape: the tensor's shape.
    chunk: the largest tile side (as at encoding).
    use_dct: as at encoding.

  Returns:
    float32 tensor of ``shape``: the kept entries scattered into zero tiles,
    inverse-transformed when ``use_dct``.
  """
  info = block_info(shape, chunk)
  dense = scatter_blocks(values, indices, info.block_elems)
  if use_dct:
    dense = _transform(dense, info.chunks, inverse=True)
  return from_blocks(dense, info)


def scatter_mean(
    indices: jax.Array,
    values: jax.Array,
    block_elems: int,
    *,
    aggregate: str = 'mean_of_selected',
) -> jax.Array:
  """Averages the sparse tiles that several workers sent.

  Each worker's ``(indices, values)`` is scattered into zero tiles and the
  results are summed in worker order, together with how many workers chose
  each entry. Within one worker the indices of a tile are distinct, so each
  scatter has no collisions and the sum has a fixed order: the result is
  bitwise reproducible, unlike a scatter-add of colliding indices (atomic on
  GPUs), and identical on every worker that runs it on the same gathered
  data.

  Args:
    indices: tile-local integers ``[workers, num_blocks, k]``.
    values: float ``[workers, num_blocks, k]``.
    block_elems: elements per tile.
    aggregate: ``'mean_of_selected'`` divides each entry by the number of
      workers that chose it (DeMo's and SparseLoCo's reference code; an entry
      one worker chose enters at full weight); ``'mean_over_workers'``
      divides by the number of workers (the mean of the decoded messages).

  Returns:
    float32 ``[num_blocks, block_elems]``.
  """
  _checks.one_of(aggregate, 'aggregate', AGGREGATES)
  workers, num_blocks = values.shape[:2]
  rows = jnp.arange(num_blocks, dtype=jnp.int32)[:, None]

  def scatter(base, idx, val):
    return base.at[rows, idx.astype(jnp.int32)].add(val, unique_indices=True)

  def add(carry, sent):
    total, count = carry
    idx, val = sent
    total = scatter(total, idx, val.astype(jnp.float32))
    count = scatter(count, idx, jnp.ones(idx.shape, jnp.int32))
    return (total, count), None

  # The first worker's tiles start the sums, so the carry has the type of
  # the data (under shard_map, its varying manual axes) from the start.
  first = add((jnp.zeros((num_blocks, block_elems), jnp.float32),
               jnp.zeros((num_blocks, block_elems), jnp.int32)),
              (indices[0], values[0]))[0]
  (total, count), _ = jax.lax.scan(add, first, (indices[1:], values[1:]))
  if aggregate == 'mean_over_workers':
    return total / workers
  return total / jnp.maximum(count, 1).astype(jnp.float32)


def dct_topk_decode_mean(
    indices: jax.Array,
    values: jax.Array,
    shape: tuple[int, ...],
    chunk: int = 64,
    *,
    use_dct: bool = True,
    aggregate: str = 'mean_of_selected',
) -> jax.Array:
  """The tensor that the gathered messages of all workers average to.

  :func:`scatter_mean`, then the inverse transform (when ``use_dct``) and
  the tiles put back into ``shape``.

  Args:
    indices: tile-local integers ``[workers, num_blocks, k]``.
    values: float ``[workers, num_blocks, k]``.
    shape: the tensor's shape.
    chunk: the largest tile side.
    use_dct: as at encoding.
    aggregate: see :func:`scatter_mean`.

  Returns:
    float32 tensor of ``shape``.
  """
  info = block_info(shape, chunk)
  dense = scatter_mean(indices, values, info.block_elems, aggregate=aggregate)
  if use_dct:
    dense = _transform(dense, info.chunks, inverse=True)
  return from_blocks(dense, info)
