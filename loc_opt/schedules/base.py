"""Basic learning-rate schedules built from Optax pieces, and their registry.

Schedules are pure, jittable ``step -> value`` functions. Decay endpoints are
clamped so that the last step is exactly ``end_value`` under ``jax.jit``.
:data:`SCHEDULES` names every learning-rate schedule of the package for
configs (``optimizer.schedule`` with ``optimizer.schedule_kwargs``).
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import optax

from loc_opt.schedules import restarts
from loc_opt.schedules import wsd
from loc_opt.schedules._common import clamp
from loc_opt.schedules._common import Schedule
from loc_opt.schedules._common import steps_from_fraction


def constant_schedule(peak_value: float, total_steps: int = 0) -> Schedule:
  """A constant learning rate ``peak_value`` (shaped like the step)."""
  del total_steps
  return lambda step: jnp.full(jnp.shape(step), peak_value, jnp.float32)


def warmup_linear_schedule(
    peak_value: float, total_steps: int, *, warmup_steps: int | float = 0,
    init_value: float = 0.0, end_value: float = 0.0,
) -> Schedule:
  """Linear warmup to ``peak_value``, then linear decay to ``end_value``.

  The decay reaches ``end_value`` exactly at ``total_steps`` (clamped: under
  jit Optax's linear schedule can overshoot by one rounding).
  """
  warmup = steps_from_fraction(warmup_steps, total_steps,
                               field='warmup_steps')
  if warmup > total_steps:
    raise ValueError(f'warmup_steps={warmup} exceeds total_steps='
                     f'{total_steps}')
  sched = optax.join_schedules(
      [optax.linear_schedule(init_value, peak_value, max(warmup, 1)),
       optax.linear_schedule(peak_value, end_value,
                             max(total_steps - warmup, 1))],
      [warmup],
  )
  lo, hi = min(init_value, peak_value, end_value), max(init_value,
                                                        peak_value, end_value)
  return clamp(sched, lo, hi)


def warmup_cosine_schedule(
    peak_value: float, total_steps: int, *, warmup_steps: int | float = 0,
    init_value: float = 0.0, end_value: float = 0.0,
) -> Schedule:
  """Linear warmup to ``peak_value``, then cosine decay to ``end_value``.

  Built on ``optax.warmup_cosine_decay_schedule``; ``total_steps`` counts the
  warmup too.
  """
  warmup = steps_from_fraction(warmup_steps, total_steps,
                               field='warmup_steps')
  if warmup >= total_steps:
    raise ValueError(f'warmup_steps={warmup} must be below total_steps='
                     f'{total_steps}')
  sched = optax.warmup_cosine_decay_schedule(
      init_value, peak_value, warmup, total_steps, end_value)
  lo, hi = min(init_value, peak_value, end_value), max(init_value,
                                                        peak_value, end_value)
  return clamp(sched, lo, hi)


def _cosine_restarts(peak_value: float, total_steps: int, *,
                     first_period: int | float, warmup_steps: int | float = 0,
                     **kwargs: Any) -> Schedule:
  """:func:`cosine_restarts_schedule` with lengths as fractions of the run."""
  return restarts.cosine_restarts_schedule(
      peak_value,
      max(1, steps_from_fraction(first_period, total_steps,
                                 field='first_period')),
      warmup_steps=steps_from_fraction(warmup_steps, total_steps,
                                       field='warmup_steps'),
      **kwargs)


def _wsds(peak_value: float, total_steps: int, *,
          decay_steps: int | float,
          decay_points: Sequence[int | float] | None = None,
          warmup_steps: int | float = 0, **kwargs: Any) -> Schedule:
  """:func:`wsds_schedule` for a run of ``total_steps``.

  ``decay_points`` (default ``[total_steps]``) and ``warmup_steps`` may be
  fractions of the run; the last decay point must be ``total_steps``.
  """
  points = [steps_from_fraction(c, total_steps, field='decay_points[]')
            for c in (decay_points or [total_steps])]
  if points[-1] != total_steps:
    raise ValueError(f'the last of decay_points must be total_steps='
                     f'{total_steps}, got {points[-1]}')
  return wsd.wsds_schedule(
      peak_value, points, decay_steps,
      warmup_steps=steps_from_fraction(warmup_steps, total_steps,
                                       field='warmup_steps'),
      **kwargs)


SCHEDULES: Mapping[str, Callable[..., Schedule]] = {
    'constant': constant_schedule,
    'warmup_linear': warmup_linear_schedule,
    'warmup_cosine': warmup_cosine_schedule,
    'warmup_constant': wsd.warmup_constant_schedule,
    'linear_decay': wsd.linear_decay_schedule,
    'wsd': wsd.wsd_schedule,
    'wsds': _wsds,
    'cosine_restarts': _cosine_restarts,
}


def make_schedule(name: str, peak_value: float, total_steps: int,
                  **kwargs: Any) -> Schedule:
  """Looks ``name`` up in :data:`SCHEDULES` and builds the schedule.

  Args:
    name: a key of :data:`SCHEDULES` (config field ``optimizer.schedule``).
    peak_value: the peak learning rate.
    total_steps: the run's length in steps (fractions are relative to it).
    **kwargs: the schedule's keyword arguments
      (``optimizer.schedule_kwargs``).

  Returns:
    A jittable ``step -> value`` schedule.

  Raises:
    ValueError: for an unknown name or arguments the schedule does not take.

  Example:
    >>> s = make_schedule('wsd', 1e-3, 1000, warmup_steps=100,
    ...                   decay_steps=0.2, decay_shape='1-sqrt')
  """
  if name not in SCHEDULES:
    raise ValueError(f'unknown schedule {name!r} (field optimizer.schedule); '
                     f'choose one of {sorted(SCHEDULES)}')
  try:
    return SCHEDULES[name](peak_value, total_steps, **kwargs)
  except TypeError as e:
    raise ValueError(f'bad optimizer.schedule_kwargs for optimizer.schedule='
                     f'{name!r}: {e}') from e
