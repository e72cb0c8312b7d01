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
from typing import Any


from loc_opt import compression
from loc_opt.parallel import mesh as mesh_lib


def worker_mean(
    axis_name: str = mesh_lib.WORKER,
    *,
    spread_over: Sequence[str] = mesh_lib.INNER_AXES,
    codec: compression.Codec | None = None,
    bucket_size: int | None = None,
) -> Callable[[Any], Any]:
  """A mean over ``axis_name`` that moves each element across workers once.

  The fp32 mean (no ``codec``) packs leaves into flat buffers of at most
  ``bucket_size`` elements, pads each to a multiple of the worker's device
  count, shards it over the ``spread_over`` axes present in the current
  mesh, averages it over ``axis_name``, unpads and reshapes. Under FSDP or
  tensor parallelism (no data parallelism inside the worker) a leaf of at
  least ``bucket_size`` elements is averaged in its own shape and
  sharding instead, each device sending its own block: no flat buffer, no
  copy of the whole leaf or tree on a device
  (``loc_opt.compression.Comm.pmean_buckets``). With a ``codec`` only its
  payload crosses workers. Cross-worker traffic per worker is then the
  tree's size (not size times data-parallel replicas); any gather back
  happens inside the worker.

  Use it inside ``jax.shard_map`` that is manual over ``axis_name`` and
  automatic over ``spread_over`` (``loc_opt.parallel.shard_map_workers``); it
  is the ``reduce_fn`` the trainer hands to ``loc_opt.diloco``. Outside a
  mesh context it is a plain ``pmean``.

  Args:
    axis_name: the worker axis.
    spread_over: the within-worker axes to spread each leaf over.
    codec: a ``loc_opt.compression`` codec or stateless compressor; ``None``
      sends fp32 values.
    bucket_size: fp32: the most elements of one flat buffer (``None``: the
      default, ``loc_opt.compression.comm.BUCKET_SIZE``, 4M).

  Returns:
    ``tree -> tree`` computing the mean over workers.
  """

  def mean(tree):
    return compression.compressed_mean(tree, codec, axis_name,
                                       spread_over=tuple(spread_over),
                                       bucket_size=bucket_size)

  return mean
