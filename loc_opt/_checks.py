"""Argument checks shared by every module of loc_opt.

One place for the checks that transforms, schedules and codecs run on their
static arguments, so that the same mistake gets the same message everywhere.
Each check returns the value it accepted (converted to a Python scalar where
that is unambiguous) or raises a ``ValueError`` that names the argument
(:func:`static` raises the type its caller asks for).

This module is at the bottom of the package: it imports only NumPy and JAX.
"""

from typing import Any

import jax
import numpy as np


def _is_traced(value: Any) -> bool:
  return isinstance(value, jax.core.Tracer)


def positive_int(value: Any, name: str, *, arrays: bool = False) -> int:
  """``value`` as a Python int if it is a positive integer.

  Args:
    value: the argument.
    name: its name, for the message.
    arrays: also accept a concrete 0-d integer array (e.g. a hyperparameter
      that went through ``optax.inject_hyperparams``).

  Raises:
    ValueError: ``value`` is a bool, not an integer, or not positive.
  """
  if isinstance(value, bool) or _is_traced(value):
    raise ValueError(f'{name} must be a positive int, got {value!r}')
  if isinstance(value, int):
    number = value
  elif arrays:
    array = np.asarray(value)
    if array.ndim or not np.issubdtype(array.dtype, np.integer):
      raise ValueError(f'{name} must be a positive int, got {value!r}')
    number = int(array)
  else:
    raise ValueError(f'{name} must be a positive int, got {value!r}')
  if number <= 0:
    raise ValueError(f'{name} must be a positive int, got {number}')
  return number


def nonnegative_int(value: Any, name: str) -> int:
  """``value`` if it is a Python int ``>= 0``, else a ``ValueError``."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f'{name} must be a non-negative int, got {value!r}')
  return value


def positive_float(value: Any, name: str) -> float:
  """``value`` as a float if it is finite and ``> 0``."""
  number = _real(value, name)
  if not number > 0:
    raise ValueError(f'{name} must be positive, got {value!r}')
  return number


def nonnegative_float(value: Any, name: str) -> float:
  """``value`` as a float if it is finite and ``>= 0``."""
  number = _real(value, name)
  if not number >= 0:
    raise ValueError(f'{name} must be >= 0, got {value!r}')
  return number


def in_interval(value: Any, name: str, low: float, high: float, *,
                closed: str = 'both') -> float:
  """``value`` as a float if it lies in the interval from ``low`` to ``high``.

  Args:
    value: the argument.
    name: its name, for the message.
    low: the lower end.
    high: the upper end.
    closed: which ends belong to the interval: ``'both'``, ``'left'``,
      ``'right'`` or ``'neither'``.
  """
  number = _real(value, name)
  low_ok = number >= low if closed in ('both', 'left') else number > low
  high_ok = number <= high if closed in ('both', 'right') else number < high
  if not (low_ok and high_ok):
    left = '[' if closed in ('both', 'left') else '('
    right = ']' if closed in ('both', 'right') else ')'
    raise ValueError(
        f'{name} must be in {left}{low}, {high}{right}, got {value!r}')
  return number


def one_of(value: Any, name: str, choices: Any) -> Any:
  """``value`` if it is one of ``choices``, else a ``ValueError`` listing
  them."""
  choices = tuple(choices)
  if value not in choices:
    listed = ', '.join(sorted(map(repr, choices)))
    raise ValueError(f'{name} must be one of {listed}, got {value!r}')
  return value


def static(value: Any, name: str, *,
           error: type[Exception] = ValueError) -> Any:
  """``value`` if it is not traced, for an argument that sets a shape.

  Args:
    value: the argument.
    name: its name, for the message.
    error: the exception type to raise.

  Raises:
    ``error``: ``value`` is traced, e.g. a hyperparameter that
    ``optax.inject_hyperparams`` injected; the message names the fix,
    ``static_args=(name,)``.
  """
  if _is_traced(value):
    raise error(f'{name} sets a shape and cannot be traced; with '
                f'optax.inject_hyperparams pass static_args=({name!r},)')
  return value


def is_traced(value: Any) -> bool:
  """Whether ``value`` is traced (e.g. a hyperparameter under
  ``optax.inject_hyperparams`` inside ``jit``): checks of concrete values
  skip it, as its value is not known."""
  return _is_traced(value)


def positive_or_inf(value: Any, name: str) -> float:
  """``value`` as a float if it is ``> 0``, ``inf`` included (e.g. a
  threshold that never binds)."""
  if isinstance(value, bool) or _is_traced(value):
    raise ValueError(f'{name} must be a positive number, got {value!r}')
  try:
    number = float(value)
  except (TypeError, ValueError):
    raise ValueError(
        f'{name} must be a positive number, got {value!r}') from None
  if not number > 0:
    raise ValueError(f'{name} must be positive, got {value!r}')
  return number


def _real(value: Any, name: str) -> float:
  if isinstance(value, bool) or _is_traced(value):
    raise ValueError(f'{name} must be a real number, got {value!r}')
  try:
    number = float(value)
  except (TypeError, ValueError):
    raise ValueError(f'{name} must be a real number, got {value!r}') from None
  if not np.isfinite(number):
    raise ValueError(f'{name} must be finite, got {value!r}')
  return number


QUICKSTART = 'docs/quickstart.md'


def axis_bound(axis_name: str, who: str = 'this transform') -> str:
  """Returns ``axis_name`` if it is a bound mapped axis where this traces.

  Raises a ``NameError`` that says what to wrap otherwise: a transform that
  averages over workers (``axis_name='worker'`` by default) called in a
  plain ``jax.jit`` loop, outside any map over workers.
  """
  try:
    jax.lax.axis_size(axis_name)
  except NameError:
    raise NameError(
        f'{who} averages over the worker axis {axis_name!r}, which is not '
        'bound here: the update ran outside a map over workers. Wrap the '
        'per-worker train step in loc_opt.parallel.vmap_workers(step) (M '
        'simulated workers on one device; stack per-worker state and '
        'batches on a leading axis of size M) or in '
        'loc_opt.parallel.shard_map_workers(step, mesh) (a mesh with a '
        f'{axis_name!r} axis), or pass axis_name=None for a single worker. '
        f'Recipes for jit, NNX, Linen and sharded loops: {QUICKSTART}.'
    ) from None
  return axis_name


def transformation(value: Any, name: str, *, optional: bool = False) -> Any:
  """``value`` if it is an Optax gradient transformation (it has ``init``
  and ``update``; ``None`` too where ``optional``).

  Raises:
    TypeError: naming ``name``, with what to do for the usual mistakes (an
      optimizer factory not called, a learning rate in its place).
  """
  if value is None and optional:
    return value
  if (callable(getattr(value, 'init', None))
      and callable(getattr(value, 'update', None))):
    return value
  hint = ''
  if callable(value):
    hint = ('; it is a function: call it, e.g. optax.sgd(0.1) rather than '
            'optax.sgd')
  elif isinstance(value, (int, float)) and not isinstance(value, bool):
    hint = ('; a learning rate goes inside one, e.g. '
            'optax.sgd(0.7, momentum=0.9, nesterov=True)')
  raise TypeError(f'{name} must be an Optax GradientTransformation (with '
                  f'init and update), got {value!r}{hint}')
