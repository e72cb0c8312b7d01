r"""Quantization codecs: int8, int4, fp8, fp4 and a 2-bit statistical code.

Every codec here is a :class:`~loc_opt.compression.codecs.Codec` over a flat
float array split into blocks of ``block_size`` values (``None``: the whole
array is one block; such a codec is marked ``per_tensor`` and the
compressors of :mod:`~loc_opt.compression.compressor` encode each tensor of
a tree on its own, so that every tensor has its own scale). The block-wise *absmax* codecs send,
per block, one float32 scale and one low-precision code per value:

.. math::

  s = \max_{i \in \text{block}} |x_i| / Q_{\max}, \qquad
  y_i = x_i / s \in [-Q_{\max}, Q_{\max}], \qquad
  \hat x_i = s \, R(y_i),

where :math:`R` rounds onto the format's grid, either to the nearest point
(``rounding='nearest'``, deterministic, biased) or stochastically to one of
the two neighbouring points with probabilities that make
:math:`\mathbb{E}[R(y)] = y` (``rounding='stochastic'``, unbiased within the
range, which absmax scaling guarantees; the codec then has
``randomness='per_worker'`` and needs a key per worker).

======================  ===============================  ======  ===========
codec                   grid of :math:`R`                Q_max   bytes (n, B)
======================  ===============================  ======  ===========
``int8_codec``          integers in [-127, 127]          127     n + 4 n/B
``int4_codec``          integers in [-7, 7]              7       n/2 + 4 n/B
``fp8_codec('e4m3')``   float8_e4m3fn (with subnormals)  448     n + 4 n/B
``fp8_codec('e5m2')``   float8_e5m2 (with subnormals)    57344   n + 4 n/B
``fp4_codec('e2m1')``   ±{0, .5, 1, 1.5, 2, 3, 4, 6}      6       n/2 + 4 n/B
``fp4_codec('e3m0')``   ±{0, 2^-2, 2^-1, ..., 2^4}       16      n/2 + 4 n/B
``two_bit_codec``       4 per-block levels (see below)   --      n/4 + 20 n/B
======================  ===============================  ======  ===========

Payloads hold integer dtypes only (``int8`` or ``uint8`` codes, 4-bit codes
two per byte and 2-bit codes four per byte, see
:mod:`~loc_opt.compression.packing`) plus float32 per-block metadata: XLA on
CPU promotes collectives of low-precision floats, so fp8 values travel as
their ``uint8`` bit patterns.

References:
  Dettmers, Lewis, Shleifer, Zettlemoyer, *8-bit Optimizers via Block-wise
  Quantization*, 2022 (block-wise absmax scaling).

  Gupta, Agrawal, Gopalakrishnan, Narayanan, *Deep Learning with Limited
  Numerical Precision*, 2015 (stochastic rounding).

  Micikevicius et al., *FP8 Formats for Deep Learning*, 2022 (e4m3, e5m2).

  Rouhani et al., *Microscaling Data Formats for Deep Learning*, 2023 (fp4
  e2m1).

  Douillard et al., *Streaming DiLoCo with overlapping communication: Towards
  a Distributed Free Lunch*, 2025 (fp4 e3m0 outer gradients).

  Sarfi, Thérien, Lidin, Belilovsky, *Communication Efficient LLM
  Pre-training with SparseLoCo*, 2025 (the 2-bit statistical quantizer).
"""

from collections.abc import Callable, Mapping, Sequence
import functools
import math
import numbers

import jax
import jax.numpy as jnp

from loc_opt import _checks
from loc_opt.compression import codecs as codecs_lib
from loc_opt.compression import packing

Codec = codecs_lib.Codec
_ROUNDINGS = ('nearest', 'stochastic')


# ------------------------------------------------------------- helpers ---
def _stochastic(rounding: str) -> bool:
  return _checks.one_of(rounding, 'rounding', _ROUNDINGS) == 'stochastic'


def _check_block(block_size: int | None, unit: int) -> int:
  """Validates ``block_size``; returns the codec's padding multiple."""
  if block_size is None:
    return unit
  if (not isinstance(block_size, numbers.Integral) or block_size < 1
      or block_size % unit):
    raise ValueError(f'block_size must be None or a positive multiple of '
                     f'{unit}, got {block_size!r}')
  return int(block_size)


def _num_blocks(n: int, block_size: int | None) -> int:
  return 1 if block_size is None else math.ceil(n / block_size)


def _blocks(x: jax.Array, block_size: int | None) -> jax.Array:
  """``x`` as float32 ``[blocks, block_size]`` (one row when ``None``)."""
  flat = jnp.ravel(x).astype(jnp.float32)
  return flat.reshape(-1, flat.size if block_size is None else block_size)


def _need_key(key, name):
  if key is None:
    raise ValueError(f'codec {name!r} rounds stochastically and needs a key '
                     '(fold the worker index into it)')
  return key


def _lookup(table: Sequence[float] | jax.Array, idx: jax.Array) -> jax.Array:
  """``table[idx]`` for a short table, as a chain of selects (no gather).

  ``table`` is a sequence of floats, or an array whose last axis is the
  table and which broadcasts against ``idx[..., None]``.
  """
  if isinstance(table, (list, tuple)):
    values = [float(v) for v in table]
  else:
    values = [table[..., j:j + 1] for j in range(table.shape[-1])]
  out = jnp.zeros(idx.shape, jnp.float32)
  for j, value in enumerate(values):
    out = jnp.where(idx == j, value, out)
  return out


def _round_int(y: jax.Array, key: jax.Array | None) -> jax.Array:
  """Round-to-nearest-even, or ``floor(y) + Bernoulli(y - floor(y))``."""
  if key is None:
    return jnp.round(y)
  low = jnp.floor(y)
  return low + (jax.random.uniform(key, y.shape) < y - low)


def _round_grid(a: jax.Array, grid: Sequence[float],
                key: jax.Array | None) -> jax.Array:
  """Index of ``a`` (in ``[0, grid[-1]]``) rounded onto a sorted grid.

  Nearest rounding sends ties away from zero; stochastic rounding picks the
  upper neighbour with probability ``(a - lo) / (hi - lo)``.
  """
  if key is None:
    mids = [(lo + hi) / 2 for lo, hi in zip(grid[:-1], grid[1:])]
    return sum((a >= m).astype(jnp.int32) for m in mids)
  low = sum((a >= g).astype(jnp.int32) for g in grid[1:])
  lo = _lookup(grid, low)
  hi = _lookup(grid, jnp.minimum(low + 1, len(grid) - 1))
  frac = jnp.where(hi > lo, (a - lo) / jnp.where(hi > lo, hi - lo, 1.0), 0.0)
  return low + (jax.random.uniform(key, a.shape) < frac).astype(jnp.int32)


def _absmax_codec(name: str, block_size: int | None, *, qmax: float,
                  bits: int, stochastic: bool,
                  quantize: Callable[[jax.Array, jax.Array | None],
                                     jax.Array],
                  dequantize: Callable[[jax.Array], jax.Array]) -> Codec:
  """A block-wise absmax codec from a rounding onto ``[-qmax, qmax]``.

  Args:
    name: the codec's name.
    block_size: values per scale (``None``: one scale for the whole array).
    qmax: the largest code magnitude; a block's absmax maps onto it.
    bits: bits per code (8, or 4 for codes packed two per byte).
    stochastic: whether ``quantize`` needs a key.
    quantize: ``(y, key) -> codes`` for ``y`` in ``[-qmax, qmax]``
      (``int8`` or ``uint8``; ``key`` is ``None`` for nearest rounding).
    dequantize: ``codes -> float32`` grid values.

  Returns:
    The codec.
  """
  multiple = _check_block(block_size, 8 // bits)

  def encode(x, key=None):
    key = _need_key(key, name) if stochastic else None
    blocks = _blocks(x, block_size)
    scale = jnp.max(jnp.abs(blocks), axis=1, keepdims=True) / qmax
    safe = jnp.where(scale > 0, scale, 1.0)
    codes = quantize(jnp.clip(blocks / safe, -qmax, qmax), key)
    if bits < 8:
      codes = packing.pack_bits(codes, bits)
    return {'codes': codes, 'scales': scale[:, 0]}

  def decode(payload, n, key=None):
    del key
    codes = payload['codes']
    if bits < 8:
      codes = packing.unpack_bits(codes, bits)
    x = dequantize(codes) * payload['scales'][:, None]
    return x.reshape(-1)[:n]

  def payload_bytes(n):
    return n * bits // 8 + 4 * _num_blocks(n, block_size)

  return Codec(
      name=name,
      encode=encode,
      decode=decode,
      payload_bytes=payload_bytes,
      block_size=multiple,
      randomness='per_worker' if stochastic else 'none',
      per_tensor=block_size is None,
  )


# ------------------------------------------------------------ integers ---
def int8_codec(block_size: int | None = 256, *,
               rounding: str = 'nearest') -> Codec:
  r"""Block-wise absmax int8: ``q = R(x / s)``, ``s = max|x| / 127``.

  With ``rounding='nearest'`` this is :func:`loc_opt.compression.int8`
  (error at most ``s / 2``). With ``'stochastic'``,
  ``q = floor(y) + Bernoulli(y - floor(y))`` so that ``E[s q] = x`` (error
  below ``s``). Payload: ``int8`` codes and a float32 scale per block,
  ``n + 4 n / block_size`` bytes.

  Args:
    block_size: values per scale; ``None`` for one scale per array.
    rounding: ``'nearest'`` or ``'stochastic'``.

  Returns:
    The codec (``'int8'`` or ``'int8_sr'``).

  Example:
    >>> codec = int8_codec(64, rounding='stochastic')
    >>> payload = codec.encode(x, jax.random.fold_in(key, worker))
  """
  return _integer_codec(8, block_size, rounding,
                        dequantize=lambda q: q.astype(jnp.float32))


def int4_codec(block_size: int | None = 256, *,
               rounding: str = 'nearest') -> Codec:
  r"""Block-wise absmax int4: codes in ``[-7, 7]``, two per byte.

  As :func:`int8_codec` with ``s = max|x| / 7``; the codes travel as
  two's-complement nibbles packed into ``uint8``, so the payload is
  ``n / 2 + 4 n / block_size`` bytes (about 1/8 of fp32).

  Args:
    block_size: values per scale (even), or ``None`` for one per array.
    rounding: ``'nearest'`` or ``'stochastic'``.

  Returns:
    The codec (``'int4'`` or ``'int4_sr'``).
  """
  return _integer_codec(
      4, block_size, rounding,
      dequantize=lambda q: packing.to_signed_4bit(q).astype(jnp.float32))


def _integer_codec(bits: int, block_size: int | None, rounding: str, *,
                   dequantize: Callable[[jax.Array], jax.Array]) -> Codec:
  """Block-wise absmax ``bits``-bit integers in ``[-Q, Q]``,
  ``Q = 2**(bits - 1) - 1``, sent as ``int8`` (packed when ``bits < 8``)."""
  stochastic = _stochastic(rounding)
  q = 2 ** (bits - 1) - 1
  return _absmax_codec(
      f'int{bits}' + ('_sr' if stochastic else ''), block_size,
      qmax=float(q), bits=bits, stochastic=stochastic,
      quantize=lambda y, key: jnp.clip(_round_int(y, key), -q,
                                       q).astype(jnp.int8),
      dequantize=dequantize)


# ----------------------------------------------------------------- fp8 ---
# dtype, mantissa bits, smallest normal exponent, largest finite value.
_FP8 = {
    'e4m3': (jnp.float8_e4m3fn, 3, -6, 448.0),
    'e5m2': (jnp.float8_e5m2, 2, -14, 57344.0),
}


def _round_fp8(y: jax.Array, mantissa: int, emin: int, qmax: float,
               key: jax.Array | None) -> jax.Array:
  """Rounds float32 ``y`` (``|y| <= qmax``) to a value exact in the format.

  Normal range: on the float32 bit pattern of ``|y|``, add an integer ``r``
  below ``2**d`` (``d = 23 - mantissa``) and clear the low ``d`` bits. A
  uniform random ``r`` rounds up with probability equal to the distance to
  the lower neighbour over the spacing (a carry into the exponent is the
  next binade); ``r = 2**(d-1) - 1 + lsb`` is round-to-nearest-even.
  Below ``2**emin`` the grid is fixed (spacing ``2**(emin - mantissa)``, the
  subnormals) and is rounded on directly. Results are clamped to ``qmax``.
  """
  a = jnp.minimum(jnp.abs(y), qmax)
  drop = 23 - mantissa
  bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
  spacing = 2.0 ** (emin - mantissa)
  t = a / spacing
  if key is None:
    r = (jnp.uint32((1 << (drop - 1)) - 1)
         + ((bits >> jnp.uint32(drop)) & jnp.uint32(1)))
    sub = jnp.round(t)
  else:
    r = jax.random.bits(key, a.shape, jnp.uint32) >> jnp.uint32(32 - drop)
    u = r.astype(jnp.float32) * 2.0 ** -drop
    low = jnp.floor(t)
    sub = low + (u < t - low)
  mask = jnp.uint32(0xFFFFFFFF ^ ((1 << drop) - 1))
  normal = jax.lax.bitcast_convert_type((bits + r) & mask, jnp.float32)
  out = jnp.minimum(jnp.where(a < 2.0 ** emin, sub * spacing, normal), qmax)
  return jnp.where(y < 0, -out, out)


def fp8_codec(fmt: str = 'e4m3', block_size: int | None = 256, *,
              rounding: str = 'nearest') -> Codec:
  r"""Block-wise absmax fp8 (e4m3fn or e5m2), sent as ``uint8`` bits.

  ``s = max|x| / Q_max`` with ``Q_max`` the format's largest finite value
  (448 for e4m3fn, 57344 for e5m2), so ``x / s`` is never out of range (and
  e4m3fn, which has no infinity, never produces NaN). Rounding is to nearest
  even (as a cast) or stochastic on the float32 bit pattern, with the
  subnormal range rounded on its fixed grid. The rounded value is cast to
  ``jnp.float8_e4m3fn`` / ``jnp.float8_e5m2`` exactly and bitcast to
  ``uint8``. Payload: ``n + 4 n / block_size`` bytes.

  Args:
    fmt: ``'e4m3'`` (float8_e4m3fn) or ``'e5m2'``.
    block_size: values per scale; ``None`` for one scale per array.
    rounding: ``'nearest'`` or ``'stochastic'``.

  Returns:
    The codec (``'fp8_<fmt>'``, with ``'_sr'`` when stochastic).
  """
  dtype, mantissa, emin, qmax = _FP8[_checks.one_of(fmt, 'fmt', _FP8)]
  stochastic = _stochastic(rounding)

  def quantize(y, key):
    rounded = _round_fp8(y, mantissa, emin, qmax, key)
    return jax.lax.bitcast_convert_type(rounded.astype(dtype), jnp.uint8)

  def dequantize(codes):
    return jax.lax.bitcast_convert_type(codes, dtype).astype(jnp.float32)

  name = f'fp8_{fmt}' + ('_sr' if stochastic else '')
  return _absmax_codec(name, block_size, qmax=qmax, bits=8,
                       stochastic=stochastic, quantize=quantize,
                       dequantize=dequantize)


# ----------------------------------------------------------------- fp4 ---
# Non-negative values of the 3 magnitude bits, in code order.
FP4_GRIDS: Mapping[str, tuple[float, ...]] = {
    # e2m1 (OCP MX): exponent bias 1, one subnormal 0.5.
    'e2m1': (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0),
    # e3m0: exponent field e in 0..7, bias 3, no mantissa: e = 0 is zero
    # (the only subnormal), e >= 1 is 2**(e - 3); no inf or NaN.
    'e3m0': (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0),
}


def fp4_codec(fmt: str = 'e2m1', block_size: int | None = 256, *,
              rounding: str = 'nearest') -> Codec:
  r"""Block-wise absmax 4-bit floats, two codes per byte.

  A code is a sign bit (bit 3) over a 3-bit magnitude index into
  :data:`FP4_GRIDS`:

  * ``'e2m1'``: ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` (OCP MX fp4);
  * ``'e3m0'``: 1 sign and 3 exponent bits with bias 3 and no mantissa,
    ``{0, 2^-2, 2^-1, 1, 2, 4, 8, 16}``: every value is zero or a signed
    power of two, over a dynamic range of ``2^6`` below the top code (the
    Streaming DiLoCo wire format).

  ``s = max|x| / Q_max`` with ``Q_max`` the top grid value (6 or 16), so a
  block's largest magnitude maps to the top code exactly. Nearest rounding
  takes the closest grid point in absolute distance (ties away from zero);
  stochastic rounding picks one of the two neighbouring grid points with
  probabilities that make it unbiased. Payload:
  ``n / 2 + 4 n / block_size`` bytes.

  Args:
    fmt: ``'e2m1'`` or ``'e3m0'``.
    block_size: values per scale (even), or ``None`` for one per array: a
      per-tensor scale (the Streaming DiLoCo spec's default), since
      compressors encode each tensor of a tree separately for such a codec.
    rounding: ``'nearest'`` or ``'stochastic'``.

  Returns:
    The codec (``'fp4_<fmt>'``, with ``'_sr'`` when stochastic).
  """
  grid = FP4_GRIDS[_checks.one_of(fmt, 'fmt', FP4_GRIDS)]
  stochastic = _stochastic(rounding)

  def quantize(y, key):
    idx = _round_grid(jnp.abs(y), grid, key)
    return (idx + 8 * (y < 0)).astype(jnp.uint8)

  def dequantize(codes):
    value = _lookup(grid, codes & jnp.uint8(7))
    return jnp.where(codes >= 8, -value, value)

  name = f'fp4_{fmt}' + ('_sr' if stochastic else '')
  return _absmax_codec(name, block_size, qmax=grid[-1], bits=4,
                       stochastic=stochastic, quantize=quantize,
                       dequantize=dequantize)


# --------------------------------------------------------------- 2-bit ---
def two_bit_codec(block_size: int | None = 256, *,
                  sigma_range: float = 6.0) -> Codec:
  r"""SparseLoCo's 2-bit statistical quantizer, per block or per tensor.

  Per block: the mean ``m`` and the unbiased standard deviation ``sigma``
  of the values, a bin width ``w = sigma_range * sigma / 4`` (1.5 sigma by
  default), codes

  .. math::  c_i = \mathrm{clip}(\mathrm{round}((x_i - m) / w + 2), 0, 3),

  and a table ``T[j]`` = the mean of ``x_i - m`` over the values with code
  ``j`` (0 for an empty bin). Decoding is ``x_hat_i = m + T[c_i]``, which
  keeps the block's mean exactly. A constant block (``sigma = 0``) is
  encoded exactly. Deterministic and biased (use error feedback).

  Payload: codes four per ``uint8`` plus, per block, ``m`` and the table in
  float32: ``n / 4 + 20 n / block_size`` bytes. Zero padding (from the
  caller rounding ``n`` up to ``block_size``) enters the statistics of the
  last block.

  Args:
    block_size: values per block (a multiple of 4), or ``None`` for one block
      per array (as in SparseLoCo, which quantizes a tensor's selected
      values together).
    sigma_range: the span, in standard deviations, that the 4 bins cover.

  Returns:
    The codec (``'two_bit'``).
  """
  multiple = _check_block(block_size, 4)

  def encode(x, key=None):
    del key
    blocks = _blocks(x, block_size)
    count = blocks.shape[1]
    shift = jnp.mean(blocks, axis=1, keepdims=True)
    centered = blocks - shift
    sigma = jnp.sqrt(jnp.sum(centered**2, axis=1, keepdims=True)
                     / max(count - 1, 1))
    width = sigma_range * sigma / 4.0
    safe = jnp.where(width > 0, width, 1.0)
    codes = jnp.clip(jnp.round(centered / safe + 2.0), 0, 3).astype(jnp.uint8)
    table = []
    for j in range(4):
      hit = codes == j
      total = jnp.sum(jnp.where(hit, centered, 0.0), axis=1)
      table.append(total / jnp.maximum(jnp.sum(hit, axis=1), 1))
    return {'codes': packing.pack_2bit(codes), 'shift': shift[:, 0],
            'table': jnp.stack(table, axis=1)}

  def decode(payload, n, key=None):
    del key
    codes = packing.unpack_2bit(payload['codes'])
    x = _lookup(payload['table'], codes) + payload['shift'][:, None]
    return x.reshape(-1)[:n]

  return Codec(
      name='two_bit',
      encode=encode,
      decode=decode,
      payload_bytes=lambda n: n // 4 + 20 * _num_blocks(n, block_size),
      block_size=multiple,
      per_tensor=block_size is None,
  )


# ------------------------------------------------------------- registry ---
QUANT_CODECS: Mapping[str, Callable[..., Codec]] = {
    'int8': int8_codec,
    'int8_sr': functools.partial(int8_codec, rounding='stochastic'),
    'int4': int4_codec,
    'int4_sr': functools.partial(int4_codec, rounding='stochastic'),
    'fp8_e4m3': functools.partial(fp8_codec, fmt='e4m3'),
    'fp8_e4m3_sr': functools.partial(fp8_codec, fmt='e4m3',
                                     rounding='stochastic'),
    'fp8_e5m2': functools.partial(fp8_codec, fmt='e5m2'),
    'fp8_e5m2_sr': functools.partial(fp8_codec, fmt='e5m2',
                                     rounding='stochastic'),
    'fp4_e2m1': functools.partial(fp4_codec, fmt='e2m1'),
    'fp4_e2m1_sr': functools.partial(fp4_codec, fmt='e2m1',
                                     rounding='stochastic'),
    'fp4_e3m0': functools.partial(fp4_codec, fmt='e3m0'),
    'fp4_e3m0_sr': functools.partial(fp4_codec, fmt='e3m0',
                                     rounding='stochastic'),
    'two_bit': two_bit_codec,
}
