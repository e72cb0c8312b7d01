r"""Schedule refinement from the gradient norms of a previous run.

For the last iterate of SGD on convex problems the bound of Defazio et al.
is minimized, for observed per-step gradient norms ``G_t``, by

.. math::

  \eta_t \propto w_t \sum_{p = t + 1}^{T} w_p, \qquad w_t = G_t^{-2},

(``w_t = 1 / G_t`` with l1 norms for Adam-like, coordinate-wise methods).
Constant norms give ``eta_t propto T - t``: linear decay. Real norms give an
automatic warmup (large early norms) and a sharper final anneal. The norms
are median-filtered first, since the raw sequence is noisy.

The index conventions of the bound, the smoothing ``tau`` and the l1
quantity used for Adam (gradient or update) are open items (spec §6); this
module follows the spec's statement of the algorithm.

References:
  Defazio, Cutkosky, Mehta, Mishchenko, *When, Why and How Much? Adaptive
  Learning Rate Scheduling by Refinement* (v2: *Optimal Linear Decay
  Learning Rate Schedules and Further Refinements*), 2023.
"""

import jax
import jax.numpy as jnp
import numpy as np

from loc_opt.schedules._common import Schedule

_KINDS = {'sgd': 2.0, 'adam': 1.0}  # the power p in w_t = G_t^-p


def median_filter(x: np.ndarray, width: int) -> np.ndarray:
  """Running median of ``x`` over ``width`` points (made odd), edge-padded."""
  x = np.asarray(x, np.float64)
  width = max(1, int(width))
  if width % 2 == 0:
    width += 1
  if width == 1:
    return x.copy()
  half = width // 2
  padded = np.pad(x, half, mode='edge')
  windows = np.lib.stride_tricks.sliding_window_view(padded, width)
  return np.median(windows, axis=-1)


def refined_schedule(
    grad_norms: np.ndarray,
    *,
    tau: float = 0.0,
    kind: str = 'sgd',
    peak_value: float = 1.0,
) -> np.ndarray:
  """The refined learning-rate sequence for a run of ``len(grad_norms)`` steps.

  1. ``G_hat = median_filter(G, width = tau * T)`` (edge padding).
  2. ``w_t = G_hat_t^-2`` (``kind='sgd'``) or ``G_hat_t^-1`` (``'adam'``,
     pass l1 norms).
  3. ``eta_t = w_t * sum_{p > t} w_p``.
  4. ``eta <- peak_value * eta / max(eta)``.

  Args:
    grad_norms: per-step gradient norms of a previous run (length T >= 2),
      step ``t`` at index ``t`` (count convention: index 0 is the first
      update).
    tau: the median filter's width as a fraction of T (0: no smoothing).
    kind: ``'sgd'`` or ``'adam'``.
    peak_value: the tuned peak rate the normalized schedule is scaled to.

  Returns:
    A float64 array of T learning rates; the last is 0. Use
    :func:`schedule_from_array` to get a ``step -> value`` schedule.

  Example:
    >>> refined_schedule(np.ones(5)).tolist()
    [1.0, 0.75, 0.5, 0.25, 0.0]
  """
  if kind not in _KINDS:
    raise ValueError(f'unknown kind {kind!r}; choose one of {sorted(_KINDS)}')
  g = np.asarray(grad_norms, np.float64)
  if g.ndim != 1 or g.size < 2:
    raise ValueError(f'grad_norms must be a 1-D sequence of >= 2 norms, got '
                     f'shape {g.shape}')
  if not 0.0 <= tau <= 1.0:
    raise ValueError(f'tau must lie in [0, 1], got {tau}')
  g_hat = median_filter(g, int(round(tau * g.size)))
  if not np.all(np.isfinite(g_hat)) or np.any(g_hat <= 0):
    raise ValueError('grad_norms must be positive and finite')
  w = g_hat ** -_KINDS[kind]
  after = np.cumsum(w[::-1])[::-1] - w  # sum_{p > t} w_p
  eta = w * after
  return peak_value * eta / eta.max()


def schedule_from_array(values: np.ndarray,
                        peak_value: float = 1.0) -> Schedule:
  """A jittable schedule ``t -> peak_value * values[clip(t, 0, T - 1)]``."""
  table = jnp.asarray(np.asarray(values, np.float32) * peak_value)
  if table.ndim != 1 or table.size == 0:
    raise ValueError(f'values must be a non-empty 1-D array, got shape '
                     f'{table.shape}')
  last = table.size - 1

  def schedule(step: jax.typing.ArrayLike) -> jax.Array:
    return table[jnp.clip(jnp.asarray(step).astype(jnp.int32), 0, last)]

  return schedule
