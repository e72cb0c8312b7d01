"""Meshes whose outermost axis is the worker axis.

A *worker* (one DiLoCo replica) is a group of devices: one slice of the
outermost mesh axis, named ``worker``. Inside a worker the usual axes
``data``, ``fsdp`` and ``tensor`` shard the batch and the model. On a
multi-slice TPU job the worker axis spans slices (DCN) and the inner axes stay
inside a slice (ICI).
"""

import collections
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
  worker axis crosses slices. Within a slice, devices are grouped by
  ``process_index`` (one process per host), otherwise keeping the backend's
  order. The layout must fit the processes (:func:`check_process_layout`).

  Args:
    devices: the devices to arrange (anything with ``id`` and optionally
      ``slice_index``).
    shape: the four axis sizes.

  Returns:
    An object array of devices of the given shape.

  Raises:
    ValueError: if the device count does not equal the product of ``shape``,
      or workers cannot be laid out across slices or processes.
  """
  shape = tuple(int(s) for s in shape)
  n = math.prod(shape)
  if len(devices) != n:
    raise ValueError(
        f'mesh shape {dict(zip(AXES, shape))} needs {n} devices, but '
        f'{len(devices)} are available; choose worker * data * fsdp * tensor '
        f'= {len(devices)}.'
    )
  devices = sorted(devices, key=_process)  # stable: one process unchanged
  slices = sorted({getattr(d, 'slice_index', 0) or 0 for d in devices})
  if len(slices) <= 1:
    array = np.array(list(devices), dtype=object).reshape(shape)
    check_process_layout(array)
    return array
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
  array = np.concatenate(ordered, axis=0)
  check_process_layout(array)
  return array


def _process(device: Any) -> int:
  return getattr(device, 'process_index', 0) or 0


def check_process_layout(array: np.ndarray) -> None:
  """Checks that the workers of a ``(worker, ...)`` device array fit the
  processes: each worker lies inside one process, or holds every device of
  each process it touches (a worker spanning whole hosts). Several workers
  may share a process.

  Raises:
    ValueError: naming the first worker that holds part of a process whose
      other devices belong to other workers.
  """
  per_process = collections.Counter(_process(d) for d in array.reshape(-1))
  if len(per_process) <= 1:
    return
  for w in range(array.shape[0]):
    held = collections.Counter(_process(d) for d in array[w].reshape(-1))
    if len(held) > 1:
      partial = sorted(p for p in held if held[p] != per_process[p])
      if partial:
        raise ValueError(
            f'worker {w} spans processes {sorted(held)} but holds only '
            f'{held[partial[0]]} of the {per_process[partial[0]]} devices of '
            f'process {partial[0]}; a worker must lie inside one process or '
            'hold whole processes: choose mesh.workers so that the devices '
            f'per worker ({array[w].size}) divide or are a multiple of the '
            'devices per process')


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
