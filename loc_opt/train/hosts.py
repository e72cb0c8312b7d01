"""Several processes (one per host) in one run: input, output and writing.

Each process reads only the batch rows its addressable devices hold and
hands them to ``jax.make_array_from_process_local_data``; no process builds
a global batch. Values that live on other processes' devices (per-worker
losses, counters) come back to every host through
``jax.experimental.multihost_utils.process_allgather``. Process 0 alone
writes metrics, summaries and progress. With one process all of this is the
single-process behaviour, bit for bit.
"""

from collections.abc import Callable
from typing import Any

import jax
from jax.experimental import multihost_utils
import numpy as np


def is_writer() -> bool:
  """Whether this process writes metrics, summaries and progress."""
  return jax.process_index() == 0


def process_block(sharding: jax.sharding.Sharding,
                  global_shape: tuple[int, ...]) -> tuple[slice, ...]:
  """The smallest block of a ``global_shape`` array that holds every shard
  this process's devices hold (``start``/``stop`` always set).

  Raises:
    ValueError: if the block holds rows of other processes only (the
      process's shards are not one contiguous block), which
      ``make_array_from_process_local_data`` could not place.
  """
  indices = sharding.addressable_devices_indices_map(global_shape).values()
  block = []
  for dim, size in enumerate(global_shape):
    spans = [idx[dim].indices(size)[:2] for idx in indices]
    lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
    covered = sum(b - a for a, b in sorted(set(spans)))
    if covered < hi - lo:
      raise ValueError(
          f'the devices of process {jax.process_index()} hold a '
          f'non-contiguous part of dimension {dim} of a {global_shape} batch; '
          'lay the mesh out so that each process holds one block')
    block.append(slice(lo, hi))
  return tuple(block)


def global_batch(sharding: jax.sharding.Sharding,
                 global_shape: tuple[int, ...],
                 read: Callable[[tuple[slice, ...]], np.ndarray]) -> jax.Array:
  """A global array of ``global_shape`` whose process-local block is
  ``read(block)`` (see :func:`process_block`)."""
  global_shape = tuple(int(s) for s in global_shape)
  local = read(process_block(sharding, global_shape))
  return jax.make_array_from_process_local_data(sharding, local,
                                                global_shape)


def lm_rows_block(rows_fn: Callable[[int, int], np.ndarray],
                  per_worker: int | None, block: tuple[slice, ...]
                  ) -> np.ndarray:
  """The ``block`` of a ``[rows, len]`` batch (``per_worker`` None) or of a
  ``[workers, per_worker, len]`` one, from ``rows_fn(start, stop)``, the
  rows ``start:stop`` of the flat ``[rows, len]`` batch."""
  if per_worker is None:
    return rows_fn(block[0].start, block[0].stop)[:, block[1]]
  return np.stack([
      rows_fn(w * per_worker + block[1].start,
              w * per_worker + block[1].stop)[:, block[2]]
      for w in range(block[0].start, block[0].stop)])


def fetch(x: Any) -> np.ndarray:
  """``x`` as a NumPy array on this host, also where other processes'
  devices hold parts of it (every process must call this together)."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
