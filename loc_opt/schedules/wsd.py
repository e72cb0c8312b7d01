r"""Warmup-stable-decay schedules: WSD, linear decay, and WSD-S.

A WSD schedule warms up linearly to a peak, holds it, and decays over the
last ``decay_steps`` steps with a shape ``psi`` that goes from 1 to 0 as the
decay progress ``s`` goes from 0 to 1:

.. math::

  \eta_t = \psi(s)\, \eta_{peak} + (1 - \psi(s))\, \eta_{end},
  \qquad s = (t - T_d) / D .

Counts follow Optax: ``t`` is the number of updates already taken, so the
first update uses ``t = 0``. The warmup reaches the peak exactly at
``t = warmup_steps``, the decay starts (still at the peak) at
``t = total_steps - decay_steps``, and ``t = total_steps`` gives exactly
``end_value``, as do all later counts. Negative counts give the value at 0.

References:
  Hu et al., *MiniCPM: Unveiling the Potential of Small Language Models with
  Scalable Training Strategies*, 2024.

  Hägele, Bakouch, Kosson, Ben Allal, Von Werra, Jaggi, *Scaling Laws and
  Compute-Optimal Training Beyond Fixed Training Durations*, 2024.

  Wen, Li, Wang, Hall, Liang, Ma, *Understanding Warmup-Stable-Decay Learning
  Rates: A River Valley Loss Landscape Perspective*, 2024.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loc_opt.schedules._common import check_int
from loc_opt.schedules._common import Schedule
from loc_opt.schedules._common import steps_from_fraction

# psi(s, xp): 1 at s = 0, 0 at s = 1 (exactly, in float32 too); xp is numpy
# or jax.numpy so the same shapes serve jitted schedules and host-side
# weights (WSM).
DecayShape = Callable[[Any, Any], Any]

DECAY_SHAPES: Mapping[str, DecayShape] = {
    'linear': lambda s, xp: 1.0 - s,
    'cosine': lambda s, xp: 0.5 * (1.0 + xp.cos(np.pi * s)),
    '1-sqrt': lambda s, xp: 1.0 - xp.sqrt(s),
    '1-square': lambda s, xp: 1.0 - s * s,
}


def decay_shape_fn(name: str, *, field: str = 'decay_shape') -> DecayShape:
  """The decay shape ``psi(s, xp)`` called ``name`` in :data:`DECAY_SHAPES`.

  ``'1-sqrt'`` is ``1 - sqrt(s)`` (Hägele et al., 2024), not Optax's
  ``polynomial_schedule(power=0.5)``, which is ``sqrt(1 - s)``.
  """
  if name not in DECAY_SHAPES:
    raise ValueError(f'unknown {field} {name!r}; choose one of '
                     f'{sorted(DECAY_SHAPES)}')
  return DECAY_SHAPES[name]


def _decay(peak_value, end_value, decay_steps: int, psi: DecayShape):
  """``r -> value`` over a decay of ``decay_steps`` steps from local step 0."""

  def schedule(r):
    s = jnp.clip(jnp.asarray(r, jnp.float32) / decay_steps, 0.0, 1.0)
    w = psi(s, jnp)
    return w * peak_value + (1.0 - w) * end_value

  return schedule


def _warmup_constant(peak_value, init_value, warmup_steps: int) -> Schedule:
  """Linear warmup from ``init_value`` to ``peak_value``, then constant."""
  constant = lambda step: jnp.full(jnp.shape(step), peak_value, jnp.float32)
  if warmup_steps == 0:
    return constant
  return optax.join_schedules(
      [optax.linear_schedule(init_value, peak_value, warmup_steps), constant],
      [warmup_steps])


def _nonnegative(step: jax.typing.ArrayLike) -> jax.Array:
  return jnp.maximum(jnp.asarray(step), 0)


def warmup_constant_schedule(
    peak_value: float, total_steps: int = 0, *,
    warmup_steps: int | float = 0, init_value: float = 0.0,
) -> Schedule:
  """Linear warmup to ``peak_value``, then constant (no decay).

  The main branch of WSD and WSM, and the usual schedule under
  schedule-free optimizers. ``total_steps`` only serves to read a fractional
  ``warmup_steps``.

  Example:
    >>> s = warmup_constant_schedule(1.0, warmup_steps=4)
    >>> jax.jit(s)(jnp.array([2, 4, 10**6])).tolist()
    [0.5, 1.0, 1.0]
  """
  warmup = steps_from_fraction(warmup_steps, total_steps,
                               field='warmup_steps')
  base = _warmup_constant(peak_value, init_value, warmup)
  return lambda step: base(_nonnegative(step))


def wsd_schedule(
    peak_value: float,
    total_steps: int,
    *,
    warmup_steps: int | float = 0,
    decay_steps: int | float,
    end_value: float = 0.0,
    init_value: float = 0.0,
    decay_shape: str = 'linear',
) -> Schedule:
  r"""Warmup-stable-decay (WSD): warmup, constant peak, then a short decay.

  .. math::

    \eta_t = \begin{cases}
      \eta_0 + (\eta_{peak} - \eta_0)\, t / W & t < W \
      \eta_{peak} & W \le t < T - D \
      \psi(s)\,\eta_{peak} + (1 - \psi(s))\,\eta_{end},
        \; s = (t - T + D) / D & T - D \le t \le T \
      \eta_{end} & t > T
    \end{cases}

  with ``psi`` one of ``'linear'`` ``1 - s``, ``'cosine'``
  ``(1 + cos(pi s)) / 2``, ``'1-sqrt'`` ``1 - sqrt(s)`` (best in Hägele et
  al.), ``'1-square'`` ``1 - s^2``. A decay of 10-20% of the run is usual;
  Hägele et al. find a 20% cooldown matches cosine. ``decay_steps=0`` gives
  warmup-then-constant.

  Args:
    peak_value: the stable learning rate.
    total_steps: ``T``, the count at which the decay ends.
    warmup_steps: ``W``, an int or a fraction of ``total_steps``.
    decay_steps: ``D``, an int or a fraction of ``total_steps``.
    end_value: the value at ``t >= T``.
    init_value: the value at ``t = 0`` when ``W > 0``.
    decay_shape: a key of :data:`DECAY_SHAPES`.

  Returns:
    A jittable ``step -> value`` schedule.

  Raises:
    ValueError: for negative lengths or ``W + D > T``.

  Example:
    >>> s = wsd_schedule(1.0, 100, warmup_steps=10, decay_steps=0.2)
    >>> jax.jit(s)(jnp.array([5, 10, 80, 90, 100])).tolist()
    [0.5, 1.0, 1.0, 0.5, 0.0]

  References:
    Hägele et al., *Scaling Laws and Compute-Optimal Training Beyond Fixed
    Training Durations*, 2024; Hu et al., *MiniCPM*, 2024.
  """
  total = check_int(total_steps, 'total_steps', minimum=1)
  warmup = steps_from_fraction(warmup_steps, total, field='warmup_steps')
  decay = steps_from_fraction(decay_steps, total, field='decay_steps')
  psi = decay_shape_fn(decay_shape)
  if warmup + decay > total:
    raise ValueError(f'warmup_steps={warmup} plus decay_steps={decay} exceed '
                     f'total_steps={total}')
  main = _warmup_constant(peak_value, init_value, warmup)
  if decay == 0:
    return lambda step: main(_nonnegative(step))
  joined = optax.join_schedules(
      [main, _decay(peak_value, end_value, decay, psi)], [total - decay])

  def schedule(step):
    step = _nonnegative(step)
    return jnp.where(step >= total, jnp.asarray(end_value, jnp.float32),
                     joined(step))

  return schedule


def linear_decay_schedule(
    peak_value: float,
    total_steps: int,
    *,
    warmup_steps: int | float = 0,
    init_value: float = 0.0,
    end_value: float = 0.0,
) -> Schedule:
  """Linear warmup, then linear decay to ``end_value`` over the rest.

  The worst-case-optimal schedule for the last iterate of SGD on convex
  Lipschitz problems (Defazio et al., 2023). It is :func:`wsd_schedule` with
  no stable phase; ``t = total_steps`` gives exactly ``end_value``.

  Example:
    >>> s = linear_decay_schedule(1.0, 10)
    >>> jax.jit(s)(jnp.array([0, 5, 10])).tolist()
    [1.0, 0.5, 0.0]

  References:
    Defazio, Cutkosky, Mehta, Mishchenko, *When, Why and How Much? Adaptive
    Learning Rate Scheduling by Refinement* (v2: *Optimal Linear Decay
    Learning Rate Schedules and Further Refinements*), 2023.
  """
  total = check_int(total_steps, 'total_steps', minimum=1)
  warmup = steps_from_fraction(warmup_steps, total, field='warmup_steps')
  if warmup >= total:
    raise ValueError(f'warmup_steps={warmup} must be below total_steps='
                     f'{total}')
  return wsd_schedule(peak_value, total, warmup_steps=warmup,
                      decay_steps=total - warmup, init_value=init_value,
                      end_value=end_value, decay_shape='linear')


def _check_points(decay_points: Sequence[int]) -> list[int]:
  points = [check_int(c, 'decay_points[]', minimum=1) for c in decay_points]
  if any(b <= a for a, b in zip(points, points[1:])):
    raise ValueError(f'decay_points must be strictly increasing, got '
                     f'{points}')
  return points


def _decay_length(decay_steps: int | float, segment: int, point: int) -> int:
  """The decay length for a segment; a float is a fraction of it."""
  if isinstance(decay_steps, float):
    if not 0.0 < decay_steps <= 1.0:
      raise ValueError(f'decay_steps as a fraction must lie in (0, 1], got '
                       f'{decay_steps}')
    return max(1, int(round(decay_steps * segment)))
  length = check_int(decay_steps, 'decay_steps', minimum=1)
  if length > segment:
    raise ValueError(f'decay_steps={length} does not fit before decay point '
                     f'{point} (segment of {segment} steps)')
  return length


def _windows(points, decay_steps, warmup) -> list[tuple[int, int]]:
  """``(start, stop)`` of each decay window ``[C_k - D_k, C_k)``."""
  windows, previous = [], 0
  for c in points:
    d = _decay_length(decay_steps, c - previous, c)
    if c - d < max(previous, warmup):
      raise ValueError(f'the decay window [{c - d}, {c}) overlaps the warmup '
                       f'(warmup_steps={warmup}) or the previous segment')
    windows.append((c - d, c))
    previous = c
  return windows


def wsds_schedule(
    peak_value: float,
    decay_points: Sequence[int],
    decay_steps: int | float,
    *,
    warmup_steps: int = 0,
    init_value: float = 0.0,
    end_value: float = 0.0,
    decay_shape: str = 'linear',
) -> Schedule:
  r"""WSD-S: one run that decays into every checkpoint and then resumes.

  After a warmup the rate stays at the peak except inside the decay windows
  ``[C_k - D_k, C_k)``, where it follows the WSD decay to ``end_value``. The
  model after ``C_k`` updates is the decayed checkpoint for budget ``C_k``;
  training continues from those decayed weights (and the optimizer state)
  with the rate back at the peak at count ``C_k``. After the last point the
  rate is ``end_value`` (the run is over), so with one point ``T`` this is
  :func:`wsd_schedule` with ``total_steps=T``.

  With ``decay_points=()`` this is the main branch of plain WSD (warmup then
  constant); decays then live in branches, see :func:`wsds_branch`.

  Args:
    peak_value: the stable learning rate.
    decay_points: increasing counts ``C_k`` at which decayed checkpoints are
      wanted (the compute budgets).
    decay_steps: ``D_k``: an int (the same for every window) or a fraction of
      each segment ``C_k - C_{k-1}`` (``C_0 = 0``). The paper's exact choice
      is not settled (spec §6); about 10% of each segment is the default to
      try.
    warmup_steps: linear warmup length (int).
    init_value: the value at count 0 when ``warmup_steps > 0``.
    end_value: the value each decay reaches at ``C_k``.
    decay_shape: a key of :data:`DECAY_SHAPES`.

  Returns:
    A jittable ``step -> value`` schedule.

  Example:
    >>> s = wsds_schedule(1.0, [10, 20], 4)
    >>> jax.jit(s)(jnp.array([5, 6, 8, 9, 10, 19, 20])).tolist()
    [1.0, 1.0, 0.5, 0.25, 1.0, 0.25, 0.0]

  References:
    Wen, Li, Wang, Hall, Liang, Ma, *Understanding Warmup-Stable-Decay
    Learning Rates: A River Valley Loss Landscape Perspective*, 2024.
  """
  warmup = check_int(warmup_steps, 'warmup_steps')
  points = _check_points(decay_points)
  windows = _windows(points, decay_steps, warmup)
  psi = decay_shape_fn(decay_shape)
  main = _warmup_constant(peak_value, init_value, warmup)
  decays = [_decay(peak_value, end_value, stop - start, psi)
            for start, stop in windows]

  def schedule(step):
    step = _nonnegative(step)
    value = main(step)
    for (start, stop), decay in zip(windows, decays):
      inside = (step >= start) & (step < stop)
      value = jnp.where(inside, decay(step - start), value)
    if points:
      value = jnp.where(step >= points[-1],
                        jnp.asarray(end_value, jnp.float32), value)
    return value

  return schedule


def wsds_branch(
    peak_value: float,
    decay_points: Sequence[int],
    decay_steps: int | float,
    budget: int,
    *,
    warmup_steps: int = 0,
    init_value: float = 0.0,
    end_value: float = 0.0,
    decay_shape: str = 'linear',
) -> tuple[int, Schedule]:
  """Where and how to branch a decay for ``budget`` off a WSD(-S) main run.

  The main run follows ``wsds_schedule(peak_value, decay_points,
  decay_steps, ...)``. A decayed model for a budget ``b`` that is not one of
  ``decay_points`` comes from a branch: restore the main run's checkpoint
  (weights and optimizer state) after ``start = b - D`` updates, rebuild the
  optimizer with the returned schedule, and take ``b - start`` updates. The
  schedule is in the main run's count numbering (it equals the main schedule
  before ``start``), so the restored optimizer count needs no shift. When
  ``b`` is one of ``decay_points`` the main run's checkpoint at ``b`` is
  already decayed: ``start == b`` and no branch steps are needed.

  With ``decay_points=()`` this is plain WSD with branched cooldowns (one
  stable run, one decay per budget; Hägele et al., 2024). A float
  ``decay_steps`` is a fraction of the budget's segment (from the last decay
  point before it, or 0).

  Args:
    peak_value: as in :func:`wsds_schedule`.
    decay_points: as in :func:`wsds_schedule`.
    decay_steps: as in :func:`wsds_schedule`; also the branch's decay length.
    budget: the count ``b`` at which the branch's decay ends.
    warmup_steps: as in :func:`wsds_schedule`.
    init_value: as in :func:`wsds_schedule`.
    end_value: as in :func:`wsds_schedule`.
    decay_shape: as in :func:`wsds_schedule`.

  Returns:
    ``(start_step, schedule)``: the main-run checkpoint (in updates taken) to
    restore, and the branch's ``step -> value`` schedule.

  The branch starts at or after the last decay point before ``b`` and
  before the next point's decay window, so its start checkpoint is always at
  the peak rate.

  Raises:
    ValueError: if the branch would start inside the warmup, if its decay
      does not fit after the previous decay point, or if ``budget`` is past
      the last decay point.

  Example:
    >>> start, s = wsds_branch(1.0, (), 0.2, 50)
    >>> start, jax.jit(s)(jnp.array([39, 45, 50])).tolist()
    (40, [1.0, 0.5, 0.0])
  """
  kwargs = dict(warmup_steps=warmup_steps, init_value=init_value,
                end_value=end_value, decay_shape=decay_shape)
  main = wsds_schedule(peak_value, decay_points, decay_steps, **kwargs)
  budget = check_int(budget, 'budget', minimum=1)
  points = list(decay_points)
  if budget in points:
    return budget, main
  if points and budget > points[-1]:
    raise ValueError(f'budget={budget} is past the last decay point '
                     f'{points[-1]}: extend decay_points instead')
  previous = max([c for c in points if c < budget], default=0)
  length = _decay_length(decay_steps, budget - previous, budget)
  start = budget - length
  if start < warmup_steps:
    raise ValueError(f'branch for budget={budget} would start at {start}, '
                     f'inside the warmup (warmup_steps={warmup_steps})')
  decay = _decay(peak_value, end_value, length,
                 decay_shape_fn(decay_shape))

  def schedule(step):
    step = _nonnegative(step)
    value = jnp.where(step < start, main(step), decay(step - start))
    return jnp.where(step >= budget, jnp.asarray(end_value, jnp.float32),
                     value)

  return start, schedule
