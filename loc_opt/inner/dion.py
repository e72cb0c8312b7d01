"""Dion: low-rank orthonormalized updates by amortized power iteration."""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loc_opt import _checks
from loc_opt.inner import _matrix


class DionState(NamedTuple):
  """State of :func:`scale_by_dion` (matrix leaves only).

  A leaf viewed as ``(fan_in, fan_out)`` has ``r = min(rank, fan_in,
  fan_out)``.
  """
  momentum: Any  # per leaf: the leaf's shape, mu_dtype (default f32).
  basis: Any  # per leaf: (fan_in, r) f32: the warm-started right factor Q.


def _rank_for(shape, rank, rank_fraction):
  fan_in, fan_out = _matrix.matrix_shape(shape)
  small = min(fan_in, fan_out)
  if rank_fraction is not None:
    fraction = _matrix.static_number(rank_fraction, 'rank_fraction', float)
    fraction = _checks.in_interval(fraction, 'rank_fraction', 0, 1,
                                   closed='right')
    r = math.ceil(fraction * small)
  else:
    r = _checks.positive_int(_matrix.static_number(rank, 'rank'), 'rank')
  return min(r, small)


def _core(mu, eps, *, rank, rank_fraction, seed, mu_dtype):
  """Dion on a tree of matrix leaves."""

  def init_fn(params):
    leaves, treedef = jax.tree.flatten(params)
    key = jax.random.PRNGKey(seed)
    momentum, basis = [], []
    for i, p in enumerate(leaves):
      fan_in, _ = _matrix.matrix_shape(p.shape)
      r = _rank_for(p.shape, rank, rank_fraction)
      momentum.append(jnp.zeros_like(p, dtype=mu_dtype))
      # As in the reference, Q starts Gaussian and unnormalized.
      basis.append(jax.random.normal(jax.random.fold_in(key, i),
                                     (fan_in, r), jnp.float32))
    return DionState(momentum=jax.tree.unflatten(treedef, momentum),
                     basis=jax.tree.unflatten(treedef, basis))

  def update_fn(updates, state, params=None):
    del params

    def leaf(g, m, q):
      # Work in the (fan_out, fan_in) layout of the reference (PyTorch).
      g2 = _matrix.as_matrix(g).astype(jnp.float32).T
      fan_out, fan_in = g2.shape
      m2 = _matrix.as_matrix(m).astype(jnp.float32).T + g2
      p, _ = jnp.linalg.qr(m2 @ q)  # (fan_out, r), orthonormal columns.
      r = m2.T @ p  # (fan_in, r).
      m2 = m2 - (1 - mu) * (p @ r.T)  # Error feedback.
      q = r / (jnp.linalg.norm(r, axis=0, keepdims=True) + eps)
      u = (fan_out / fan_in) ** 0.5 * (p @ q.T)
      return (u.T.reshape(g.shape).astype(g.dtype),
              m2.T.reshape(m.shape).astype(m.dtype), q)

    out = jax.tree.map(leaf, updates, state.momentum, state.basis)
    pick = lambda j: jax.tree.map(lambda _, o: o[j], updates, out)
    return pick(0), DionState(momentum=pick(1), basis=pick(2))

  # Jitted so that eager callers run one compiled update, not op by op.
  return optax.GradientTransformation(init_fn, jax.jit(update_fn))


def scale_by_dion(
    mu: jax.typing.ArrayLike = 0.95,
    eps: jax.typing.ArrayLike = 1e-8,
    adam_b1: jax.typing.ArrayLike = 0.9,
    adam_b2: jax.typing.ArrayLike = 0.95,
    adam_eps: jax.typing.ArrayLike = 1e-8,
    *,
    rank: int = 768,
    rank_fraction: float | None = None,
    seed: int = 0,
    mu_dtype: Any = None,
    fallback: optax.GradientTransformation | None = None,
    matrix_mask: _matrix.MatrixMask = None,
) -> optax.GradientTransformation:
  r"""Dion's direction: one warm-started power-iteration step per update.

  For a matrix leaf in the reference's ``(fan_out, fan_in)`` layout (the
  transpose of the ``(fan_in, fan_out)`` view of a Flax kernel), with
  momentum :math:`M` and right factor :math:`Q` (``fan_in x r``):

  .. math::

    M \leftarrow M + G, \quad P = \operatorname{qr}(M Q)_Q, \quad
    R = M^T P, \quad M \leftarrow M - (1 - \mu) P R^T,

  .. math::

    Q \leftarrow R / (\|R_{:,j}\| + \epsilon), \quad
    u = \sqrt{\text{fan\_out}/\text{fan\_in}}\; P Q^T.

  :math:`P` has orthonormal columns; as the power iteration converges on a
  steady momentum, :math:`Q` tends to its right singular vectors, so
  :math:`P Q^T` tends to the polar factor of the rank-``r`` approximation of
  :math:`M`. The error feedback keeps the part of :math:`M` outside the
  rank-``r`` approximation (and :math:`\mu` of the part inside) for later
  steps. ``Q`` starts as an unnormalized Gaussian from ``seed`` (identical
  on all workers). QR runs in float32.

  This is the single-device form (``dion_simple`` in the reference); the
  sharded form, whose point is to communicate only :math:`P` and :math:`R`,
  is out of scope. On an explicit mesh each leaf is gathered for the update.
  Other leaves use ``fallback`` (default Adam with
  :math:`\beta = (0.9, 0.95)` as in the reference).

  Args:
    mu: momentum factor :math:`\mu` (the fraction of the captured low-rank
      part kept in :math:`M`).
    eps: added to the column norms of :math:`R`.
    adam_b1: the fallback Adam's :math:`\beta_1`.
    adam_b2: the fallback Adam's :math:`\beta_2`.
    adam_eps: the fallback Adam's :math:`\epsilon`.
    rank: static rank ``r`` (capped at ``min(fan_in, fan_out)``).
    rank_fraction: if set, ``r = ceil(rank_fraction * min(fan_in,
      fan_out))`` instead of ``rank``.
    seed: seed of the initial ``Q``.
    mu_dtype: dtype of the momentum ``M``; None means float32.
    fallback: transform for non-matrix leaves.
    matrix_mask: which leaves get the matrix rule: a tree of bools like the
      params, or a function of the params returning one; None: every leaf
      with two or more dimensions.

  Returns:
    A ``GradientTransformation``.

  Example:
    >>> import jax.numpy as jnp
    >>> from loc_opt.inner import dion
    >>> tx = dion(1e-2, rank=2)
    >>> state = tx.init({'w': jnp.ones((8, 4)), 'b': jnp.zeros(4)})

  References:
    Ahn et al., `Dion: Distributed Orthonormalized Updates`, 2025.
  """
  core = _core(mu, eps, rank=rank, rank_fraction=rank_fraction, seed=seed,
               mu_dtype=mu_dtype or jnp.float32)
  return _matrix.matrix_optimizer(
      core, _matrix.adam_fallback(fallback, adam_b1, adam_b2, adam_eps),
      matrix_mask)


def dion(
    learning_rate: optax.ScalarOrSchedule,
    mu: jax.typing.ArrayLike = 0.95,
    eps: jax.typing.ArrayLike = 1e-8,
    adam_b1: jax.typing.ArrayLike = 0.9,
    adam_b2: jax.typing.ArrayLike = 0.95,
    adam_eps: jax.typing.ArrayLike = 1e-8,
    weight_decay: jax.typing.ArrayLike = 0.0,
    mask: Any | None = None,
    *,
    rank: int = 768,
    rank_fraction: float | None = None,
    seed: int = 0,
    mu_dtype: Any = None,
    fallback: optax.GradientTransformation | None = None,
    matrix_mask: _matrix.MatrixMask = None,
) -> optax.GradientTransformation:
  """Dion: :func:`scale_by_dion`, decoupled weight decay, learning rate.

  See :func:`scale_by_dion` for the arguments; ``weight_decay`` and ``mask``
  go to ``optax.add_decayed_weights`` (the reference defaults to 0.01).

  References:
    Ahn et al., `Dion: Distributed Orthonormalized Updates`, 2025.
  """
  return optax.chain(
      scale_by_dion(mu, eps, adam_b1, adam_b2, adam_eps, rank=rank,
                    rank_fraction=rank_fraction, seed=seed,
                    mu_dtype=mu_dtype, fallback=fallback,
                    matrix_mask=matrix_mask),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
