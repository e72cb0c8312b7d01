"""Causal self-attention of the Transformer LM, with rotary embeddings.

The einsum formula (float32 scores and softmax, a causal mask) and, for
XLA:CPU, two custom VJPs of it that keep every matmul row-major: the
attention alone (:func:`attend` under ``weight_grad`` narrow) and RoPE plus
the attention (:func:`rope_attention`, with ``backward`` fused), which also
fuses the rotation into the heads-major transposes. See
``loc_opt.models.weight_grad`` and ``loc_opt.models.fused_backward``.

References:
  Vaswani et al., Attention Is All You Need, 2017.
  Su et al., RoFormer: Enhanced Transformer with Rotary Position Embedding,
  2021.
"""

import functools
import math
import os

import jax
from jax import lax
import jax.numpy as jnp

from loc_opt.models import weight_grad as _weight_grad

# Implementations of attention: the explicit einsum formula, or
# jax.nn.dot_product_attention with its `implementation` argument.
ATTENTION = {'einsum': None, 'auto': None, 'xla': 'xla', 'cudnn': 'cudnn'}


def rope_tables(
    length: int, head_dim: int, base: float = 10_000.0
) -> tuple[jax.Array, jax.Array]:
  """Sines and cosines ``[length, head_dim // 2]`` (float32) for RoPE."""
  inv_freq = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  return jnp.sin(angles), jnp.cos(angles)


def _swap_halves(x: jax.Array) -> jax.Array:
  """``x`` with the two halves of its last axis swapped (``lax.rev`` of a
  ``[..., 2, D/2]`` view: an index map XLA fuses into the consumer)."""
  shape = x.shape
  halves = x.reshape(*shape[:-1], 2, shape[-1] // 2)
  return lax.rev(halves, (x.ndim - 1,)).reshape(shape)


def _rope_factors(sin: jax.Array, cos: jax.Array, inverse: bool = False):
  """``[T, 1, Dh]`` factors ``(c, s)`` with ``rope(x) = x c + swap(x) s``
  (``inverse``: the rotation by minus the angle, RoPE's transpose)."""
  sign = -1.0 if inverse else 1.0
  c = jnp.concatenate([cos, cos], axis=-1)
  s = jnp.concatenate([-sign * sin, sign * sin], axis=-1)
  return c[:, None, :], s[:, None, :]


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
  """Rotates ``x`` ``[B, T, H, Dh]`` by position (half-split convention):
  ``[x1 cos - x2 sin, x2 cos + x1 sin]`` for the halves ``x1, x2``.

  Computed as ``x c + swap(x) s`` (:func:`_rope_factors`), the same
  products and sums as the concatenation of the two halves (bit-identical
  on XLA:CPU, ``tests/models``), without a concatenate that XLA:CPU runs
  as an operation of its own.
  """
  c, s = _rope_factors(sin, cos)
  x32 = x.astype(jnp.float32)
  return (x32 * c + _swap_halves(x32) * s).astype(x.dtype)


def _causal_mask(scores: jax.Array) -> jax.Array:
  """``[..., T, T]`` float32 scores with those above the diagonal (a key
  after the query) replaced by the float32 minimum.

  The condition is computed from iotas inside the fusion that reads the
  scores. A constant ``[T, T]`` operand (a boolean mask, or a bias of 0 and
  the minimum added to the scores, which gives the same probabilities)
  is broadcast to the scores' full shape and written out before YNNPACK's
  matmul-and-softmax fusion reads it: 8 MB per layer at the 1.48M LM with
  4 workers stacked, 1-3% of the step (``experiments.step_ab``-style
  alternating blocks).
  """
  return _causal_mask_from(scores, 0)


def _causal_mask_from(scores: jax.Array, first: int) -> jax.Array:
  """:func:`_causal_mask` of ``[..., Tq, Tk]`` scores of the queries
  ``first .. first + Tq - 1`` against the keys ``0 .. Tk - 1``."""
  tq, tk = scores.shape[-2:]
  query = lax.broadcasted_iota(jnp.int32, (tq, tk), 0) + first
  key = lax.broadcasted_iota(jnp.int32, (tq, tk), 1)
  return jnp.where(query >= key, scores, jnp.finfo(jnp.float32).min)


def _softmax_probs(scores: jax.Array, keep_probs: bool,
                   first: int = 0) -> jax.Array:
  """The causal softmax of ``[..., Tq, Tk]`` float32 scores of the queries
  from ``first`` on (:func:`_causal_mask_from`; a masked score's
  probability is 0).

  ``keep_probs`` computes the probabilities into an array of their own (an
  optimization barrier) instead of letting XLA fuse the softmax into the
  matmuls that read them; the values are the same.
  """
  probs = jax.nn.softmax(_causal_mask_from(scores, first), axis=-1)
  return lax.optimization_barrier(probs) if keep_probs else probs


def _einsum_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                      keep_probs: bool = False):
  """The explicit formula: ``(output [B, T, H, Dh], probs [B, H, T, T])``,
  the probabilities in float32 before their cast to ``v``'s dtype
  (``keep_probs``: see :func:`_softmax_probs`)."""
  scores = jnp.einsum(
      'bqhd,bkhd->bhqk', q, k, preferred_element_type=jnp.float32
  ) / math.sqrt(q.shape[-1])
  probs = _softmax_probs(scores, keep_probs)
  return jnp.einsum('bhqk,bkhd->bqhd', probs.astype(v.dtype), v), probs


def _heads_major(x: jax.Array) -> jax.Array:
  """``[B, T, H, Dh]`` <-> ``[B, H, T, Dh]``."""
  return x.transpose(0, 2, 1, 3)


def _attention_bwd_heads(qh, kh, vh, probs, dh):
  """The gradients of the einsum attention, heads-major: from ``[B, H, T,
  Dh]`` queries, keys, values and output cotangent and the ``[B, H, T, T]``
  probabilities, ``(dq [B, H, T, Dh], dk^T, dv^T [B, H, Dh, T])``.

  JAX's rule computes the key and value gradients as ``dS^T q`` and
  ``P^T do``, contractions over the query axis, the leading axis of both
  operands; XLA:CPU runs those through Eigen with a strided packing of the
  ``[T, T]`` operand (the slowest dots of the 853k LM's step). Here they
  are ``q^T dS`` and ``do^T P``: the copies are of the ``[T, Dh]``
  operands and the matmuls are row-major (``weight_grad.transposed``); the
  products are kept behind barriers so that XLA does not fold the callers'
  transposes back into them. The score scale ``1 / sqrt(Dh)`` multiplies
  the ``[T, Dh]`` products rather than the ``[T, T]`` score gradient. The
  products sum the same terms in another order, so the gradients agree
  with JAX's rule to float32 rounding (``tests/models``).
  """
  scale = 1.0 / math.sqrt(qh.shape[-1])
  d_probs = jnp.einsum('bhqd,bhkd->bhqk', dh, vh)
  # Softmax's backward; the masked entries have probability 0, so their
  # gradient is 0 without the mask. Kept as an array (like the
  # probabilities in the forward), so that XLA:CPU does not fuse its
  # computation into the matmuls that read it.
  d_scores = lax.optimization_barrier(
      probs * (d_probs - jnp.sum(d_probs * probs, axis=-1, keepdims=True)))
  t = _weight_grad.transposed
  dq = jnp.einsum('bhqk,bhkd->bhqd', d_scores, kh) * scale
  dk_t = jnp.einsum('bhdq,bhqk->bhdk', t(qh), d_scores) * scale
  dv_t = jnp.einsum('bhdq,bhqk->bhdk', t(dh), probs)
  barrier = lax.optimization_barrier
  return dq, barrier(dk_t), barrier(dv_t)


def _tokens_major_of_t(x_t: jax.Array) -> jax.Array:
  """``[B, H, Dh, T]`` -> ``[B, T, H, Dh]``."""
  return x_t.transpose(0, 3, 1, 2)


@jax.custom_vjp
def _narrow_attention(q: jax.Array, k: jax.Array, v: jax.Array):
  """:func:`_einsum_attention`'s output (float32 operands), whose backward
  is :func:`_attention_bwd_heads`'s.

  The forward is the same computation (the probabilities kept as an array:
  ``keep_probs``).
  """
  return _einsum_attention(q, k, v, keep_probs=True)[0]


def _narrow_attention_fwd(q, k, v):
  out, probs = _einsum_attention(q, k, v, keep_probs=True)
  return out, (q, k, v, probs)


def _narrow_attention_bwd(residuals, d_out):
  q, k, v, probs = residuals
  dq, dk_t, dv_t = _attention_bwd_heads(
      *(_heads_major(x) for x in (q, k, v)), probs, _heads_major(d_out))
  return _heads_major(dq), _tokens_major_of_t(dk_t), _tokens_major_of_t(dv_t)


_narrow_attention.defvjp(_narrow_attention_fwd, _narrow_attention_bwd)


def resolve_causal_blocks(value: int | str) -> int:
  """``model.causal_blocks``: an int as given; ``'auto'``: 2 in a CPU process
  that runs on one core, else 1.

  The blocks' matmuls are half the size. On one thread the skipped scores
  win (the launcher's step 1.014-1.023x at the 853k and 1.48M LMs, as in
  the stacked workers of ``--local_processes=2``); split over the threads
  of two cores the smaller matmuls parallelize worse, and two blocks did
  not win (0.94-1.015x; ``docs/benchmarks.md``, round 7).
  """
  if value != 'auto':
    return value
  if jax.default_backend() != 'cpu':
    return 1
  cores = (len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity')
           else os.cpu_count())
  return 2 if cores == 1 else 1


def query_blocks(length: int, blocks: int) -> int:
  """The query blocks :func:`rope_attention` uses for ``length`` tokens:
  ``blocks`` where it divides ``length``, else 1."""
  return blocks if blocks > 1 and length % blocks == 0 else 1


def _blocked_attention_heads(qh, kh, vh, blocks: int):
  """The causal einsum attention of heads-major ``[B, H, T, Dh]`` queries,
  keys and values, the queries in ``blocks`` equal blocks: block ``i``
  scores only the keys up to its last query (the keys after it are masked
  for all of its queries), so the ``blocks (blocks - 1) / 2`` blocks of
  scores above the diagonal are never computed (a quarter of them for 2
  blocks). Returns ``(output [B, H, T, Dh], probabilities)``, one
  ``[B, H, T / blocks, (i + 1) T / blocks]`` array per block. A masked
  score's probability is 0 either way, so the values are those of the full
  ``[T, T]`` formula up to the order of the sums."""
  size = qh.shape[2] // blocks
  outs, probs = [], []
  for i in range(blocks):
    end = (i + 1) * size
    scores = jnp.einsum(
        'bhqd,bhkd->bhqk', qh[:, :, i * size:end], kh[:, :, :end],
        preferred_element_type=jnp.float32) / math.sqrt(qh.shape[-1])
    probs.append(_softmax_probs(scores, keep_probs=True, first=i * size))
    outs.append(jnp.einsum('bhqk,bhkd->bhqd', probs[-1], vh[:, :, :end]))
  out = outs[0] if blocks == 1 else jnp.concatenate(outs, axis=2)
  return out, tuple(probs)


def _blocked_attention_bwd_heads(qh, kh, vh, probs, dh):
  """:func:`_attention_bwd_heads` of :func:`_blocked_attention_heads`: each
  block's gradients from its own keys, the key and value gradients of the
  blocks summed into the slices they read (the last block reads them
  all)."""
  blocks = len(probs)
  size = qh.shape[2] // blocks
  dqs, dk_t, dv_t = [], None, None
  for i in reversed(range(blocks)):
    end = (i + 1) * size
    rows = slice(i * size, end)
    dq, dk_i, dv_i = _attention_bwd_heads(
        qh[:, :, rows], kh[:, :, :end], vh[:, :, :end], probs[i],
        dh[:, :, rows])
    dqs.insert(0, dq)
    if dk_t is None:
      dk_t, dv_t = dk_i, dv_i
    else:
      dk_t = dk_t.at[..., :end].add(dk_i)
      dv_t = dv_t.at[..., :end].add(dv_i)
  dq = dqs[0] if blocks == 1 else jnp.concatenate(dqs, axis=2)
  return dq, dk_t, dv_t


def _rope_attention_fwd_heads(q, k, v, sin, cos, blocks):
  """The output ``[B, T, H, Dh]`` of RoPE then the einsum attention, and
  the heads-major rotated queries, keys, values and the probabilities."""
  qh, kh = (_heads_major(apply_rope(x, sin, cos)) for x in (q, k))
  vh = _heads_major(v)
  out, probs = _blocked_attention_heads(
      qh, kh, vh, query_blocks(q.shape[1], blocks))
  return _heads_major(out), (qh, kh, vh, probs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def rope_attention(q: jax.Array, k: jax.Array, v: jax.Array, sin: jax.Array,
                   cos: jax.Array, blocks: int = 1) -> jax.Array:
  """Causal attention of float32 ``[B, T, H, Dh]`` queries and keys before
  RoPE (:func:`apply_rope` with ``sin``, ``cos``) and values.

  The forward computes what ``attend(apply_rope(q), apply_rope(k), v,
  'einsum')`` does, in the heads-major layout the matmuls read, the
  rotation fused into that transpose. The backward is
  :func:`_attention_bwd_heads`'s, then RoPE's transpose (the rotation by
  minus the angle) fused into the transposes back to ``[B, T, H, Dh]``;
  no gradient flows to ``sin`` and ``cos`` (constants of the model). The
  model uses it under ``weight_grad`` narrow and ``backward`` fused (the
  CPU defaults); the gradients agree with JAX's rules to float32 rounding.

  ``blocks`` (static; :func:`query_blocks` of ``T``) splits the queries
  into blocks that skip the scores above the diagonal
  (:func:`_blocked_attention_heads`; ``model.causal_blocks``). With 1 the
  forward is bit-identical to ``attend``'s; with more, equal to float32
  rounding (the products sum over fewer zeros).
  """
  return _rope_attention_fwd_heads(q, k, v, sin, cos, blocks)[0]


def _rope_attention_fwd(q, k, v, sin, cos, blocks):
  out, heads = _rope_attention_fwd_heads(q, k, v, sin, cos, blocks)
  return out, (heads, sin, cos)


def _rope_attention_bwd(blocks, residuals, d_out):
  del blocks  # the probabilities' shapes hold it
  (qh, kh, vh, probs), sin, cos = residuals
  dq, dk_t, dv_t = _blocked_attention_bwd_heads(qh, kh, vh, probs,
                                                _heads_major(d_out))
  c, s = _rope_factors(sin, cos, inverse=True)
  unrotate = lambda g: g * c + _swap_halves(g) * s
  return (unrotate(_heads_major(dq)), unrotate(_tokens_major_of_t(dk_t)),
          _tokens_major_of_t(dv_t), jnp.zeros_like(sin), jnp.zeros_like(cos))


rope_attention.defvjp(_rope_attention_fwd, _rope_attention_bwd)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, attention: str,
           weight_grad: str = 'xla'):
  """Causal attention of ``[B, T, H, Dh]`` queries, keys and values.

  ``'einsum'`` is the explicit formula: float32 scores
  ``q k^T / sqrt(Dh)``, causal mask, float32 softmax, probabilities cast to
  ``v``'s dtype. With ``weight_grad='narrow'`` (the resolved value of
  ``model.weight_grad``, see ``loc_opt.models.weight_grad``) and float32
  operands its gradients are computed by :func:`_attention_bwd_heads`
  (same forward; gradients equal to JAX's rule's up to float32
  rounding). The others call ``jax.nn.dot_product_attention``
  (``is_causal=True``), whose XLA path computes the same in the same
  precisions (it multiplies by ``1 / sqrt(Dh)`` instead of dividing, so the
  two differ in the last bits) and whose cuDNN path never stores the
  ``[T, T]`` scores.
  """
  if attention != 'einsum':
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation=ATTENTION[attention])
  if weight_grad == 'narrow' and all(x.dtype == jnp.float32
                                     for x in (q, k, v)):
    return _narrow_attention(q, k, v)
  return _einsum_attention(q, k, v)[0]
