r"""Row-wise statistical and linear quantizers (MuLoCo's outer compression).

Each leaf is read as rows (a row is a vector along the last axis: a Flax
``(in, out)`` kernel has one row per input unit, a stacked ``(layers, in,
out)`` kernel the same rows per layer, a vector is one row) and every row is
quantized on its own to ``b`` bits, ``n = 2^b`` bins.

*Statistical* (:func:`statistical`): centre the row on its mean ``m``, take
the unbiased standard deviation ``sigma``, a bin width
``w = 2 c sigma / n`` (``c = clip_sigmas``, so the bins span about
``+-c sigma``) and codes

.. math::

  q_i = \mathrm{clip}(\mathrm{round}((x_i - m) / w + n / 2), 0, n - 1),

and decode each bin to the mean of the centred values that fell in it (the
*centroid* ``T[q]``, 0 for an empty bin): ``x_hat_i = m + T[q_i]``. The
table of ``n`` float32 centroids travels with the codes, so the decoded row
keeps the row's sum exactly and every decoded value is the mean of its bin.
A constant row (``sigma = 0``) is encoded exactly.

*Linear* (:func:`row_linear`): ``n`` uniform levels between the row's
minimum and maximum, ``x_hat_i = lo + q_i (hi - lo) / (n - 1)`` with
round-to-nearest, two float32 numbers per row.

Codes travel packed (:mod:`~loc_opt.compression.packing`, ``8 / b`` to a
byte, each row padded to whole bytes), and one worker's whole tree of
payloads crosses workers in a single all-gather of bytes
(:meth:`~loc_opt.compression.comm.Comm.all_gather_packed`); every worker
decodes all payloads and averages them, so all workers hold the same mean.
Per leaf of ``r`` rows of ``k`` values a worker sends

.. math::

  r \lceil k b / 8 \rceil + 4 r (1 + n) \ \text{bytes (statistical)},
  \qquad r \lceil k b / 8 \rceil + 8 r \ \text{(linear)}.

The centroid table is the price of 8-bit statistical codes: 256 float32 per
row, more than the codes of a row shorter than 1024 values.

``requantize=True`` quantizes the averaged result once more and returns its
decoding, which is the rounding a reduce-scatter / all-gather of compressed
payloads would add (the MuLoCo code simulates it the same way). It changes
the numbers only, not the wire: the collective stays an all-gather of one
payload per worker. Error feedback does not see this second rounding.

Rows follow the last axis, not PyTorch's dimension 0: for PyTorch's ``(out,
in)`` weights the reference's rows are output units, while here a Flax
``(in, out)`` kernel gives input units. Both are per-unit statistics of the
same matrix; the row count and the metadata bytes differ.

References:
  Thérien, Huang, Rish, Belilovsky, *MuLoCo: Muon is a practical inner
  optimizer for DiLoCo*, 2025 (arXiv 2505.23725): row-wise statistical
  quantization of pseudo-gradients with error feedback.

  Sarfi, Thérien, Lidin, Belilovsky, *Communication Efficient LLM
  Pre-training with SparseLoCo*, 2025 (the statistical quantizer).
"""

import math
from typing import Any

import jax
import jax.numpy as jnp

from loc_opt import _checks
from loc_opt.compression import comm as comm_lib
from loc_opt.compression import compressor as compressor_lib
from loc_opt.compression import packing

Compressor = compressor_lib.Compressor
BITS = (2, 4, 8)


def rows(x: jax.Array) -> jax.Array:
  """``x`` as float32 ``[rows, k]``: rows along the last axis (a scalar or
  vector is one row)."""
  x = jnp.asarray(x, jnp.float32)
  if x.ndim <= 1:
    return x.reshape(1, -1)
  return x.reshape(-1, x.shape[-1])


def _row_shape(shape: tuple[int, ...]) -> tuple[int, int]:
  if len(shape) <= 1:
    return 1, math.prod(shape)
  return math.prod(shape[:-1]), shape[-1]


def statistical_quantize(x: jax.Array, bits: int = 2,
                         clip_sigmas: float = 3.0) -> dict[str, jax.Array]:
  """Codes, row means and centroid tables of the rows of ``x``.

  Args:
    x: float ``[rows, k]``.
    bits: 2, 4 or 8 (``n = 2**bits`` bins).
    clip_sigmas: the bins span ``+-clip_sigmas`` standard deviations.

  Returns:
    ``{'codes': uint8 [rows, k] (unpacked), 'shift': float32 [rows],
    'table': float32 [rows, n]}``; ``table[r, j]`` is the mean of
    ``x[r, i] - shift[r]`` over the ``i`` with code ``j`` (0 if none).
  """
  n = 2 ** bits
  x = jnp.asarray(x, jnp.float32)
  r, k = x.shape
  shift = jnp.mean(x, axis=1, keepdims=True)
  centred = x - shift
  sigma = jnp.sqrt(jnp.sum(centred**2, axis=1, keepdims=True)
                   / max(k - 1, 1))
  width = 2.0 * clip_sigmas * sigma / n
  safe = jnp.where(width > 0, width, 1.0)
  codes = jnp.clip(jnp.round(centred / safe + n / 2), 0, n - 1).astype(
      jnp.int32)
  flat = (codes + n * jnp.arange(r)[:, None]).reshape(-1)
  total = jnp.zeros(r * n, jnp.float32).at[flat].add(centred.reshape(-1))
  count = jnp.zeros(r * n, jnp.float32).at[flat].add(1.0)
  table = (total / jnp.maximum(count, 1.0)).reshape(r, n)
  return {'codes': codes.astype(jnp.uint8), 'shift': shift[:, 0],
          'table': table}


def statistical_dequantize(payload: dict[str, jax.Array]) -> jax.Array:
  """``shift + table[codes]`` row by row, float32 ``[rows, k]``."""
  codes = payload['codes'].astype(jnp.int32)
  return (jnp.take_along_axis(payload['table'], codes, axis=1)
          + payload['shift'][:, None])


def linear_quantize(x: jax.Array, bits: int = 2) -> dict[str, jax.Array]:
  """Codes on ``2**bits`` uniform levels between each row's min and max.

  Returns:
    ``{'codes': uint8 [rows, k] (unpacked), 'low': float32 [rows],
    'step': float32 [rows]}``.
  """
  n = 2 ** bits
  x = jnp.asarray(x, jnp.float32)
  low = jnp.min(x, axis=1, keepdims=True)
  step = (jnp.max(x, axis=1, keepdims=True) - low) / (n - 1)
  safe = jnp.where(step > 0, step, 1.0)
  codes = jnp.clip(jnp.round((x - low) / safe), 0, n - 1).astype(jnp.uint8)
  return {'codes': codes, 'low': low[:, 0], 'step': step[:, 0]}


def linear_dequantize(payload: dict[str, jax.Array]) -> jax.Array:
  """``low + codes * step`` row by row, float32 ``[rows, k]``."""
  return (payload['low'][:, None]
          + payload['codes'].astype(jnp.float32) * payload['step'][:, None])


def _pack(payload, bits):
  codes = payload['codes']
  per = 8 // bits
  codes = jnp.pad(codes, ((0, 0), (0, (-codes.shape[1]) % per)))
  return {**payload, 'codes': packing.pack_bits(codes, bits)}


def _unpack(payload, bits, k):
  return {**payload,
          'codes': packing.unpack_bits(payload['codes'], bits)[:, :k]}


def _row_compressor(name: str, bits: int, meta_floats: int, quantize,
                    dequantize, requantize: bool) -> Compressor:
  """A stateless compressor that sends every leaf row-quantized.

  Args:
    name: the compressor's name.
    bits: bits per code.
    meta_floats: float32 numbers of metadata per row.
    quantize: ``[rows, k] -> payload`` (unpacked ``'codes'``).
    dequantize: ``payload -> [rows, k]``.
    requantize: quantize the averaged result again (see the module).

  Returns:
    The compressor.
  """

  def encode(x):
    return _pack(quantize(rows(x)), bits)

  def decode(payload, shape):
    _, k = _row_shape(tuple(shape))
    return dequantize(_unpack(payload, bits, k)).reshape(shape)

  def mean(tree, state, comm, key):
    del key
    leaves, treedef = jax.tree.flatten(tree)
    shapes = [jnp.shape(x) for x in leaves]
    payloads = [encode(x) for x in leaves]
    sent = [decode(p, s) for p, s in zip(payloads, shapes)]
    gathered = comm.all_gather_packed(payloads)
    avg = [jnp.mean(jax.vmap(lambda p, s=s: decode(p, s))(g), axis=0)
           for g, s in zip(gathered, shapes)]
    if requantize:
      avg = [decode(encode(a), s) for a, s in zip(avg, shapes)]
    return treedef.unflatten(avg), treedef.unflatten(sent), state

  def payload_bytes(tree):
    total = 0
    for x in jax.tree.leaves(tree):
      r, k = _row_shape(tuple(x.shape))
      total += r * math.ceil(k * bits / 8) + 4 * meta_floats * r
    return int(total)

  suffix = '/requantize' if requantize else ''
  return Compressor(f'{name}{bits}{suffix}', lambda tree: (), mean,
                    payload_bytes)


def statistical(bits: int = 2, *, clip_sigmas: float = 3.0,
                requantize: bool = False) -> Compressor:
  r"""The row-wise statistical quantizer of MuLoCo as a compressor.

  Per row: centre, bins of width ``2 clip_sigmas sigma / 2^bits``, codes
  clipped to the outer bins, each bin decoded to the mean of its members
  (see the module docstring). Deterministic and biased: pair it with error
  feedback (``build_compressor(statistical(2), error_feedback='ef',
  ef_decay=0.9)``), as the paper does for 2 bits.

  Args:
    bits: 2, 4 or 8.
    clip_sigmas: half the span of the bins in standard deviations (the
      reference's ``R = 6`` over the whole range is 3).
    requantize: quantize the average once more (a simulated compressed
      reduce-scatter / all-gather; numerics only).

  Returns:
    A stateless compressor sending ``r ceil(k bits / 8) + 4 r (1 + 2^bits)``
    bytes per leaf of ``r`` rows of ``k``.

  Example:
    >>> tx = loc_opt.diloco(optax.contrib.muon(0.02), sync_every=30,
    ...                     codec=('statistical', {'bits': 2}))
  """
  bits = _checks.one_of(bits, 'statistical bits', BITS)
  clip_sigmas = _checks.positive_float(clip_sigmas, 'clip_sigmas')
  return _row_compressor(
      'statistical', bits, 1 + 2 ** bits,
      lambda x: statistical_quantize(x, bits, clip_sigmas),
      statistical_dequantize, bool(requantize))


def row_linear(bits: int = 2, *, requantize: bool = False) -> Compressor:
  """Row-wise min/max linear quantization (MuLoCo's ``row_wise_linear``).

  Per row ``2**bits`` uniform levels from the minimum to the maximum,
  round-to-nearest; the baseline that the paper finds to degrade at 2 bits
  where the statistical quantizer does not.

  Args:
    bits: 2, 4 or 8.
    requantize: quantize the average once more (numerics only).

  Returns:
    A stateless compressor sending ``r ceil(k bits / 8) + 8 r`` bytes per
    leaf of ``r`` rows of ``k``.
  """
  bits = _checks.one_of(bits, 'row_linear bits', BITS)
  return _row_compressor('row_linear', bits, 2,
                         lambda x: linear_quantize(x, bits),
                         linear_dequantize, bool(requantize))


def decoded(compressor: Compressor, x: Any) -> Any:
  """What one worker's ``x`` decodes to through a stateless row compressor
  (a worker axis of one), for tests and error studies."""
  comm_axis = '_row_worker'

  def one(v):
    _, sent, _ = compressor.mean(v, (), comm_lib.Comm(comm_axis),
                                 jax.random.key(0))
    return sent

  # One compiled program (op-by-op dispatch would compile each primitive).
  out = jax.jit(jax.vmap(one, axis_name=comm_axis))(
      jax.tree.map(lambda v: jnp.asarray(v)[None], x))
  return jax.tree.map(lambda v: v[0], out)
