r"""Injected gradient spikes: a stress test for spike-aware inner optimizers.

:func:`inject_gradient_spikes` multiplies the gradient by ``scale`` on a
fixed set of update counts and passes it through unchanged otherwise. Placed
first in the inner chain (before global-norm clipping and the optimizer), it
imitates the rare huge gradients that SPAM and Stable-SPAM are built to
absorb. :func:`spike_steps` draws those counts from a seed.

The trainer builds it from the config fields ``optimizer.spike_num``,
``optimizer.spike_scale``, ``optimizer.spike_seed`` and
``optimizer.spike_window`` (:func:`spikes_from_config`); ``spike_num = 0``
(the default) leaves the chain untouched. Note that ``optimizer.grad_clip_norm``
clips the spiked gradient back to the clip norm, which hides most of the
spike from the optimizer: spike experiments turn that clip off.

References:
  Huang, Zhu, Jin, Liu, Wang, Liu, *SPAM: Spike-Aware Adam with Momentum
  Reset for Stable LLM Training*, 2025 (ICLR 2025).
"""

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax


class SpikeState(NamedTuple):
  """State of :func:`inject_gradient_spikes`.

  Attributes:
    count: int32 scalar, updates seen (the Optax count of the next update).
    hits: int32 scalar, spikes injected so far (a diagnostic for the loop).
  """

  count: jax.Array
  hits: jax.Array


def inject_gradient_spikes(
    steps: Sequence[int], scale: jax.typing.ArrayLike = 1000.0,
) -> optax.GradientTransformation:
  r"""Multiplies the updates by ``scale`` at the counts in ``steps``.

  .. math::

    u_t = \begin{cases} s\, g_t & t \in S \\ g_t & \text{otherwise}
    \end{cases}

  with ``t`` the number of updates already taken (0 on the first update), as
  in Optax schedules.

  Args:
    steps: the counts ``S`` to spike (non-negative ints; duplicates are
      ignored).
    scale: the spike factor ``s``.

  Returns:
    An ``optax.GradientTransformation`` whose state counts the updates and
    the spikes injected.

  Example:
    >>> tx = optax.chain(inject_gradient_spikes([3, 10], 1000.),
    ...                  optax.adamw(1e-3))
  """
  spiked = sorted({int(s) for s in steps})
  if any(s < 0 for s in spiked):
    raise ValueError(f'spike steps must be >= 0, got {spiked}')
  table = jnp.asarray(spiked if spiked else [-1], jnp.int32)

  def init_fn(params):
    del params
    zero = jnp.zeros([], jnp.int32)
    return SpikeState(count=zero, hits=zero)

  def update_fn(updates, state, params=None):
    del params
    hit = jnp.any(table == state.count)
    factor = jnp.where(hit, jnp.asarray(scale, jnp.float32), 1.0)
    updates = jax.tree.map(lambda g: (g * factor).astype(g.dtype), updates)
    return updates, SpikeState(
        count=optax.safe_increment(state.count),
        hits=state.hits + hit.astype(jnp.int32))

  return optax.GradientTransformation(init_fn, update_fn)


def spike_steps(num_steps: int, num_spikes: int, *, seed: int = 0,
                window: tuple[float, float] = (0.2, 0.8)) -> list[int]:
  """Draws ``num_spikes`` well-separated spike counts from a seed.

  The window ``[lo * num_steps, hi * num_steps)`` is cut into
  ``num_spikes`` equal bins and one count is drawn uniformly from the middle
  half of each bin, so consecutive spikes are at least half a bin apart and
  a spike's aftermath can be measured before the next one.

  Args:
    num_steps: the run's length.
    num_spikes: how many spikes (>= 0).
    seed: the seed (``numpy.random.default_rng``).
    window: ``(lo, hi)``, fractions of the run with ``0 <= lo < hi <= 1``.

  Returns:
    The sorted counts.

  Raises:
    ValueError: if the window holds fewer than ``2 * num_spikes`` steps.
  """
  lo, hi = window
  if not 0.0 <= lo < hi <= 1.0:
    raise ValueError(f'spike window must satisfy 0 <= lo < hi <= 1, got '
                     f'{tuple(window)}')
  if num_spikes == 0:
    return []
  first, stop = int(np.ceil(lo * num_steps)), int(np.floor(hi * num_steps))
  if stop - first < 2 * num_spikes:
    raise ValueError(f'{num_spikes} spikes do not fit well apart in steps '
                     f'[{first}, {stop}) of a {num_steps}-step run')
  rng = np.random.default_rng(seed)
  edges = np.linspace(first, stop, num_spikes + 1)
  out = []
  for a, b in zip(edges[:-1], edges[1:]):
    quarter = (b - a) / 4
    low, high = int(np.ceil(a + quarter)), int(np.floor(b - quarter))
    high = max(high, low + 1)
    out.append(int(rng.integers(low, high)))
  return sorted(out)


def _check_count(value, field: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
      or value < 0:
    raise ValueError(f'{field} must be an int >= 0, got {value!r}')
  return int(value)


def spike_kwargs(optimizer: ml_collections.ConfigDict
                 ) -> dict[Any, dict[str, Any]]:
  """``{library function: arguments}`` from the spike fields an
  ``optimizer`` section sets (``spike_seed``, ``spike_window`` for
  :func:`spike_steps`, ``spike_scale`` for :func:`inject_gradient_spikes`);
  absent fields take the functions' defaults.

  Raises:
    ValueError: naming the bad field.
  """
  steps, inject = {}, {}
  if 'spike_seed' in optimizer:
    steps['seed'] = _check_count(optimizer.spike_seed, 'optimizer.spike_seed')
  if 'spike_window' in optimizer:
    steps['window'] = tuple(optimizer.spike_window)
    if len(steps['window']) != 2:
      raise ValueError(f'optimizer.spike_window must be (lo, hi), got '
                       f'{steps["window"]}')
  if 'spike_scale' in optimizer:
    scale = optimizer.spike_scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
        or not np.isfinite(scale) or scale <= 0:
      raise ValueError(f'optimizer.spike_scale must be a finite number > 0, '
                       f'got {scale!r}')
    inject['scale'] = float(scale)
  return {spike_steps: steps, inject_gradient_spikes: inject}


def spikes_from_config(
    optimizer: ml_collections.ConfigDict, num_steps: int,
) -> tuple[optax.GradientTransformation | None, list[int]]:
  """The spike transform an ``optimizer`` config section asks for.

  Fields: ``spike_num`` (0 or absent: off) and those of
  :func:`spike_kwargs`.

  Returns:
    ``(transform or None, spike counts)``.

  Raises:
    ValueError: naming the bad field.
  """
  num = _check_count(optimizer.get('spike_num', 0), 'optimizer.spike_num')
  if num == 0:
    return None, []
  kwargs = spike_kwargs(optimizer)
  try:
    steps = spike_steps(num_steps, num, **kwargs[spike_steps])
  except ValueError as e:
    raise ValueError(f'optimizer.spike_num / optimizer.spike_window: {e}') \
        from e
  return inject_gradient_spikes(steps, **kwargs[inject_gradient_spikes]), steps
