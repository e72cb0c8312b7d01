"""Basic learning-rate schedules built from Optax pieces, and their registry.

Schedules are pure, jittable ``step -> value`` functions. Decay endpoints are
clamped so that the last step is exactly ``end_value`` under ``jax.jit``.
"""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

Schedule = Callable[[jax.typing.ArrayLike], jax.Array]


def steps_from_fraction(value: float | int, total_steps: int, *,
                        field: str = 'steps') -> int:
  """Turns a fraction of ``total_steps`` (a float in [0, 1]) into steps.

  Integers are taken as step counts. Raises ``ValueError`` naming ``field``
  for negative values or fractions above 1.
  """
  if isinstance(value, bool):
    raise TypeError(f'{field} must be an int or a fraction, got {value!r}')
  if isinstance(value, float):
    if not 0.0 <= value <= 1.0:
      raise ValueError(f'{field} as a fraction must lie in [0, 1], got {value}')
    return int(round(value * total_steps))
  if value < 0:
    raise ValueError(f'{field} must be >= 0, got {value}')
  return int(value)


def constant_schedule(peak_value: float, total_steps: int = 0) -> Schedule:
  """A constant learning rate ``peak_value``."""
  del total_steps
  return optax.constant_schedule(peak_value)


def _clamp(schedule: Schedule, lo: float, hi: float) -> Schedule:
  return lambda step: jnp.clip(schedule(step), lo, hi)


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
  return _clamp(sched, lo, hi)


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
  return _clamp(sched, lo, hi)


SCHEDULES: Mapping[str, Callable[..., Schedule]] = {
    'constant': constant_schedule,
    'warmup_linear': warmup_linear_schedule,
    'warmup_cosine': warmup_cosine_schedule,
}


def make_schedule(name: str, peak_value: float, total_steps: int,
                  **kwargs: Any) -> Schedule:
  """Looks ``name`` up in :data:`SCHEDULES` and builds the schedule."""
  if name not in SCHEDULES:
    raise ValueError(f'unknown schedule {name!r} (field optimizer.schedule); '
                     f'choose one of {sorted(SCHEDULES)}')
  return SCHEDULES[name](peak_value, total_steps, **kwargs)
