"""Multi-timescale Adam: slow momenta mixed with the raw gradient (MT-DAO).

With local updates and a sync period far beyond the half-life of Adam's
``b1 = 0.9`` (about 6.6 steps), the first moment forgets the shared direction
between syncs. The inner optimizer of MT-DAO keeps one or more *slow*
momenta (``beta`` around 0.99 to 0.999) and mixes them with the raw gradient
quasi-hyperbolically, as QHM and AdEMAMix do, over an Adam-style second
moment. :func:`loc_opt.outer.desloc.mt_dao` wraps it in DES-LOC so that
each state is averaged over workers on its own period.

References:
  Iacob et al., *MT-DAO: Multi-Timescale Distributed Adaptive Optimizers
  with Local Updates*, 2025.

  Ma, Yarats, *Quasi-hyperbolic momentum and Adam for deep learning*, 2019.

  Pagliardini, Ablin, Grangier, *The AdEMAMix Optimizer: Better, Faster,
  Older*, 2024.
"""

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loc_opt import _checks

ArrayLike = jax.typing.ArrayLike


class ScaleByMultiTimescaleState(NamedTuple):
  """State of :func:`scale_by_multi_timescale`.

  Attributes:
    count: int32 scalar, updates taken (the bias-correction power).
    slow: tuple of ``N`` slow momenta ``u_j``, each a tree like the params
      in ``mu_dtype`` (the params' dtypes by default).
    nu: second moment ``v``, a tree like the params in their dtypes.
  """

  count: jax.Array
  slow: tuple[optax.Updates, ...]
  nu: optax.Updates


def _check_betas(slow_betas: Sequence[ArrayLike],
                 slow_weights: Sequence[ArrayLike]) -> None:
  if len(slow_betas) != len(slow_weights):
    raise ValueError(
        f'slow_weights has {len(slow_weights)} entries for '
        f'{len(slow_betas)} slow_betas')
  for beta in slow_betas:
    if isinstance(beta, jax.core.Tracer):
      continue
    if np.ndim(beta):
      raise ValueError(f'slow_betas must be scalars, got {beta!r}')
    _checks.in_interval(beta, 'slow_betas', 0, 1, closed='left')


def _is_static(x: Any, value: float) -> bool:
  """Whether ``x`` is a concrete number equal to ``value``."""
  return (not isinstance(x, jax.core.Tracer) and np.ndim(x) == 0
          and float(x) == value)


def _weighted_sum(terms: Sequence[tuple[Any, jax.Array]]) -> jax.Array:
  """``sum_i w_i x_i``, leaving out terms whose weight is a static 0 and
  multiplications by a static 1 (so a weight-1 momentum reproduces Adam's
  arithmetic bit for bit, also under jit)."""
  total = None
  for w, x in terms:
    if _is_static(w, 0.0):
      continue
    term = x if _is_static(w, 1.0) else w * x
    total = term if total is None else total + term
  return jnp.zeros_like(terms[0][1]) if total is None else total


def scale_by_multi_timescale(
    slow_betas: Sequence[ArrayLike] = (0.995,),
    slow_weights: Sequence[ArrayLike] = (0.8,),
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-8,
    eps_root: ArrayLike = 0.0,
    *,
    mu_dtype: Any = None,
) -> optax.GradientTransformation:
  r"""Rescales updates by mixed slow momenta over an Adam second moment.

  For gradient :math:`g_t` at step :math:`t` (1-based) and slow momenta
  :math:`j = 1..N`,

  .. math::

    u_j &\leftarrow \beta_j u_j + (1 - \beta_j)\, g_t, \qquad
    v \leftarrow \beta_2 v + (1 - \beta_2)\, g_t^2, \\
    \hat u_j &= \frac{u_j}{1 - \beta_j^t}, \qquad
    \hat v = \frac{v}{1 - \beta_2^t}, \\
    d_t &= \frac{(1 - \sum_j \omega_j)\, g_t + \sum_j \omega_j \hat u_j}
               {\sqrt{\hat v + \epsilon_{root}} + \epsilon} .

  Bias corrections: every moment is bias-corrected with its own decay, as
  Adam does (the MT-DAO paper leaves this open). Then one slow momentum with
  weight 1 and decay ``b1`` is exactly ``optax.scale_by_adam(b1, b2)``, and
  weights 0 give the RMSProp-like step :math:`g_t / (\sqrt{\hat v} +
  \epsilon)` with a bias-corrected :math:`\hat v`. The corrections use the
  shared step count, so averaging the moments over workers (DES-LOC) leaves
  them valid.

  Args:
    slow_betas: decays :math:`\beta_j` of the slow momenta, each in [0, 1).
    slow_weights: mixing weights :math:`\omega_j`, one per slow momentum;
      the raw gradient gets :math:`1 - \sum_j \omega_j`.
    b2: decay of the second moment.
    eps: added to the denominator outside the square root.
    eps_root: added to :math:`\hat v` inside the square root.
    mu_dtype: dtype of the slow momenta (default: the params' dtypes).

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> import optax
    >>> from loc_opt.inner import multi_timescale
    >>> tx = optax.chain(multi_timescale.scale_by_multi_timescale(),
    ...                  optax.scale_by_learning_rate(1e-3))

  References:
    Iacob et al., *MT-DAO: Multi-Timescale Distributed Adaptive Optimizers
    with Local Updates*, 2025.
  """
  slow_betas = tuple(slow_betas)
  slow_weights = tuple(slow_weights)
  _check_betas(slow_betas, slow_weights)
  mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

  def init_fn(params):
    slow = tuple(optax.tree.zeros_like(params, dtype=mu_dtype)
                 for _ in slow_betas)
    return ScaleByMultiTimescaleState(
        count=jnp.zeros([], jnp.int32),
        slow=slow,
        nu=optax.tree.zeros_like(params),
    )

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    slow = tuple(optax.tree.update_moment(updates, u, beta, 1)
                 for u, beta in zip(state.slow, slow_betas))
    nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
    slow_hat = [optax.tree.bias_correction(u, beta, count)
                for u, beta in zip(slow, slow_betas)]
    nu_hat = optax.tree.bias_correction(nu, b2, count)
    grad_weight = 1.0 - sum(slow_weights)

    def direction(g, v, *us):
      if g is None:
        return None
      num = _weighted_sum([(grad_weight, g), *zip(slow_weights, us)])
      return (num / (jnp.sqrt(v + eps_root) + eps)).astype(g.dtype)

    new_updates = jax.tree.map(direction, updates, nu_hat, *slow_hat,
                               is_leaf=lambda x: x is None)
    slow = tuple(optax.tree.cast(u, mu_dtype) for u in slow)
    nu = optax.tree.cast_like(nu, state.nu)
    return new_updates, ScaleByMultiTimescaleState(
        count=count, slow=slow, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)


def multi_timescale_adam(
    learning_rate: optax.ScalarOrSchedule,
    *,
    slow_betas: Sequence[ArrayLike] = (0.995,),
    slow_weights: Sequence[ArrayLike] = (0.8,),
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-8,
    eps_root: ArrayLike = 0.0,
    weight_decay: ArrayLike = 0.0,
    mask: Any = None,
    mu_dtype: Any = None,
) -> optax.GradientTransformation:
  r"""Adam with slow momenta mixed into the gradient: MT-DAO's optimizer.

  ``optax.chain(scale_by_multi_timescale(...),
  optax.add_decayed_weights(weight_decay, mask),
  optax.scale_by_learning_rate(learning_rate))``: the step is
  :math:`-\gamma_t (d_t + \lambda \theta)` with :math:`d_t` of
  :func:`scale_by_multi_timescale` (decoupled weight decay, as AdamW).

  Args:
    learning_rate: :math:`\gamma_t`, a scalar or a schedule.
    slow_betas: decays of the slow momenta (0.995: half-life ~138 steps).
    slow_weights: their mixing weights; the raw gradient gets one minus
      their sum. The paper does not give the weight; 0.8 is our default,
      in the range QHM uses.
    b2: decay of the second moment.
    eps: added to the denominator outside the square root.
    eps_root: added inside the square root.
    weight_decay: decoupled weight decay :math:`\lambda`.
    mask: which leaves decay, as in ``optax.add_decayed_weights``.
    mu_dtype: dtype of the slow momenta.

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> from loc_opt.inner import multi_timescale
    >>> tx = multi_timescale.multi_timescale_adam(
    ...     3e-4, slow_betas=(0.995,), slow_weights=(0.8,), b2=0.9999)

  References:
    Iacob et al., *MT-DAO: Multi-Timescale Distributed Adaptive Optimizers
    with Local Updates*, 2025; Ma and Yarats, *Quasi-hyperbolic momentum and
    Adam for deep learning*, 2019.
  """
  return optax.chain(
      scale_by_multi_timescale(slow_betas, slow_weights, b2, eps, eps_root,
                               mu_dtype=mu_dtype),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
