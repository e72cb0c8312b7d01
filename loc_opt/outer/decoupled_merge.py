"""Decoupled DiLoCo's merge rules, as pure functions of the learners'
outer gradients: the token weight, the weighted average and the radial
directional average (RDA), one fragment at a time (:func:`merge_fragment`,
under a learner axis) or stacked on the syncer's side
(:func:`merge_stacked`). :func:`loc_opt.outer.decoupled_diloco` and the
asynchronous syncer (``loc_opt.train.async_learners``) both merge with them.

References:
  Douillard et al., *Decoupled DiLoCo for Resilient Distributed
  Pre-training*, 2026. https://arxiv.org/abs/2604.21428
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

MeanFn = Callable[[Any], Any]


def token_weight(tokens: jax.Array, steps: jax.Array) -> jax.Array:
  """A learner's merge weight ``c_tokens^2 / c_steps`` (tokens processed
  times tokens per inner step, both since it last received the fragment);
  0 when it took no step."""
  steps = jnp.asarray(steps, jnp.float32)
  tokens = jnp.asarray(tokens, jnp.float32)
  return jnp.where(steps > 0, tokens * tokens / jnp.maximum(steps, 1.), 0.)


def _ratio(num: Any, den: jax.Array) -> Any:
  """``num / den`` leafwise, 0 where ``den`` is 0."""
  inv = jnp.where(den > 0, 1. / jnp.maximum(den, 1e-30), 0.)
  return jax.tree.map(lambda x: x * inv, num)


def weighted_average(deltas: list[jax.Array], weight: jax.Array,
                     mean_fn: MeanFn, payload_mean: MeanFn | None = None
                     ) -> list[jax.Array]:
  """``sum_m w_m Delta_m / sum_m w_m`` (0 if every weight is 0):
  :func:`merge_fragment` with every piece averaged directly."""
  return merge_fragment(deltas, weight, mean_fn, payload_mean,
                        direct=[True] * len(deltas))


def radial_directional_average(
    deltas: list[jax.Array], weight: jax.Array, mean_fn: MeanFn,
    payload_mean: MeanFn | None = None, *, scope: str = 'leaf',
    eps: float = 1e-6) -> list[jax.Array]:
  r"""Radial-directional averaging (RDA) of the learners' deltas
  (:func:`merge_fragment` with no piece averaged directly). Per group (a
  leaf, ``scope='leaf'``, or all of ``deltas``, ``'fragment'``), weights
  ``w_m`` and ``phi(x) = x / |x|`` (``phi(0) = 0``):

  .. math::

    \mathrm{RDA} = \frac{\sum_m w_m |\Delta_m|}{\sum_m w_m}\,
      \phi\Big(\frac{\sum_m w_m \phi(\Delta_m)}{\sum_m w_m}\Big).

  The weighted mean of the norms keeps the update's length when the
  learners' deltas are nearly orthogonal (a plain mean of ``M`` orthogonal
  vectors of norm ``R`` has norm ``R / sqrt(M)``), so the outer learning rate
  need not change with ``M``.
  """
  return merge_fragment(deltas, weight, mean_fn, payload_mean,
                        direct=[False] * len(deltas), scope=scope, eps=eps)


def _sq(x: jax.Array) -> jax.Array:  # |x|^2 in fp32
  return jnp.sum(jnp.square(x.astype(jnp.float32)))


def merge_fragment(deltas: list[jax.Array], weight: jax.Array,
                   mean_fn: MeanFn, payload_mean: MeanFn | None = None, *,
                   direct: list[bool], merge: str = 'rda',
                   scope: str = 'leaf', eps: float = 1e-6
                   ) -> list[jax.Array]:
  """The merged outer gradient of one fragment, identical on every learner.

  The pieces marked ``direct`` (embeddings), or every piece with
  ``merge='average'``, are the weighted average ``sum w Delta / sum w``; the
  others are merged by RDA (:func:`radial_directional_average`) per group.
  One payload crosses learners: ``w Delta`` or ``w phi(Delta)`` per piece
  (through ``payload_mean``), plus fp32 scalars (the weight, and ``w
  |Delta|`` per RDA group). Where RDA is degenerate (the mean direction has
  norm ``<= eps``: the directions cancel, e.g. two learners with opposite
  deltas) the weighted average is taken instead, in a ``lax.cond`` branch
  whose all-reduce (fp32, through ``mean_fn``) runs only then.

  Args:
    deltas: this learner's pieces ``Theta_p - theta_m``.
    weight: this learner's merge weight (fp32 scalar; 0: left out).
    mean_fn: the mean over the learner axis (e.g. ``lax.pmean``).
    payload_mean: the mean of the weighted pieces (default ``mean_fn``;
      e.g. through a codec).
    direct: per piece, whether it is averaged directly.
    merge: ``'rda'`` or ``'average'`` (every piece directly).
    scope: RDA per ``'leaf'`` or per ``'fragment'`` (all RDA pieces).
    eps: RDA's degeneracy threshold on the mean direction's norm (in
      ``[0, 1]``).

  Returns:
    The merged pieces, in ``deltas``' dtypes; zeros if every weight is 0.
  """
  codec_out = payload_mean is not None
  payload_mean = payload_mean or mean_fn
  direct = [True] * len(deltas) if merge == 'average' else list(direct)
  rda = [i for i, d in enumerate(direct) if not d]
  groups = [[i] for i in rda] if scope == 'leaf' else ([rda] if rda else [])
  norms = [jnp.sqrt(sum(_sq(deltas[i]) for i in g)) for g in groups]
  unit = list(deltas)
  for g, n in zip(groups, norms):
    inv = jnp.where(n > 0, 1. / jnp.maximum(n, 1e-30), 0.)
    for i in g:
      unit[i] = deltas[i] * inv.astype(deltas[i].dtype)
  sent = payload_mean([weight.astype(x.dtype) * x for x in unit])
  scalars = mean_fn((jnp.stack([weight * n for n in norms] or
                               [jnp.zeros([])]), weight))
  total = scalars[1]
  out = _ratio(sent, total)
  if not groups:
    return out
  radial = _ratio(scalars[0], total)
  degenerate = []
  for k, g in enumerate(groups):
    un = jnp.sqrt(sum(_sq(out[i]) for i in g))
    scale = jnp.where(un > eps, radial[k] / jnp.maximum(un, 1e-30), 0.)
    for i in g:
      out[i] = out[i] * scale.astype(out[i].dtype)
    degenerate.append(un <= eps)
  any_bad = jnp.any(jnp.stack(degenerate))
  if codec_out:  # typed per-learner: one shared flag (4 bytes more)
    any_bad = mean_fn(any_bad.astype(jnp.float32)) > 0
  fallback = jax.lax.cond(
      any_bad,
      lambda: _ratio(mean_fn([weight.astype(deltas[i].dtype) * deltas[i]
                              for i in rda]), total),
      lambda: [jnp.zeros(out[i].shape, out[i].dtype) for i in rda])
  slot = {i: j for j, i in enumerate(rda)}
  for k, g in enumerate(groups):
    for i in g:
      out[i] = jnp.where(degenerate[k], fallback[slot[i]], out[i])
  return out


def merge_stacked(deltas: list[jax.Array], weights: jax.Array,
                  **kwargs) -> list[jax.Array]:
  """:func:`merge_fragment` on the syncer's side: ``deltas`` stacked over
  learners (leading axis ``M``), ``weights`` ``[M]``."""
  fn = jax.vmap(
      lambda d, w: merge_fragment(
          d, w, lambda x: jax.lax.pmean(x, '_learner'), **kwargs),
      axis_name='_learner')
  return [x[0] for x in fn(deltas, jnp.asarray(weights, jnp.float32))]
