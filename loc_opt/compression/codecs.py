"""Codecs: what a worker puts on the wire for one array, and how it is read.

A :class:`Codec` is a pure pair ``encode(x) -> payload`` / ``decode(payload,
size) -> x_hat`` over a flat float array, plus the theoretical payload size.
Payloads are pytrees of arrays whose dtypes are what crosses the link (int8
values travel as int8, not as dequantized fp32).

This module starts with the identity and block-wise int8. Error feedback,
sub-byte packing, sparsification and low-rank codecs build on the same
interface.

References:
  Dettmers, Lewis, Shleifer, Zettlemoyer, *8-bit Optimizers via Block-wise
  Quantization*, 2022 (block-wise absmax scaling).
"""

from collections.abc import Callable, Mapping
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Codec(NamedTuple):
  """An encode/decode pair over flat arrays.

  Attributes:
    name: registry name.
    encode: ``x[n] -> payload`` (a pytree of arrays); ``n`` is a multiple of
      ``block_size``.
    decode: ``(payload, n) -> x_hat[n]`` in float32.
    payload_bytes: ``n -> bytes`` one worker sends for ``n`` elements.
    block_size: inputs are padded to a multiple of this.
    exact: whether ``decode(encode(x)) == x``; exact codecs are averaged with
      a plain all-reduce.
  """

  name: str
  encode: Callable[[jax.Array], Any]
  decode: Callable[[Any, int], jax.Array]
  payload_bytes: Callable[[int], int]
  block_size: int = 1
  exact: bool = False


def identity() -> Codec:
  """No compression: fp32 values, averaged with an all-reduce."""
  return Codec(
      name='none',
      encode=lambda x: x,
      decode=lambda payload, n: payload[:n].astype(jnp.float32),
      payload_bytes=lambda n: 4 * n,
      exact=True,
  )


def int8(block_size: int = 256) -> Codec:
  r"""Block-wise absmax int8 quantization with round-to-nearest.

  Each block of ``block_size`` values is sent as int8 ``q = round(x / s)``
  with one fp32 scale ``s = max|x| / 127`` per block, so the error of every
  element is at most ``s / 2`` and the payload is ``n + 4 n / block_size``
  bytes (about 1/4 of fp32).

  Args:
    block_size: values per scale.

  Returns:
    The codec.
  """
  if block_size < 1:
    raise ValueError(f'block_size must be >= 1, got {block_size}')

  def encode(x):
    blocks = x.astype(jnp.float32).reshape(-1, block_size)
    scale = jnp.max(jnp.abs(blocks), axis=1, keepdims=True) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(blocks / safe), -127, 127).astype(jnp.int8)
    return {'values': q, 'scales': scale[:, 0]}

  def decode(payload, n):
    x = payload['values'].astype(jnp.float32) * payload['scales'][:, None]
    return x.reshape(-1)[:n]

  return Codec(
      name='int8',
      encode=encode,
      decode=decode,
      payload_bytes=lambda n: n + 4 * math.ceil(n / block_size),
      block_size=block_size,
  )


CODECS: Mapping[str, Callable[..., Codec]] = {
    'none': identity,
    'int8': int8,
}


def make_codec(name: str, **kwargs: Any) -> Codec:
  """Looks ``name`` up in :data:`CODECS`."""
  if name not in CODECS:
    raise ValueError(f'unknown codec {name!r} (field outer.codec); choose one '
                     f'of {sorted(CODECS)}')
  return CODECS[name](**kwargs)
