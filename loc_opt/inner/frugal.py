"""FRUGAL: Adam in a subspace, a state-free rule in its complement."""

import typing
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loc_opt import _checks
from loc_opt.inner import _matrix

Projector = Literal['blockwise', 'columns', 'random', 'svd']
FreeUpdate = Literal['sign', 'sgd']


class FrugalState(NamedTuple):
  """State of :func:`scale_by_frugal` (matrix leaves only).

  Per-leaf trees hold one entry per matrix leaf. With the leaf viewed as a
  matrix and transposed so that it is tall, ``(big, small)``, the projected
  types keep a basis of ``r`` directions of the ``small`` side.
  """
  count: jax.Array  # shape=(), dtype=int32: steps taken.
  key: jax.Array  # shape=(2,), dtype=uint32: PRNG key, folded with count.
  active: Any  # blockwise: per leaf, shape=(), bool: state-full now; else None.
  basis: Any  # projected types: per leaf, (small, r) f32; blockwise: None.
  mu: Any  # per leaf: (big, r) f32 (projected) or the leaf shape (blockwise).
  nu: Any  # per leaf: like mu, f32: Adam second moment.
  moment_count: Any  # per leaf: shape=(), int32: Adam steps since reset.


def _free(x, free_update):
  if free_update == 'sign':
    return jnp.sign(x)
  return x


def _adam(g, mu, nu, c, b1, b2, eps):
  mu = b1 * mu + (1 - b1) * g
  nu = b2 * nu + (1 - b2) * jnp.square(g)
  cf = c.astype(jnp.float32)
  mu_hat = mu / (1 - b1 ** cf)
  nu_hat = nu / (1 - b2 ** cf)
  return mu_hat / (jnp.sqrt(nu_hat) + eps), mu, nu


def _leaf_state(p, density, *, projector, rank):
  """``(basis, moment)`` zeros of one matrix leaf (basis None: blockwise)."""
  if projector == 'blockwise':
    return None, jnp.zeros(p.shape, jnp.float32)
  big, small = _matrix.tall_shape(p.shape)
  if rank is not None:
    r = _matrix.static_number(rank, 'rank')
  else:
    r = round(_matrix.static_number(density, 'density', float) * small)
  r = min(max(r, 1), small)
  return (jnp.zeros((small, r), jnp.float32),
          jnp.zeros((big, r), jnp.float32))


def _blockwise_leaf(g, refresh, chosen, active, mu, nu, c, *, b1, b2, eps,
                    free_scale, free_update, reset_on_refresh):
  """A whole leaf is state-full (Adam) or state-free for a period."""
  g32 = g.astype(jnp.float32)
  new_active = jnp.where(refresh, chosen, active)
  if reset_on_refresh:  # Unless the leaf stays state-full.
    keep = ~refresh | active
    mu, nu = jnp.where(keep, mu, 0.), jnp.where(keep, nu, 0.)
    c = jnp.where(keep, c, 0)
  c_new = optax.safe_increment(c)
  direction, mu_new, nu_new = _adam(g32, mu, nu, c_new, b1, b2, eps)
  u = jnp.where(new_active, direction, free_scale * _free(g32, free_update))
  return (u.astype(g.dtype), new_active,
          jnp.where(new_active, mu_new, mu),
          jnp.where(new_active, nu_new, nu),
          jnp.where(new_active, c_new, c))


def _projected_leaf(g, refresh, key, basis, mu, nu, c, *, projector, b1, b2,
                    eps, free_scale, free_update, reset_on_refresh):
  """Adam on the projection on ``basis``, state-free on the rest."""
  gc, transposed = _matrix.as_tall_matrix(g)  # (big, small), float32.
  small, r = basis.shape
  new_basis = {
      'svd': lambda: _matrix.top_right_singular_vectors(gc, r),
      'random': lambda: _matrix.random_orthonormal(key, small, r),
      'columns': lambda: _matrix.random_coordinates(key, small, r),
  }[projector]
  basis = jax.lax.cond(refresh, new_basis, lambda: basis)
  if reset_on_refresh:
    mu, nu = jnp.where(refresh, 0., mu), jnp.where(refresh, 0., nu)
    c = jnp.where(refresh, 0, c)
  c = optax.safe_increment(c)
  low = gc @ basis
  direction, mu, nu = _adam(low, mu, nu, c, b1, b2, eps)
  u = direction @ basis.T
  if r < small:  # At full rank the residual is rounding noise: drop it.
    u = u + free_scale * _free(gc - low @ basis.T, free_update)
  return _matrix.from_tall_matrix(u, transposed, g), basis, mu, nu, c


def _core(
    density, update_gap, b1, b2, eps, free_scale, *, projector, rank,
    free_update, reset_on_refresh, seed):
  """FRUGAL on a tree of matrix leaves."""
  rule = dict(b1=b1, b2=b2, eps=eps, free_scale=free_scale,
              free_update=free_update, reset_on_refresh=reset_on_refresh)

  def init_fn(params):
    leaves, treedef = jax.tree.flatten(params)
    states = [_leaf_state(p, density, projector=projector, rank=rank)
              for p in leaves]
    tree = lambda xs: jax.tree.unflatten(treedef, xs)
    blockwise = projector == 'blockwise'
    return FrugalState(
        count=jnp.zeros([], jnp.int32),
        key=jax.random.PRNGKey(seed),
        active=(tree([jnp.zeros([], bool) for _ in leaves]) if blockwise
                else None),
        basis=None if blockwise else tree([b for b, _ in states]),
        mu=tree([mo for _, mo in states]),
        nu=tree([mo for _, mo in states]),
        moment_count=tree([jnp.zeros([], jnp.int32) for _ in leaves]))

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    if not leaves:
      return updates, state
    flat = treedef.flatten_up_to
    tree = lambda xs: jax.tree.unflatten(treedef, xs)
    refresh = state.count % update_gap == 0
    step_key = jax.random.fold_in(state.key, state.count)
    if projector == 'blockwise':
      # A fresh random set of round(density * L) state-full leaves.
      num = len(leaves)
      ranks = jnp.argsort(jnp.argsort(jax.random.uniform(step_key, (num,))))
      chosen = ranks < jnp.round(density * num)
      out = [_blockwise_leaf(*args, **rule) for args in zip(
          leaves, [refresh] * num, chosen, flat(state.active),
          flat(state.mu), flat(state.nu), flat(state.moment_count))]
      updates, active, mu, nu, c = (tree(list(x)) for x in zip(*out))
      basis = None
    else:
      keys = [jax.random.fold_in(step_key, i) for i in range(len(leaves))]
      out = [_projected_leaf(g, refresh, *args, projector=projector, **rule)
             for g, *args in zip(
                 leaves, keys, flat(state.basis), flat(state.mu),
                 flat(state.nu), flat(state.moment_count))]
      updates, basis, mu, nu, c = (tree(list(x)) for x in zip(*out))
      active = None
    return updates, FrugalState(
        count=optax.safe_increment(state.count), key=state.key,
        active=active, basis=basis, mu=mu, nu=nu, moment_count=c)

  # Jitted so that eager callers run one compiled update, not op by op.
  return optax.GradientTransformation(init_fn, jax.jit(update_fn))


def scale_by_frugal(
    density: jax.typing.ArrayLike = 0.25,
    update_gap: jax.typing.ArrayLike = 200,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    free_scale: jax.typing.ArrayLike = 1.0,
    *,
    projector: Projector = 'blockwise',
    rank: int | None = None,
    free_update: FreeUpdate = 'sign',
    reset_on_refresh: bool = True,
    seed: int = 0,
    fallback: optax.GradientTransformation | None = None,
    matrix_mask: _matrix.MatrixMask = None,
) -> optax.GradientTransformation:
  r"""FRUGAL's direction: state-full Adam in a subspace, state-free outside.

  Each matrix leaf's gradient :math:`G` is split by a projector :math:`P_t`
  into a state-full part :math:`R = P_t(G)` and the residual
  :math:`G - P_t^{-1}(R)`:

  .. math::

    u = P_t^{-1}\big(\hat m / (\sqrt{\hat v} + \epsilon)\big)
      + s \cdot \operatorname{sign}\big(G - P_t^{-1}(R)\big),

  with Adam moments :math:`m, v` of :math:`R` only, :math:`s` =
  ``free_scale`` and ``sign`` replaced by the identity for
  ``free_update='sgd'``. The update is full rank; the state is that of the
  subspace. The projector is refreshed every ``update_gap`` steps (the first
  step included):

  * ``'blockwise'``: ``round(density * L)`` of the ``L`` matrix leaves,
    drawn at random, are wholly state-full; the others are wholly state-free.
    Static shapes mean every leaf keeps full-size moments, so this mode does
    *not* save memory here (moments of inactive leaves are frozen).
  * ``'columns'``: ``r`` random coordinates of the smaller side.
  * ``'random'``: a random orthonormal basis of ``r`` directions of the
    smaller side.
  * ``'svd'``: the leading ``r`` right singular vectors (of the tall
    orientation), as in GaLore.

  For the last three the moments have shape ``(max(m, n), r)``, with
  ``r = rank`` or ``round(density * min(m, n))`` (at least 1); if ``r`` is
  the full ``min(m, n)`` the residual is dropped (it is rounding noise).

  On refresh the moments of a changed subspace are reset to zero (and the
  bias correction restarts) when ``reset_on_refresh``; otherwise they are
  kept in the new coordinates, as GaLore does. Blockwise leaves that stay
  state-full keep their moments either way. Other leaves use ``fallback``
  (default Adam with ``b1, b2, eps``).

  Args:
    density: the state-full fraction :math:`\rho` (of leaves for
      ``'blockwise'``; of the smaller side otherwise, read at init).
    update_gap: steps between projector refreshes :math:`T`.
    b1: Adam :math:`\beta_1`.
    b2: Adam :math:`\beta_2`.
    eps: Adam :math:`\epsilon`.
    free_scale: multiplier of the state-free update.
    projector: ``'blockwise'``, ``'columns'``, ``'random'`` or ``'svd'``.
    rank: static subspace rank for the projected types (overrides
      ``density``).
    free_update: ``'sign'`` (signSGD) or ``'sgd'``.
    reset_on_refresh: reset moments when the subspace changes.
    seed: seed of the PRNG key kept in the state.
    fallback: transform for non-matrix leaves.
    matrix_mask: which leaves get the matrix rule: a tree of bools like the
      params, or a function of the params returning one; None: every leaf
      with two or more dimensions.

  Returns:
    A ``GradientTransformation``.

  Example:
    >>> import jax.numpy as jnp
    >>> from loc_opt.inner import frugal
    >>> tx = frugal(1e-3, density=0.25, projector='svd')
    >>> state = tx.init({'w': jnp.ones((8, 4)), 'b': jnp.zeros(4)})

  References:
    Zmushko, Beznosikov, Takáč, Horváth, `FRUGAL: Memory-Efficient
    Optimization by Reducing State Overhead for Scalable Training`, 2024
    (ICML 2025).
  """
  _checks.one_of(projector, 'projector', typing.get_args(Projector))
  _checks.one_of(free_update, 'free_update', typing.get_args(FreeUpdate))
  core = _core(
      density, update_gap, b1, b2, eps, free_scale, projector=projector,
      rank=rank, free_update=free_update, reset_on_refresh=reset_on_refresh,
      seed=seed)
  return _matrix.matrix_optimizer(
      core, _matrix.adam_fallback(fallback, b1, b2, eps), matrix_mask)


def frugal(
    learning_rate: optax.ScalarOrSchedule,
    density: jax.typing.ArrayLike = 0.25,
    update_gap: jax.typing.ArrayLike = 200,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    free_scale: jax.typing.ArrayLike = 1.0,
    weight_decay: jax.typing.ArrayLike = 0.0,
    mask: Any | None = None,
    *,
    projector: Projector = 'blockwise',
    rank: int | None = None,
    free_update: FreeUpdate = 'sign',
    reset_on_refresh: bool = True,
    seed: int = 0,
    fallback: optax.GradientTransformation | None = None,
    matrix_mask: _matrix.MatrixMask = None,
) -> optax.GradientTransformation:
  """FRUGAL: :func:`scale_by_frugal`, decoupled weight decay, learning rate.

  See :func:`scale_by_frugal` for the arguments; ``weight_decay`` and
  ``mask`` go to ``optax.add_decayed_weights``.

  References:
    Zmushko, Beznosikov, Takáč, Horváth, `FRUGAL: Memory-Efficient
    Optimization by Reducing State Overhead for Scalable Training`, 2024
    (ICML 2025).
  """
  return optax.chain(
      scale_by_frugal(density, update_gap, b1, b2, eps, free_scale,
                      projector=projector, rank=rank,
                      free_update=free_update,
                      reset_on_refresh=reset_on_refresh, seed=seed,
                      fallback=fallback, matrix_mask=matrix_mask),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
