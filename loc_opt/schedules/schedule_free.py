r"""Schedule-free optimizers by name, with a warmup, and their eval weights.

A thin layer over ``optax.contrib.schedule_free``: gradients are taken at
``y = (1 - b1) z + b1 x``, the base (momentum-free) optimizer steps ``z``,
and ``x`` is a running average of ``z`` weighted by ``max_{i<=t} lr_i^p``
(``p = weight_lr_power``). Evaluate at ``x``, recovered from the stored
``y`` and ``z`` by :func:`schedule_free_eval_params`.

Two details differ from calling ``optax.contrib.schedule_free_sgd/adamw``
with ``warmup_steps``:

* The warmup follows the reference implementation: the update at count
  ``t`` (0-based) uses ``lr * min(1, (t + 1) / W)``, so the first update is
  not wasted at rate 0.
* The base optimizer and the averaging weights read the same rate on every
  step. (``optax.contrib.schedule_free`` calls its schedule with a count
  that starts at 1 while the base optimizer's starts at 0; here the schedule
  handed to the wrapper is shifted back by one.)

References:
  Defazio, Yang, Mehta, Mishchenko, Khaled, Cutkosky, *The Road Less
  Scheduled*, 2024 (NeurIPS 2024).
"""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from loc_opt.schedules._common import Schedule


def schedule_free_warmup(peak_value: jax.typing.ArrayLike,
                         warmup_steps: jax.typing.ArrayLike = 0) -> Schedule:
  """The reference warmup ``t -> peak * min(1, (t + 1) / W)`` (0-based t).

  ``W = 0`` means no warmup. Traced ``peak_value``/``warmup_steps`` are fine
  (``optax.inject_hyperparams``).
  """

  def schedule(step):
    t = jnp.maximum(jnp.asarray(step, jnp.float32), 0.0)
    ramp = jnp.minimum(1.0, (t + 1.0) / jnp.asarray(warmup_steps,
                                                     jnp.float32))
    return peak_value * ramp

  return schedule


def _wrap(base_fn, learning_rate, warmup_steps, b1, weight_lr_power,
          state_dtype) -> optax.GradientTransformationExtraArgs:
  """``optax.contrib.schedule_free`` over ``base_fn(schedule)``, with the
  base and the averaging weights reading the same rate at every step."""
  if callable(learning_rate):
    if not (isinstance(warmup_steps, int) and warmup_steps == 0):
      raise ValueError('give either a learning-rate schedule or '
                       'warmup_steps, not both')
    schedule = learning_rate
  else:
    schedule = schedule_free_warmup(learning_rate, warmup_steps)
  return optax.contrib.schedule_free(
      base_fn(schedule), learning_rate=lambda count: schedule(count - 1),
      b1=b1, weight_lr_power=weight_lr_power, state_dtype=state_dtype)


def schedule_free_sgd(
    learning_rate: jax.typing.ArrayLike | Schedule = 1.0,
    warmup_steps: jax.typing.ArrayLike = 0,
    b1: jax.typing.ArrayLike = 0.9,
    weight_decay: jax.typing.ArrayLike = 0.0,
    weight_lr_power: jax.typing.ArrayLike = 2.0,
    *,
    state_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Schedule-free SGD with the reference warmup.

  Args:
    learning_rate: the peak rate, or a schedule (then ``warmup_steps`` must
      be 0, and the schedule should hold constant after its warmup: a decay
      freezes the averaging weights). 10-50x a scheduled SGD's rate.
    warmup_steps: ``W``; the update at count ``t`` uses
      ``lr * min(1, (t + 1) / W)`` (0: no warmup).
    b1: the interpolation ``beta`` (> 0).
    weight_decay: decay of ``y``, scaled by the rate.
    weight_lr_power: ``p`` in the averaging weights ``max_lr^p``.
    state_dtype: dtype of the stored ``z`` (default: the params').

  Returns:
    An ``optax.GradientTransformationExtraArgs``; evaluate at
    :func:`schedule_free_eval_params`.
  """
  base = lambda lr: optax.chain(optax.add_decayed_weights(weight_decay),
                                optax.sgd(lr))
  return _wrap(base, learning_rate, warmup_steps, b1, weight_lr_power,
               state_dtype)


def schedule_free_adamw(
    learning_rate: jax.typing.ArrayLike | Schedule = 0.0025,
    warmup_steps: jax.typing.ArrayLike = 0,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    weight_decay: jax.typing.ArrayLike = 0.0,
    weight_lr_power: jax.typing.ArrayLike = 2.0,
    *,
    state_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Schedule-free AdamW with the reference warmup.

  The base is Adam without a first moment (bias-corrected RMS scaling,
  ``eps`` outside the root), then decoupled weight decay at ``y``, scaled by
  the rate. Arguments as in :func:`schedule_free_sgd`, plus ``b2`` and
  ``eps``; the paper's rate is 1-10x a scheduled AdamW's.

  Example:
    >>> tx = schedule_free_adamw(2.5e-3, warmup_steps=100, weight_decay=0.05)
  """
  base = lambda lr: optax.chain(
      optax.scale_by_rms(decay=b2, eps=eps, eps_in_sqrt=False,
                         bias_correction=True),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(lr))
  return _wrap(base, learning_rate, warmup_steps, b1, weight_lr_power,
               state_dtype)


# Factories ``(learning_rate, **hyperparams) -> transform`` with explicit
# signatures, so ``optax.inject_hyperparams`` (and an optimizer registry that
# uses it) can inject every numeric argument.
SCHEDULE_FREE_OPTIMIZERS: Mapping[
    str, Callable[..., optax.GradientTransformationExtraArgs]] = {
        'sgd': schedule_free_sgd,
        'adamw': schedule_free_adamw,
    }


def schedule_free_optimizer(
    name: str, learning_rate: jax.typing.ArrayLike | Schedule,
    **kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
  """Builds the schedule-free optimizer ``name`` (``'sgd'`` or ``'adamw'``).

  Args:
    name: a key of :data:`SCHEDULE_FREE_OPTIMIZERS`.
    learning_rate: the peak rate or a schedule.
    **kwargs: the factory's other arguments (``warmup_steps``, ``b1``,
      ``weight_decay``, ...).

  Returns:
    The transform; its state contains an ``optax.contrib.ScheduleFreeState``.
  """
  if name not in SCHEDULE_FREE_OPTIMIZERS:
    raise ValueError(f'unknown schedule-free optimizer {name!r}; choose one '
                     f'of {sorted(SCHEDULE_FREE_OPTIMIZERS)}')
  try:
    return SCHEDULE_FREE_OPTIMIZERS[name](learning_rate, **kwargs)
  except TypeError as e:
    raise ValueError(f'bad arguments for schedule-free {name!r}: {e}') from e


def _is_sf_state(x) -> bool:
  return isinstance(x, optax.contrib.ScheduleFreeState)


def find_schedule_free_state(
    state: Any) -> optax.contrib.ScheduleFreeState:
  """The one ``ScheduleFreeState`` nested anywhere in an optimizer state.

  Looks through chains, ``inject_hyperparams``, ``MultiSteps`` and wrappers
  such as ``loc_opt.diloco`` (whose ``inner_state`` holds it).

  Raises:
    ValueError: if there is none, or more than one.
  """
  found = [x for x in jax.tree.leaves(state, is_leaf=_is_sf_state)
           if _is_sf_state(x)]
  if len(found) != 1:
    raise ValueError(f'expected one ScheduleFreeState in the optimizer state, '
                     f'found {len(found)}')
  return found[0]


def schedule_free_eval_params(state: Any, params: optax.Params) -> Any:
  """The averaged weights ``x = (y - (1 - b1) z) / b1`` to evaluate at.

  Like ``optax.contrib.schedule_free_eval_params`` but ``state`` may be any
  optimizer state that contains the schedule-free state (see
  :func:`find_schedule_free_state`); results keep the params' dtypes.
  Unstable for small ``b1``.
  """
  sf = find_schedule_free_state(state)
  x = optax.contrib.schedule_free_eval_params(sf, params)
  return jax.tree.map(lambda a, p: a.astype(jnp.asarray(p).dtype), x, params)
