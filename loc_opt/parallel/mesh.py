"""Meshes whose outermost axis is the worker axis.

A *worker* (one DiLoCo replica) is a group of devices: one slice of the
outermost mesh axis, named ``worker``. Inside a worker the usual axes
``data``, ``fsdp`` and ``tensor`` shard the batch and the model. On a
multi-slice TPU job the worker axis spans slices (DCN) and the inner axes stay
inside a slice (ICI).
"""

from collections.abc import Sequence
import math
from typing import Any

import jax
import numpy as np

from loc_opt import _checks

WORKER = 'worker'
DATA = 'data'
FSDP = 'fsdp'
TENSOR = 'tensor'
AXES = (WORKER, DATA, FSDP, TENSOR)
INNER_AXES = (DATA, FSDP, TENSOR)


def arrange_devices(
    devices: Sequence[Any], shape: Sequence[int]
) -> np.ndarray:
  """Orders ``devices`` into a (worker, data, fsdp, tensor) array.

  Devices are grouped by ``slice_index`` (multi-slice TPU) when there is more
  than one slice, so that each worker lies inside one slice and only the
  worker axis crosses slices. Within a slice the backend's device order is
  kept.

  Args:
    devices: the devices to arrange (anything with ``id`` and optionally
      ``slice_index``).
    shape: the four axis sizes.

  Returns:
    An object array of devices of the given shape.

  Raises:
    ValueError: if the device count does not equal the product of ``shape``,
      or workers cannot be laid out across slices.
  """
  shape = tuple(int(s) for s in shape)
  n = math.prod(shape)
  if len(devices) != n:
    raise ValueError(
        f'mesh shape {dict(zip(AXES, shape))} needs {n} devices, but '
        f'{len(devices)} are available; choose worker * data * fsdp * tensor '
        f'= {len(devices)}.'
    )
  slices = sorted({getattr(d, 'slice_index', 0) or 0 for d in devices})
  if len(slices) <= 1:
    return np.array(list(devices), dtype=object).reshape(shape)
  workers = shape[0]
  if workers % len(slices):
    raise ValueError(
        f'worker={workers} is not a multiple of the {len(slices)} slices; '
        'on a multi-slice job each worker must lie inside one slice.'
    )
  by_slice = [
      [d for d in devices if (getattr(d, 'slice_index', 0) or 0) == s]
      for s in slices
  ]
  sizes = {len(b) for b in by_slice}
  if len(sizes) != 1:
    raise ValueError(f'slices have unequal device counts: {sorted(sizes)}')
  per_slice = shape[1:]
  ordered = [
      np.array(b, dtype=object).reshape((-1,) + per_slice) for b in by_slice
  ]
  return np.concatenate(ordered, axis=0)


def make_worker_mesh(
    workers: int,
    data: int = 1,
    fsdp: int = 1,
    tensor: int = 1,
    *,
    devices: Sequence[Any] | None = None,
) -> jax.sharding.Mesh:
  """Builds a mesh with axes ``('worker', 'data', 'fsdp', 'tensor')``.

  Args:
    workers: number of workers (DiLoCo replicas); the outermost axis.
    data: data-parallel devices inside one worker.
    fsdp: devices a worker's parameters are fully sharded over.
    tensor: tensor-parallel devices inside one worker.
    devices: devices to use (default: all of ``jax.devices()``). Their number
      must be ``workers * data * fsdp * tensor``.

  Returns:
    A ``jax.sharding.Mesh`` with all axes of type ``Auto``: GSPMD shards the
    model inside a worker, and the worker runners make ``worker`` manual.

  Example:
    >>> mesh = make_worker_mesh(4, data=2)  # 8 devices: 4 workers x 2
  """
  sizes = {WORKER: workers, DATA: data, FSDP: fsdp, TENSOR: tensor}
  sizes = {name: _checks.positive_int(size, f'mesh axis {name!r}',
                                      arrays=True)
           for name, size in sizes.items()}
  devices = list(jax.devices() if devices is None else devices)
  array = arrange_devices(devices, tuple(sizes.values()))
  return jax.sharding.Mesh(
      array, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES)
  )


def num_workers(mesh: jax.sharding.Mesh, axis_name: str = WORKER) -> int:
  """The size of the worker axis of ``mesh`` (1 if it has none)."""
  return int(mesh.shape.get(axis_name, 1))


def devices_per_worker(mesh: jax.sharding.Mesh, axis_name: str = WORKER) -> int:
  """How many devices make up one worker."""
  return mesh.size // num_workers(mesh, axis_name)
