r"""Convex-theory tools: the last-iterate bound of a schedule, its optimal
base rate, and rate transfer between schedules.

Write the schedule as a base rate ``gamma`` times a shape ``s_t`` (max 1,
``t = 1..T``). For SGD on a convex problem with ``||x_1 - x*|| = D`` and
gradients bounded by ``G``, the last-iterate bound is

.. math::

  \Omega(\gamma) = \frac{D^2}{2 \gamma S_1} + \gamma G^2 C(s), \quad
  C(s) = \frac{\sum_t s_t^2}{2 S_1} + \frac12 \sum_{k=1}^{T-1}
    \frac{s_k}{A_{k+1}} \frac{B_k}{A_k},

with ``S_1 = sum_t s_t`` and suffix sums ``A_k = sum_{t>=k} s_t``,
``B_k = sum_{t>=k} s_t^2`` (cost O(T)). Minimizing over ``gamma``:

.. math::

  \gamma^* = \frac{D / G}{\sqrt{2 S_1 C(s)}}, \qquad
  \Omega^* = D G \sqrt{2 C(s) / S_1},

and the optimal rate transfers from shape A to shape B by
``gamma*_B / gamma*_A = sqrt(S_1^A C(s^A) / (S_1^B C(s^B)))``. Extending the
horizon is recomputing with the longer shape.

A shape ending in zeros makes ``A_{k+1} = 0``; zero-rate steps do not move
the iterate, so trailing zeros are dropped (or floor the shape, as
:func:`schedule_shape` can, which is what the reference numbers use).

The bound's index conventions are an open item (spec §6); this is the spec's
computable form, checked against the direct double sum in the tests.

References:
  Schaipp, Hägele, Taylor, Şimşekli, Bach, *The Surprising Agreement Between
  Convex Optimization Theory and Learning-Rate Scheduling for Large Model
  Training*, 2025.

  Defazio, Cutkosky, Mehta, Mishchenko, *Optimal Linear Decay Learning Rate
  Schedules and Further Refinements*, 2023.
"""

import jax
import jax.numpy as jnp
import numpy as np

from loc_opt.schedules._common import check_int
from loc_opt.schedules._common import Schedule


def schedule_shape(
    schedule: Schedule,
    total_steps: int,
    *,
    peak_value: float | None = None,
    floor: float = 0.0,
) -> np.ndarray:
  """The shape ``s_t = schedule(t) / peak`` at counts ``0..T-1``, floored.

  Args:
    schedule: a ``step -> value`` schedule (evaluated on all counts at once).
    total_steps: ``T``.
    peak_value: the base rate to divide by (default: the maximum value).
    floor: the smallest shape value kept (e.g. 1e-3 so a decay to 0 keeps
      the bound finite).

  Returns:
    A float64 array of length ``T``.
  """
  total = check_int(total_steps, 'total_steps', minimum=1)
  values = np.asarray(jax.jit(schedule)(jnp.arange(total)), np.float64)
  values = np.broadcast_to(values, (total,))
  peak = values.max() if peak_value is None else peak_value
  if not peak > 0:
    raise ValueError(f'the peak value must be > 0, got {peak}')
  return np.maximum(values / peak, floor)


def bound_constants(shape: np.ndarray) -> tuple[float, float]:
  """``(S_1, C(s))`` of a shape, trailing zeros dropped.

  Raises:
    ValueError: for a negative, non-finite or all-zero shape.
  """
  s = np.asarray(shape, np.float64)
  if s.ndim != 1 or not np.all(np.isfinite(s)) or np.any(s < 0):
    raise ValueError('shape must be a 1-D array of finite values >= 0')
  positive = np.flatnonzero(s > 0)
  if positive.size == 0:
    raise ValueError('shape is all zeros')
  s = s[:positive[-1] + 1]
  a = np.cumsum(s[::-1])[::-1]
  b = np.cumsum((s * s)[::-1])[::-1]
  s1 = a[0]
  c = b[0] / (2.0 * s1) + 0.5 * np.sum(s[:-1] / a[1:] * (b[:-1] / a[:-1]))
  return float(s1), float(c)


def theory_bound(
    shape: np.ndarray, D: float = 1.0, G: float = 1.0,
    base_lr: float | None = None,
) -> float:
  """The bound ``Omega(gamma)``, or ``Omega*`` when ``base_lr`` is None.

  Args:
    shape: the schedule's shape ``s_t`` (see :func:`schedule_shape`).
    D: the distance from the start to a minimizer.
    G: the gradient-norm bound.
    base_lr: ``gamma``, the rate that multiplies the shape.

  Returns:
    The bound on ``f(x_T) - f*``.

  Example:
    >>> round(theory_bound(np.full(1000, 1.0)), 5)
    0.09211
  """
  s1, c = bound_constants(shape)
  if base_lr is None:
    return float(D * G * np.sqrt(2.0 * c / s1))
  if not base_lr > 0:
    raise ValueError(f'base_lr must be > 0, got {base_lr}')
  return float(D**2 / (2.0 * base_lr * s1) + base_lr * G**2 * c)


def theory_optimal_base_lr(shape: np.ndarray, D: float = 1.0,
                           G: float = 1.0) -> float:
  """``gamma* = (D / G) / sqrt(2 S_1 C(s))``, the rate minimizing the bound."""
  s1, c = bound_constants(shape)
  return float(D / G / np.sqrt(2.0 * s1 * c))


def transfer_lr(lr_a: float, shape_a: np.ndarray,
                shape_b: np.ndarray) -> float:
  """Moves a tuned base rate from schedule shape A to shape B.

  ``lr_b = lr_a * sqrt(S_1^A C(s^A) / (S_1^B C(s^B)))``: the ratio of the
  theory-optimal rates, applied to the tuned one. Use it to retune for a
  different schedule or a longer horizon.
  """
  s1_a, c_a = bound_constants(shape_a)
  s1_b, c_b = bound_constants(shape_b)
  return float(lr_a * np.sqrt(s1_a * c_a / (s1_b * c_b)))
