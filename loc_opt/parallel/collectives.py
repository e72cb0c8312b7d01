"""Cross-worker collectives that use the mesh inside each worker.

A worker's devices usually hold replicated copies of a value (data
parallelism) or shards of it (FSDP). A plain ``pmean`` over the worker axis
then sends one full copy per data-parallel replica across workers, although
each worker has only one value to contribute. :func:`worker_mean` first
spreads the value over the worker's own devices, so every element crosses the
worker boundary once per worker, and lets GSPMD gather it back inside the
worker (fast links) afterwards.
"""

from collections.abc import Callable, Sequence
import math
from typing import Any

import jax
import jax.numpy as jnp

from loc_opt import compression
from loc_opt.parallel import mesh as mesh_lib


def worker_mean(
    axis_name: str = mesh_lib.WORKER,
    *,
    spread_over: Sequence[str] = mesh_lib.INNER_AXES,
    codec: compression.Codec | None = None,
) -> Callable[[Any], Any]:
  """A mean over ``axis_name`` that moves each element across workers once.

  For each leaf: flatten, pad to a multiple of the worker's device count,
  shard over the ``spread_over`` axes present in the current mesh, average
  over ``axis_name`` (through ``codec`` if given: only its payload crosses
  workers), unpad and reshape. Cross-worker traffic per worker is
  then the leaf's size (not size times data-parallel replicas); the gather
  back happens inside the worker.

  Use it inside ``jax.shard_map`` that is manual over ``axis_name`` and
  automatic over ``spread_over`` (``loc_opt.parallel.shard_map_workers``); it
  is the ``reduce_fn`` the trainer hands to ``loc_opt.diloco``. Outside a
  mesh context it is a plain ``pmean``.

  Args:
    axis_name: the worker axis.
    spread_over: the within-worker axes to spread each leaf over.
    codec: a ``loc_opt.compression`` codec; ``None`` sends fp32 values.

  Returns:
    ``tree -> tree`` computing the mean over workers.
  """

  block = 1 if codec is None else codec.block_size

  def leaf_mean(x):
    mesh = jax.sharding.get_abstract_mesh()
    names = getattr(mesh, 'axis_names', ()) or ()
    axes = tuple(a for a in spread_over if a in names and mesh.shape[a] > 1)
    if (not axes or x.size < 2) and (codec is None or codec.exact):
      return jax.lax.pmean(x, axis_name)
    devices = math.prod(mesh.shape[a] for a in axes)
    flat = compression.pad_to(x.reshape(-1).astype(jnp.float32),
                              devices * block)
    gather = None
    if axes:
      flat = jax.lax.with_sharding_constraint(flat, jax.P(axes))
      # Gather each device's own blocks of the payload across workers: an
      # all_gather over the worker axis of an auto-sharded value would first
      # gather it inside the worker and then send it all from every device.
      gather = jax.shard_map(
          lambda p: jax.lax.all_gather(p, axis_name),
          mesh=mesh, in_specs=jax.P(axes), out_specs=jax.P(None, axes),
          axis_names=set(axes))
    flat = compression.mean_flat(flat, codec, axis_name, gather=gather)
    return flat[:x.size].reshape(x.shape).astype(x.dtype)

  return lambda tree: jax.tree.map(leaf_mean, tree)
