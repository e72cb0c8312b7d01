"""Fira: GaLore-style low-rank Adam plus a norm-scaled full-rank residual."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loc_opt.inner import _matrix


class FiraState(NamedTuple):
  """State of :func:`scale_by_fira` (matrix leaves only).

  With a leaf viewed as a matrix and transposed so that it is tall,
  ``(big, small)``, and ``r = min(rank, small)``:
  """
  count: jax.Array  # shape=(), dtype=int32: steps taken.
  basis: Any  # per leaf: (small, r) f32: projector, right singular vectors.
  mu: Any  # per leaf: (big, r) f32: Adam first moment of the projection.
  nu: Any  # per leaf: (big, r) f32: Adam second moment of the projection.
  residual_norm: Any  # per leaf: shape=(), f32: last limited ||S||_F.


def _core(rank, update_proj_gap, scale, b1, b2, eps, limiter_gamma, *,
          reference_compat):
  """Fira on a tree of matrix leaves."""

  def init_fn(params):

    def leaf(p):
      big, small = _matrix.tall_shape(p.shape)
      r = min(_matrix.static_number(rank, 'rank'), small)
      return (jnp.zeros((small, r), jnp.float32),
              jnp.zeros((big, r), jnp.float32))

    shapes = jax.tree.map(leaf, params)
    first = lambda t: jax.tree.map(lambda p, s: s[0], params, t)
    second = lambda t: jax.tree.map(lambda p, s: s[1], params, t)
    return FiraState(
        count=jnp.zeros([], jnp.int32),
        basis=first(shapes),
        mu=second(shapes),
        nu=second(shapes),
        residual_norm=jax.tree.map(lambda _: jnp.zeros([], jnp.float32),
                                   params))

  def update_fn(updates, state, params=None):
    del params
    refresh = state.count % update_proj_gap == 0
    count = optax.safe_increment(state.count)
    cf = count.astype(jnp.float32)
    step_factor = jnp.sqrt(1 - b2 ** cf) / (1 - b1 ** cf)

    def leaf(g, basis, mu, nu, prev_norm):
      gc, transposed = _matrix.as_tall_matrix(g)
      r = basis.shape[1]
      basis = jax.lax.cond(
          refresh, lambda: _matrix.top_right_singular_vectors(gc, r),
          lambda: basis)
      low = gc @ basis  # R, (big, r).
      mu = b1 * mu + (1 - b1) * low
      nu = b2 * nu + (1 - b2) * jnp.square(low)
      normed = mu / (jnp.sqrt(nu) + eps)  # N.
      phi = (jnp.linalg.norm(normed, axis=1, keepdims=True)
             / (jnp.linalg.norm(low, axis=1, keepdims=True) + 1e-8))
      back_low = low @ basis.T
      if reference_compat:
        back_low = scale * back_low
      resid = (gc - back_low) * phi  # S.
      resid_norm = jnp.linalg.norm(resid)
      limiter = jnp.where(
          state.count > 0,
          jnp.maximum(resid_norm / (prev_norm + 1e-8), limiter_gamma)
          / limiter_gamma,
          1.0)
      resid = resid / limiter
      u = step_factor * (scale * (normed @ basis.T) + resid)
      return (_matrix.from_tall_matrix(u, transposed, g), basis, mu, nu,
              resid_norm / limiter)

    out = jax.tree.map(leaf, updates, state.basis, state.mu, state.nu,
                       state.residual_norm)
    pick = lambda j: jax.tree.map(lambda _, o: o[j], updates, out)
    return pick(0), FiraState(count=count, basis=pick(1), mu=pick(2),
                              nu=pick(3), residual_norm=pick(4))

  # Jitted so that eager callers run one compiled update, not op by op.
  return optax.GradientTransformation(init_fn, jax.jit(update_fn))


def scale_by_fira(
    update_proj_gap: jax.typing.ArrayLike = 200,
    scale: jax.typing.ArrayLike = 0.25,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-6,
    limiter_gamma: jax.typing.ArrayLike = 1.01,
    *,
    rank: int = 128,
    reference_compat: bool = False,
    fallback: optax.GradientTransformation | None = None,
    matrix_mask: _matrix.MatrixMask = None,
) -> optax.GradientTransformation:
  r"""Fira's direction: low-rank Adam plus the scaled residual, limited.

  A matrix leaf :math:`G` (transposed if needed so that it is tall,
  :math:`m \ge n`) is projected on the leading ``r`` right singular vectors
  :math:`V_r` (recomputed by SVD every ``update_proj_gap`` steps, the first
  step included): :math:`R = G V_r` (:math:`m \times r`). Adam without bias
  correction gives :math:`N = m_t/(\sqrt{v_t} + \epsilon)` from :math:`R`.
  The residual is scaled row by row by the ratio of norms along the rank
  dimension and its growth is limited:

  .. math::

    \phi_i = \frac{\|N_{i,:}\|}{\|R_{i,:}\| + 10^{-8}}, \quad
    S = (G - R V_r^T) \odot \phi, \quad
    S \leftarrow S / \frac{\max(\|S\|/\|S_{prev}\|, \gamma)}{\gamma}
    \ (t > 1),

  .. math::

    u = \frac{\sqrt{1 - \beta_2^t}}{1 - \beta_1^t}
        \big(\alpha N V_r^T + S\big).

  :math:`S_{prev}` is the previous limited residual. With full rank
  (``rank >= min(m, n)``) the residual vanishes and this is Adam in the
  rotated coordinates :math:`G V_r`, scaled by :math:`\alpha`. In the
  original orientation a wide leaf is projected on the left and scaled per
  column, as in the reference. Other leaves use ``fallback`` (default Adam
  with ``b1, b2, eps``).

  ``reference_compat=True`` reproduces the reference code's residual
  :math:`G - \alpha R V_r^T`, which leaks :math:`(1-\alpha)` of the
  in-subspace gradient into the residual path when :math:`\alpha \ne 1`;
  the default uses the orthogonal complement :math:`G - R V_r^T`.

  Args:
    update_proj_gap: steps between SVD refreshes of the projector.
    scale: :math:`\alpha`, the GaLore scale of the back-projection.
    b1: Adam :math:`\beta_1`.
    b2: Adam :math:`\beta_2`.
    eps: Adam :math:`\epsilon` (reference default 1e-6).
    limiter_gamma: :math:`\gamma`, the allowed growth of ``||S||`` per step.
    rank: static rank ``r`` (capped at ``min(m, n)`` per leaf).
    reference_compat: residual ``G - alpha * R V_r^T`` as in the reference.
    fallback: transform for non-matrix leaves.
    matrix_mask: which leaves get the matrix rule: a tree of bools like the
      params, or a function of the params returning one; None: every leaf
      with two or more dimensions.

  Returns:
    A ``GradientTransformation``.

  Example:
    >>> import jax.numpy as jnp
    >>> from loc_opt.inner import fira
    >>> tx = fira(1e-2, rank=2)
    >>> state = tx.init({'w': jnp.ones((8, 4)), 'b': jnp.zeros(4)})

  References:
    Chen et al., `Fira: Can We Achieve Full-rank Training of LLMs Under
    Low-rank Constraint?`, 2024.
  """
  core = _core(rank, update_proj_gap, scale, b1, b2, eps, limiter_gamma,
               reference_compat=reference_compat)
  return _matrix.matrix_optimizer(
      core, _matrix.adam_fallback(fallback, b1, b2, eps), matrix_mask)


def fira(
    learning_rate: optax.ScalarOrSchedule,
    update_proj_gap: jax.typing.ArrayLike = 200,
    scale: jax.typing.ArrayLike = 0.25,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-6,
    limiter_gamma: jax.typing.ArrayLike = 1.01,
    weight_decay: jax.typing.ArrayLike = 0.0,
    mask: Any | None = None,
    *,
    rank: int = 128,
    reference_compat: bool = False,
    fallback: optax.GradientTransformation | None = None,
    matrix_mask: _matrix.MatrixMask = None,
) -> optax.GradientTransformation:
  """Fira: :func:`scale_by_fira`, decoupled weight decay, learning rate.

  See :func:`scale_by_fira` for the arguments; ``weight_decay`` and ``mask``
  go to ``optax.add_decayed_weights``. The reference's pre-training script
  uses lr 0.01, ``scale`` 0.25, ``rank`` 128, ``update_proj_gap`` 200.

  References:
    Chen et al., `Fira: Can We Achieve Full-rank Training of LLMs Under
    Low-rank Constraint?`, 2024.
  """
  return optax.chain(
      scale_by_fira(update_proj_gap, scale, b1, b2, eps, limiter_gamma,
                    rank=rank, reference_compat=reference_compat,
                    fallback=fallback, matrix_mask=matrix_mask),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
