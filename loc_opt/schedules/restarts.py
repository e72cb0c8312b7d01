r"""Cosine annealing with warm restarts (SGDR).

Cycle ``i`` lasts ``T_i = T_0 m^i`` steps and anneals from
``eta_max^(i) = eta_max d^i`` to ``eta_min``:

.. math::

  \eta_t = \eta_{min} + \tfrac12 (\eta_{max}^{(i)} - \eta_{min})
    (1 + \cos(\pi\, t_{cur} / T_i)),

where ``t_cur`` is the number of steps since the last restart. The cycle
index is computed in closed form, so the schedule has no horizon (Optax's
``sgdr_schedule`` needs the list of cycles up front and stays at the last
``end_value`` after it; on its cycles the two agree).

References:
  Loshchilov, Hutter, *SGDR: Stochastic Gradient Descent with Warm
  Restarts*, 2016 (ICLR 2017).
"""

import math

import jax.numpy as jnp

from loc_opt.schedules._common import as_float_step
from loc_opt.schedules._common import check_int
from loc_opt.schedules._common import Schedule


def cosine_restarts_schedule(
    peak_value: float,
    first_period: int,
    *,
    period_mult: float = 1.0,
    min_value: float = 0.0,
    warmup_steps: int = 0,
    peak_decay: float = 1.0,
    init_value: float = 0.0,
) -> Schedule:
  """SGDR: cosine cycles of growing length, each restarting at a peak.

  An optional linear warmup from ``init_value`` to ``peak_value`` over
  ``warmup_steps`` comes first; the cycles start at count ``warmup_steps``
  (exactly ``peak_value`` there). Each restart happens at the count where a
  cycle would reach ``min_value``, so ``min_value`` itself is approached
  but never taken at an integer count.

  Args:
    peak_value: ``eta_max`` of the first cycle.
    first_period: ``T_0``, the first cycle's length in steps (>= 1).
    period_mult: ``m >= 1`` (``T_mult`` in the paper), the growth of each
      cycle's length.
    min_value: ``eta_min``, the floor every cycle anneals towards.
    warmup_steps: linear warmup before the first cycle.
    peak_decay: ``d`` in (0, 1], multiplies the peak at each restart.
    init_value: the value at count 0 when ``warmup_steps > 0``.

  Returns:
    A jittable ``step -> value`` schedule.

  Example:
    >>> s = cosine_restarts_schedule(1.0, 4, period_mult=2.0)
    >>> jax.jit(s)(jnp.array([0, 2, 4, 8, 12])).round(3).tolist()
    [1.0, 0.5, 1.0, 0.5, 1.0]

  References:
    Loshchilov, Hutter, *SGDR: Stochastic Gradient Descent with Warm
    Restarts*, 2016.
  """
  period0 = check_int(first_period, 'first_period', minimum=1)
  warmup = check_int(warmup_steps, 'warmup_steps')
  if not period_mult >= 1.0:
    raise ValueError(f'period_mult must be >= 1, got {period_mult}')
  if not 0.0 < peak_decay <= 1.0:
    raise ValueError(f'peak_decay must lie in (0, 1], got {peak_decay}')
  if min_value > peak_value:
    raise ValueError(f'min_value={min_value} exceeds peak_value='
                     f'{peak_value}')
  mult = float(period_mult)
  lo = min(min_value, init_value) if warmup else min_value
  hi = max(peak_value, init_value) if warmup else peak_value

  def cycle_start(i):
    """The count (after warmup) at which cycle ``i`` starts."""
    if mult == 1.0:
      return period0 * i
    return period0 * (mult**i - 1.0) / (mult - 1.0)

  def schedule(step):
    t = jnp.maximum(as_float_step(step), 0.0)
    r = t - warmup
    rr = jnp.maximum(r, 0.0)
    if mult == 1.0:
      i = jnp.floor(rr / period0)
    else:
      i = jnp.floor(jnp.log1p(rr * (mult - 1.0) / period0) / math.log(mult))
      # Rounding in the log can land one cycle off near a restart.
      i = jnp.where(cycle_start(i + 1.0) <= rr, i + 1.0, i)
      i = jnp.where(cycle_start(i) > rr, i - 1.0, i)
    period = period0 * mult**i
    peak = peak_value * peak_decay**i
    t_cur = rr - cycle_start(i)
    w = 0.5 * (1.0 + jnp.cos(jnp.pi * t_cur / period))
    value = w * peak + (1.0 - w) * min_value
    if warmup:
      ramp = init_value + (peak_value - init_value) * t / warmup
      value = jnp.where(r < 0.0, ramp, value)
    return jnp.clip(value, lo, hi)

  return schedule
