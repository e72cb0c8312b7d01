"""A learner of several processes: its mesh, its replicated values, and the
decisions its processes take together.

A learner may be one process or several joined by their own
``jax.distributed`` (``--local_processes=N``, or the layout flags, as
``loc-opt-train`` takes them; :mod:`loc_opt.train.local_launch`). Its mesh
spans the devices of all its processes (one ``data`` axis: the learner's
rows split over them, the parameters and inner state replicated), so each
inner step is one SPMD program whose gradient all-reduce crosses processes.

Everything the learner reads from the store that decides what it does next
(the version to take, its payload number, whose inner state to take) is
decided by process 0 and broadcast, so all processes take the same branch;
each process then reads the chosen version itself. A read that fails on any
process (the version was deleted meanwhile) fails for all
(:func:`all_true`). With one process every function here is the identity.
"""

from typing import Any

import jax
from jax.experimental import multihost_utils
import numpy as np

_TEXT = 256  # bytes of a broadcast string


def mesh() -> jax.sharding.Mesh:
  """A ``data`` mesh over every device of every process of the learner."""
  return jax.sharding.Mesh(np.array(jax.devices()), ('data',))


def replicated(tree: Any, mesh_: jax.sharding.Mesh) -> Any:
  """``tree`` (host arrays, the same on every process) as arrays replicated
  over ``mesh_``."""
  sharding = jax.sharding.NamedSharding(mesh_, jax.sharding.PartitionSpec())

  def one(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])
  return jax.tree.map(one, tree)


def agree(values: Any) -> np.ndarray:
  """``values`` (int64) as process 0 has them, on every process."""
  values = np.asarray(values, np.int64)
  if jax.process_count() == 1:
    return values
  return np.asarray(multihost_utils.broadcast_one_to_all(values))


def agree_text(text: str) -> str:
  """``text`` as process 0 has it, on every process."""
  if jax.process_count() == 1:
    return text
  raw = text.encode()
  if len(raw) > _TEXT:
    raise ValueError(f'{text[:40]!r}... is longer than {_TEXT} bytes')
  buf = np.zeros(_TEXT + 1, np.int64)
  buf[0] = len(raw)
  buf[1:1 + len(raw)] = np.frombuffer(raw, np.uint8)
  got = agree(buf)
  return bytes(got[1:1 + got[0]].astype(np.uint8)).decode()


def all_true(ok: bool) -> bool:
  """Whether ``ok`` holds on every process."""
  if jax.process_count() == 1:
    return bool(ok)
  flags = multihost_utils.process_allgather(np.array([int(bool(ok))],
                                                     np.int32))
  return bool(np.all(flags))
