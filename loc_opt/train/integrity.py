"""What a checkpoint's arrays hold: a digest of each, and whether it is finite.

:func:`inspect` reads each array of a tree where its bytes already are:
every process looks only at the shards it holds (one copy of each shard:
``replica_id == 0``), hashes them on the host and checks their finiteness,
and the processes add up their partial digests (one small all-gather of 12
bytes per array when there are several processes). The digest of an array
is a sum over its elements, modulo 2**64, of a 32-bit mix (MurmurHash3's
finaliser) of each 32-bit word of the element's bits with its index in the
whole array and the dtype, so it is the same however the array is sharded
(a restore onto another mesh, an elastic resume), and a change of an
element's bytes changes it except with probability about 2**-32. It is a
checksum against corruption (flipped or overwritten bytes, a file of
another step), not a cryptographic hash against tampering. On the host it
costs a few array passes over the state (in-place NumPy on 32-bit words,
leaves in parallel threads).

``loc_opt.train.checkpoint`` writes the digests of the saved state as a JSON
item ``digests`` beside it, recomputes them on the restored arrays, and
treats a mismatch as an unreadable checkpoint; before a save it refuses a
state with a non-finite leaf, named (:func:`first_non_finite`).
"""

from concurrent import futures
import os
from typing import Any

import jax
import numpy as np

ALGORITHM = 'loc_opt-murmur32-sum64-v1'

_K1 = np.uint32(0x9E3779B1)
_K2 = np.uint32(0x85EBCA6B)
_K3 = np.uint32(0xC2B2AE35)
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def leaf_name(path: tuple) -> str:
  """A tree path as dotted names: ``per_worker.opt_state.inner_state.0.mu``."""
  parts = []
  for k in path:
    for attr in ('key', 'name', 'idx'):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return '.'.join(parts)


def _mix(x: np.ndarray) -> None:
  """MurmurHash3's 32-bit finaliser, in place."""
  x ^= x >> np.uint32(16)
  x *= _K2
  x ^= x >> np.uint32(13)
  x *= _K3
  x ^= x >> np.uint32(16)


def _flat_index(shape: tuple[int, ...], index: tuple[slice, ...],
                words: int) -> np.ndarray:
  """The row-major index (mod 2**32) of each 32-bit word of the block
  ``index`` (slices) of an array of ``shape`` whose elements have
  ``words`` words each: uint32 of the block's shape (with a last axis of
  ``words`` when it is above 1)."""
  shape, index = tuple(shape) + (words,), tuple(index) + (slice(None),)
  flat = np.zeros((1,) * len(shape), np.uint32)
  stride = 1
  for dim in reversed(range(len(shape))):
    start, stop, _ = index[dim].indices(shape[dim])
    axis = np.arange(start, stop, dtype=np.uint64) * np.uint64(stride)
    axis = (axis & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    flat = flat + axis.reshape((-1,) + (1,) * (len(shape) - dim - 1))
    stride *= shape[dim]
  return flat if words > 1 else flat[..., 0]


def _block_digest(block: np.ndarray, shape, index, dtype_code: int) -> int:
  """The digest's part of one block (a sum of uint32 words, exact in
  uint64; a Python int)."""
  if block.size == 0:
    return 0
  block = np.ascontiguousarray(block)
  width = block.dtype.itemsize
  if width in _UNSIGNED:
    x = block.view(_UNSIGNED[width]).astype(np.uint32)  # a copy to mix
    words = 1
  else:  # 8 bytes and more: their 32-bit words
    words = width // 4
    x = block.view(np.uint32).reshape(block.shape + (words,)).copy()
  with np.errstate(over='ignore'):
    x *= _K1
    x += np.uint32(dtype_code & 0xFFFFFFFF)
    _mix(x)
    x += _flat_index(shape, index, words)
    _mix(x)
    return int(np.sum(x, dtype=np.uint64))


def _finite(block: np.ndarray) -> bool:
  if not np.issubdtype(block.dtype, np.inexact) and \
      block.dtype.kind not in 'fc' and 'float' not in block.dtype.name:
    return True
  return bool(np.isfinite(block).all())


def _dtype_code(dtype: np.dtype) -> int:
  return sum(ord(c) << (8 * (i % 7)) for i, c in enumerate(str(dtype)))


def _leaf_parts(x: Any) -> tuple[int, bool]:
  """This process's part of ``x``'s digest, and whether its blocks here are
  finite."""
  if isinstance(x, jax.Array):
    shape, code = x.shape, _dtype_code(x.dtype)
    total, finite = 0, True
    for shard in x.addressable_shards:
      if shard.replica_id != 0:
        continue
      block = np.asarray(shard.data)
      total += _block_digest(block, shape, shard.index, code)
      finite = finite and _finite(block)
    return total % 2**64, finite
  if jax.process_index() != 0:  # a host value: every process has it whole
    return 0, True
  block = np.asarray(x)
  index = tuple(slice(None) for _ in block.shape)
  return (_block_digest(block, block.shape, index, _dtype_code(block.dtype)),
          _finite(block))


def inspect(tree: Any) -> tuple[dict[str, str], dict[str, bool]]:
  """``(digests, finite)`` of every leaf of ``tree`` by :func:`leaf_name`:
  the hex digest of its bytes (the same on every process) and whether
  every element is finite (integer leaves always are)."""
  named = [(leaf_name(p), x)
           for p, x in jax.tree_util.tree_leaves_with_path(tree)]
  # NumPy's array passes release the GIL: leaves in parallel threads.
  workers = max(1, min(8, os.cpu_count() or 1, len(named)))
  with futures.ThreadPoolExecutor(workers) as pool:
    parts = list(pool.map(_leaf_parts, [x for _, x in named]))
  sums = np.array([p[0] for p in parts], np.uint64)
  finite = np.array([p[1] for p in parts], bool)
  if jax.process_count() > 1 and named:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    words = np.concatenate([sums.view(np.uint32),
                            (~finite).astype(np.uint32)])
    gathered = np.asarray(multihost_utils.process_allgather(words))
    n = len(named)
    with np.errstate(over='ignore'):
      sums = np.sum(np.ascontiguousarray(gathered[:, :2 * n]).view(np.uint64),
                    axis=0, dtype=np.uint64)
    finite = ~np.any(gathered[:, 2 * n:] != 0, axis=0)
  digests = {name: f'{int(s):016x}' for (name, _), s in zip(named, sums)}
  return digests, {name: bool(f) for (name, _), f in zip(named, finite)}


def first_non_finite(finite: dict[str, bool]) -> str | None:
  """The first leaf (by name) of :func:`inspect`'s ``finite`` that is not."""
  bad = [name for name, ok in finite.items() if not ok]
  return bad[0] if bad else None


def mismatches(saved: dict[str, str], now: dict[str, str]) -> list[str]:
  """The leaves whose digest in ``now`` differs from ``saved`` (a leaf
  missing from either counts)."""
  return sorted(name for name in set(saved) | set(now)
                if saved.get(name) != now.get(name))
