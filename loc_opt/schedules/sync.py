r"""Sync-period schedules ``count -> H`` for local-update methods.

``loc_opt.diloco(inner, sync_every=schedule)`` reads ``H = schedule(count)``
on every inner step and syncs when ``steps_since_sync + 1 >= H``. The
schedules here are pure, jittable and return int32, so the compiled step
does not change when ``H`` does.

References:
  Gu, Lyu, Arora, Zhang, Huang, *A Quadratic Synchronization Rule for
  Distributed Deep Learning*, 2023 (ICLR 2024).
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loc_opt.schedules._common import check_int
from loc_opt.schedules._common import Schedule

SyncSchedule = Callable[[jax.typing.ArrayLike], jax.Array]

_NO_CAP = 2**30  # "never sync again" without overflowing int32


def constant_sync_schedule(period: int) -> SyncSchedule:
  """``H(count) = period``."""
  period = check_int(period, 'period', minimum=1)
  return lambda count: jnp.full(jnp.shape(count), period, jnp.int32)


def step_sync_schedule(
    boundaries_and_periods: Mapping[Any, int] | Sequence[tuple[int, int]],
) -> SyncSchedule:
  """Piecewise-constant ``H``: ``{first_count: period, ...}``.

  Args:
    boundaries_and_periods: a mapping or a sequence of ``(count, period)``
      pairs; counts may be strings of ints (config dict keys) and must
      include 0. ``H(count)`` is the period of the largest boundary
      ``<= count``.

  Returns:
    A jittable ``count -> H`` (int32).

  Example:
    >>> h = step_sync_schedule({0: 4, 100: 16})
    >>> jax.jit(h)(jnp.array([99, 100])).tolist()
    [4, 16]
  """
  items = (boundaries_and_periods.items()
           if isinstance(boundaries_and_periods, Mapping)
           else boundaries_and_periods)
  try:
    pairs = sorted((int(b), p) for b, p in items)
  except (TypeError, ValueError) as e:
    raise ValueError(f'boundaries_and_periods must map int counts to '
                     f'periods: {e}') from e
  if not pairs or pairs[0][0] != 0:
    raise ValueError(f'boundaries_and_periods must start at count 0, got '
                     f'{[b for b, _ in pairs]}')
  if len({b for b, _ in pairs}) != len(pairs):
    raise ValueError('boundaries_and_periods has a repeated count')
  bounds = jnp.asarray([b for b, _ in pairs], jnp.int32)
  periods = jnp.asarray(
      [check_int(p, 'period', minimum=1) for _, p in pairs], jnp.int32)

  def schedule(count):
    i = jnp.searchsorted(bounds, jnp.asarray(count, jnp.int32), side='right')
    return periods[jnp.maximum(i - 1, 0)]

  return schedule


def _qsr_rule(base_period, alpha, lr_schedule, warmup_steps, cap):
  """``H = clip(floor((alpha / lr)^2), base, cap)``; ``base`` in warmup."""

  def rule(count):
    count = jnp.asarray(count)
    lr = jnp.asarray(lr_schedule(count), jnp.float32)
    positive = lr > 0
    ratio = alpha / jnp.where(positive, lr, 1.0)
    h = jnp.where(positive, jnp.floor(jnp.minimum(ratio * ratio, cap)), cap)
    h = jnp.clip(h, base_period, cap).astype(jnp.int32)
    return jnp.where(count < warmup_steps, jnp.int32(base_period), h)

  return rule


def qsr_sync_schedule(
    base_period: int,
    alpha: float,
    lr_schedule: Schedule,
    *,
    max_period: int | None = None,
    warmup_steps: int = 0,
    total_steps: int | None = None,
) -> SyncSchedule:
  r"""Quadratic Synchronization Rule: sync less often as the rate decays.

  .. math::

    H_t = \max\left(H_{base}, \left\lfloor (\alpha / \eta_t)^2
      \right\rfloor\right),

  capped at ``max_period``; ``H_base`` during the first ``warmup_steps``
  counts and wherever ``eta_t <= 0`` gives the cap (no more syncs). With
  ``alpha = 0`` it is the constant ``H_base``. Worked example (the paper's
  ViT recipe, ``alpha = 0.0175``, ``H_base = 4``): ``eta = 0.008`` gives 4,
  ``0.004`` gives 19, ``0.001`` gives 306.

  Without ``total_steps`` the rule is read at every count, so within a round
  ``H`` can grow as the rate decays (``diloco`` syncs at the first count
  where the round's length reaches the current ``H``). With ``total_steps``
  the rounds are laid out on the host as in the reference code: ``H`` is
  read at the first count of each round, frozen for that round, and capped
  at the steps left; the returned schedule then gives each count its
  round's ``H``, so ``diloco`` syncs exactly at the reference's steps.

  Args:
    base_period: ``H_base >= 1``.
    alpha: ``alpha >= 0``, the QSR constant (0.0175 for ViT-B AdamW in the
      paper).
    lr_schedule: the inner learning-rate schedule ``count -> eta``.
    max_period: an upper bound on ``H`` (default: none).
    warmup_steps: counts below this use ``H_base`` (the reference does so
      during the rate warmup).
    total_steps: lay the rounds out for a run of this many steps (then
      ``lr_schedule`` is evaluated once on all counts, as an array).

  Returns:
    A jittable ``count -> H`` (int32).

  Example:
    >>> import optax
    >>> h = qsr_sync_schedule(4, 0.0175, optax.constant_schedule(0.004))
    >>> jax.jit(h)(0).item()
    19

  References:
    Gu, Lyu, Arora, Zhang, Huang, *A Quadratic Synchronization Rule for
    Distributed Deep Learning*, 2023.
  """
  base = check_int(base_period, 'base_period', minimum=1)
  warmup = check_int(warmup_steps, 'warmup_steps')
  if not alpha >= 0:
    raise ValueError(f'alpha must be >= 0, got {alpha}')
  cap = _NO_CAP
  if max_period is not None:
    cap = check_int(max_period, 'max_period', minimum=base)
  if not callable(lr_schedule):
    raise TypeError(f'lr_schedule must be a schedule, got {lr_schedule!r}')
  if float(alpha) == 0.0:
    return constant_sync_schedule(base)
  rule = _qsr_rule(base, float(alpha), lr_schedule, warmup, cap)
  if total_steps is None:
    return rule
  total = check_int(total_steps, 'total_steps', minimum=1)
  per_count = np.asarray(jax.jit(rule)(jnp.arange(total)))
  starts, periods, t = [], [], 0
  while t < total:
    h = min(int(per_count[t]), total - t)
    starts.append(t)
    periods.append(h)
    t += h
  starts = jnp.asarray(starts, jnp.int32)
  periods = jnp.asarray(periods, jnp.int32)

  def schedule(count):
    i = jnp.searchsorted(starts, jnp.asarray(count, jnp.int32), side='right')
    return periods[jnp.maximum(i - 1, 0)]

  return schedule


SYNC_SCHEDULES: Mapping[str, Callable[..., SyncSchedule]] = {
    'constant': constant_sync_schedule,
    'step': step_sync_schedule,
    'qsr': qsr_sync_schedule,
}


def make_sync_schedule(name: str, **kwargs: Any) -> SyncSchedule:
  """Looks ``name`` up in :data:`SYNC_SCHEDULES` and builds the schedule.

  Example:
    >>> make_sync_schedule('constant', period=8)(123).item()
    8
  """
  if name not in SYNC_SCHEDULES:
    raise ValueError(f'unknown sync schedule {name!r} (field '
                     f'outer.sync_schedule); choose one of '
                     f'{sorted(SYNC_SCHEDULES)}')
  try:
    return SYNC_SCHEDULES[name](**kwargs)
  except TypeError as e:
    raise ValueError(f'bad arguments for outer.sync_schedule={name!r}: '
                     f'{e}') from e
