"""Pieces shared by the schedule modules: the type, step helpers, checks."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

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


def check_int(value, field: str, *, minimum: int = 0) -> int:
  """Returns ``value`` as an int, or raises naming ``field``."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f'{field} must be an int, got {value!r}')
  if value < minimum:
    raise ValueError(f'{field} must be >= {minimum}, got {value}')
  return int(value)


def clamp(schedule: Schedule, lo: float, hi: float) -> Schedule:
  """``schedule`` with its values clipped to ``[lo, hi]``."""
  return lambda step: jnp.clip(schedule(step), lo, hi)


def as_float_step(step: jax.typing.ArrayLike) -> jax.Array:
  """A step count as float32 (int or float input; arrays allowed)."""
  return jnp.asarray(step).astype(jnp.float32)
