"""Codecs: what a worker puts on the wire for one array, and how it is read.

A :class:`Codec` is a pure pair ``encode(x, key) -> payload`` /
``decode(payload, n, key) -> x_hat`` over a flat float array, plus the
theoretical payload size. Payloads are pytrees of arrays whose dtypes are what
crosses the link (int8 values travel as int8, 4-bit codes two to a uint8, not
as dequantized fp32).

Codecs are stateless; state (error feedback, warm starts) lives in the
compressors of :mod:`loc_opt.compression.compressor`, which turn any codec
into a mean over workers. This module holds the interface and the identity;
the quantizers are in :mod:`loc_opt.compression.quant` and the sparsifiers in
:mod:`loc_opt.compression.sparse`.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Codec(NamedTuple):
  """An encode/decode pair over flat arrays.

  Attributes:
    name: registry name.
    encode: ``(x[n], key=None) -> payload`` (a pytree of arrays); ``n`` is a
      multiple of ``block_size``. ``key`` is a PRNG key (see ``randomness``).
    decode: ``(payload, n, key=None) -> x_hat[n]`` in float32; ``key`` is the
      key the payload was encoded with when ``randomness == 'shared'``.
    payload_bytes: ``n -> bytes`` one worker sends for ``n`` elements.
    block_size: inputs are padded to a multiple of this.
    exact: whether ``decode(encode(x)) == x``.
    linear: whether payloads are float arrays that can be averaged over
      workers before decoding (``decode(mean(payloads)) == mean(decode)``):
      such codecs are reduced with an all-reduce of the payload instead of an
      all-gather (the identity; random-k with a shared mask).
    randomness: ``'none'`` (deterministic), ``'per_worker'`` (independent
      draws per worker, e.g. stochastic rounding; the caller folds in the
      worker index) or ``'shared'`` (the same draw on every worker, e.g. a
      random-k mask; decoding needs the same key).
    per_tensor: whether the codec's statistics (an absmax scale, a mean and
      table) span the whole array it encodes (``block_size=None``): a
      compressor then encodes each tensor of a tree on its own, so that
      every tensor gets its own scale, instead of one buffer of all of them.
  """

  name: str
  encode: Callable[..., Any]
  decode: Callable[..., jax.Array]
  payload_bytes: Callable[[int], int]
  block_size: int = 1
  exact: bool = False
  linear: bool = False
  randomness: str = 'none'
  per_tensor: bool = False


def identity() -> Codec:
  """No compression: fp32 values, averaged with an all-reduce."""
  return Codec(
      name='none',
      encode=lambda x, key=None: x.astype(jnp.float32),
      decode=lambda payload, n, key=None: payload[:n].astype(jnp.float32),
      payload_bytes=lambda n: 4 * n,
      exact=True,
      linear=True,
  )
