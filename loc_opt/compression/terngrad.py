r"""TernGrad: stochastic ternary gradients on a shared scale.

Every worker sends each element as one of ``{-s, 0, +s}`` with a scale ``s``
shared by all workers:

.. math::

  s = \max_w s_w, \quad s_w = \begin{cases} c\,\operatorname{std}(g_w) &
  c > 0 \\ \max_j |g_{w,j}| & c = 0 \end{cases}, \qquad
  b_j \sim \operatorname{Bernoulli}\big(\min(|g_j| / s, 1)\big), \quad
  q_j = s \operatorname{sign}(g_j) b_j,

and the mean is ``(s / W) sum_w sign_w b_w``. With ``c = 0`` every
``|g_j| <= s``, so ``E[q] = g``: the compressor is unbiased. With ``c > 0``
entries beyond ``s`` are clipped to ``±s`` (biased on those entries only).

The ternary codes travel packed four to a byte (2 bits each) through an
all-gather; the scale costs one 4-byte ``pmax`` per leaf.

Reference:
  Wen, Xu, Yan, Wu, Wang, Chen, Li, *TernGrad: Ternary Gradients to Reduce
  Communication in Distributed Deep Learning*, NIPS 2017.
"""

import math

import jax
import jax.numpy as jnp

from loc_opt import _checks
from loc_opt.compression import compressor as compressor_lib
from loc_opt.compression import packing

Compressor = compressor_lib.Compressor


def pack_ternary(codes: jax.Array) -> jax.Array:
  """Packs int codes in ``{-1, 0, 1}`` four to a uint8 (2 bits each).

  Args:
    codes: integer ``[n]`` with ``n`` a multiple of 4.

  Returns:
    uint8 ``[n // 4]``; element ``4 i + j`` sits in bits ``2j, 2j + 1`` of
    byte ``i`` as its two's-complement low bits (``-1 -> 3``), the layout of
    :func:`loc_opt.compression.packing.pack_2bit`.
  """
  return packing.pack_2bit(codes)


def unpack_ternary(packed: jax.Array) -> jax.Array:
  """Inverse of :func:`pack_ternary`: uint8 ``[k]`` -> int8 ``[4 k]``."""
  bits = packing.unpack_2bit(packed).astype(jnp.int8)
  return bits - 4 * (bits >> 1)  # 3 -> -1


def ternarize(x: jax.Array, scale: jax.Array, key: jax.Array) -> jax.Array:
  """Stochastic ternary codes ``sign(x) * Bernoulli(min(|x| / scale, 1))``.

  Args:
    x: float32 values.
    scale: the positive shared scale (0 gives all-zero codes).
    key: PRNG key (distinct per worker).

  Returns:
    int8 codes in ``{-1, 0, 1}`` with ``E[scale * codes] = x`` wherever
    ``|x| <= scale``.
  """
  safe = jnp.where(scale > 0, scale, 1.0)
  prob = jnp.where(scale > 0, jnp.minimum(jnp.abs(x) / safe, 1.0), 0.0)
  keep = jax.random.uniform(key, x.shape, jnp.float32) < prob
  return jnp.where(keep, jnp.sign(x), 0.0).astype(jnp.int8)


def terngrad_bytes(n: int) -> int:
  """Bytes one worker sends for an ``n``-element leaf: codes plus scale."""
  return math.ceil(n / 4) + 4


def terngrad(*, scaler_c: float = 0.0, min_size: int = 1) -> Compressor:
  r"""TernGrad mean over workers.

  Per leaf with at least ``min_size`` elements: the local scale ``s_w``
  (``scaler_c * std`` if ``scaler_c > 0``, else ``max |g|``), one ``pmax``
  for the shared ``s``, per-worker stochastic ternarization (the key is
  folded with ``comm.index()``), an all-gather of the packed 2-bit codes
  and ``(s / W) * sum`` of the decoded codes. Smaller leaves take a plain
  fp32 ``pmean``. Stateless; TernGrad uses no error feedback (wrap it in
  one through ``compressed_all_reduce(..., error_feedback='ef')`` for that
  variant).

  Example::

    tx = optax.chain(compressed_all_reduce(terngrad(), 'worker'),
                     optax.sgd(0.01, momentum=0.9))

  Args:
    scaler_c: ``c`` of the ``c * std`` scale; the paper recommends 2.5 (a
      clipping that trades bias for variance); 0 (the reference flag's
      default) uses ``max |g|`` and is unbiased.
    min_size: leaves with fewer elements are averaged in fp32 (the
      reference's ``size_to_binarize``).

  Returns:
    A stateless compressor sending ``ceil(n / 4) + 4`` bytes per leaf.
  """
  _checks.nonnegative_float(scaler_c, 'terngrad scaler_c')

  def mean_leaf(x, state, comm, key):
    shape = jnp.shape(x)
    n = math.prod(shape)
    x = jnp.asarray(x, jnp.float32)
    if n < min_size:
      return comm.pmean(x), x, state
    if scaler_c > 0:
      local = scaler_c * jnp.std(x)
    else:
      local = jnp.max(jnp.abs(x))
    scale = comm.pmax(local)
    flat = comm.spread(jnp.ravel(x), 4)
    codes = ternarize(flat, scale, jax.random.fold_in(key, comm.index()))
    gathered = comm.all_gather(pack_ternary(codes))
    total = jnp.sum(
        jax.vmap(unpack_ternary)(gathered).astype(jnp.int32), axis=0)
    avg = total.astype(jnp.float32) * (scale / comm.size())
    own = codes.astype(jnp.float32) * scale
    return avg[:n].reshape(shape), own[:n].reshape(shape), state

  def bytes_leaf(shape):
    n = math.prod(shape)
    return terngrad_bytes(n) if n >= min_size else 4 * n

  return compressor_lib.leafwise(f'terngrad(c={scaler_c:g})', mean_leaf,
                                 bytes_leaf)
