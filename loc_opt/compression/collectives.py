"""Means over a worker axis where only the compressed payload crosses workers.

Exact codecs (the identity) use an all-reduce. Lossy codecs all-gather the
packed payloads (int8 values travel as int8) and every worker decodes and
averages them the same way, so all workers end with the same mean.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from loc_opt.compression import codecs as codecs_lib


def mean_flat(flat: jax.Array, codec: codecs_lib.Codec | None,
              axis_name: str, *,
              gather: Callable[[Any], Any] | None = None) -> jax.Array:
  """Mean over ``axis_name`` of a flat array padded to ``codec.block_size``.

  ``gather`` (optional) replaces ``lax.all_gather(payload, axis_name)``, e.g.
  to gather each device's own shard of the payload.
  """
  if codec is None or codec.exact:
    return jax.lax.pmean(flat, axis_name)
  payload = codec.encode(flat)
  if gather is None:
    gathered = jax.lax.all_gather(payload, axis_name)
  else:
    gathered = gather(payload)
  decoded = jax.vmap(lambda p: codec.decode(p, flat.size))(gathered)
  return jnp.mean(decoded, axis=0)


def pad_to(flat: jax.Array, multiple: int) -> jax.Array:
  return jnp.pad(flat, (0, (-flat.size) % multiple))


def compressed_mean(tree: Any, codec: codecs_lib.Codec | None,
                    axis_name: str) -> Any:
  """Averages every leaf of ``tree`` over ``axis_name`` through ``codec``.

  Args:
    tree: a pytree of float arrays (one worker's values).
    codec: the codec; ``None`` or an exact codec means a plain ``pmean``.
    axis_name: the worker axis.

  Returns:
    The mean, same structure, shapes and dtypes, identical on all workers.
  """

  def leaf(x):
    if codec is None or codec.exact:
      return jax.lax.pmean(x, axis_name)
    flat = pad_to(x.reshape(-1).astype(jnp.float32), codec.block_size)
    mean = mean_flat(flat, codec, axis_name)
    return mean[:x.size].reshape(x.shape).astype(x.dtype)

  return jax.tree.map(leaf, tree)
