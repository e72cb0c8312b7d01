"""Packing of sub-byte codes into bytes, so that they cross the wire packed.

A 4-bit code travels two to a ``uint8`` and a 2-bit code four to a ``uint8``:
collectives only move whole bytes, and an array of ``uint8`` holding one
4-bit code each would cost twice its nominal size on the wire.

Codes are packed along the last axis, first code in the lowest bits::

  byte[j] = sum_i codes[per * j + i] << (bits * i),    per = 8 // bits

so packing a ``(blocks, block_size)`` array stays inside each block (and
inside each device when the blocks are sharded).

Example:
  >>> codes = jnp.array([1, 2, 15, 0], jnp.uint8)
  >>> pack_4bit(codes)          # [0x21, 0x0f]
  >>> unpack_4bit(pack_4bit(codes))  # codes
"""

import jax
import jax.numpy as jnp

from loc_opt import _checks

_WIDTHS = (1, 2, 4, 8)


def _check(bits: int, length: int) -> int:
  _checks.one_of(bits, 'bits', _WIDTHS)
  per = 8 // bits
  if length % per:
    raise ValueError(f'the last axis ({length}) must be a multiple of '
                     f'{per} to pack {bits}-bit codes')
  return per


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
  """Packs ``bits``-wide codes along the last axis into ``uint8``.

  Args:
    codes: integer array of codes in ``[0, 2**bits)`` (higher bits are
      dropped; signed codes may be passed in two's complement); the last axis
      must be a multiple of ``8 // bits``.
    bits: code width, one of 1, 2, 4, 8.

  Returns:
    ``uint8`` array whose last axis is ``bits / 8`` times as long.
  """
  codes = jnp.asarray(codes)
  per = _check(bits, codes.shape[-1])
  mask = jnp.uint8((1 << bits) - 1)
  c = codes.astype(jnp.uint8) & mask
  if per == 1:
    return c
  c = c.reshape(c.shape[:-1] + (c.shape[-1] // per, per))
  out = c[..., 0]
  for i in range(1, per):
    out = out | (c[..., i] << jnp.uint8(bits * i))
  return out


def unpack_bits(packed: jax.Array, bits: int) -> jax.Array:
  """Inverse of :func:`pack_bits`: ``uint8`` codes in ``[0, 2**bits)``.

  Args:
    packed: ``uint8`` array from :func:`pack_bits`.
    bits: code width, one of 1, 2, 4, 8.

  Returns:
    ``uint8`` array whose last axis is ``8 / bits`` times as long.
  """
  packed = jnp.asarray(packed).astype(jnp.uint8)
  per = _check(bits, 0)
  if per == 1:
    return packed
  mask = jnp.uint8((1 << bits) - 1)
  parts = [(packed >> jnp.uint8(bits * i)) & mask for i in range(per)]
  out = jnp.stack(parts, axis=-1)
  return out.reshape(packed.shape[:-1] + (packed.shape[-1] * per,))


def pack_4bit(codes: jax.Array) -> jax.Array:
  """Two 4-bit codes per byte (see :func:`pack_bits`)."""
  return pack_bits(codes, 4)


def unpack_4bit(packed: jax.Array) -> jax.Array:
  """Unsigned 4-bit codes from :func:`pack_4bit`."""
  return unpack_bits(packed, 4)


def pack_2bit(codes: jax.Array) -> jax.Array:
  """Four 2-bit codes per byte (see :func:`pack_bits`)."""
  return pack_bits(codes, 2)


def unpack_2bit(packed: jax.Array) -> jax.Array:
  """Unsigned 2-bit codes from :func:`pack_2bit`."""
  return unpack_bits(packed, 2)


def to_signed_4bit(nibbles: jax.Array) -> jax.Array:
  """Reads unsigned nibbles as two's-complement int4, as ``int8``."""
  n = nibbles.astype(jnp.int8)
  return jnp.where(n >= 8, n - 16, n).astype(jnp.int8)
