r"""WSM: warmup-stable-merge, a decay emulated by merging checkpoints.

Train at a constant rate and keep checkpoints ``theta_n, ..., theta_{n+k}``
spaced equally. With ``Delta_i`` the displacement of interval ``i``,
``theta_{n+j} = theta_n - eta sum_{i<=j} Delta_i``, so a merge with weights
``c_j >= 0``, ``sum c_j = 1`` is

.. math::

  \hat\theta = \sum_{j=0}^{k} c_j \theta_{n+j}
    = \theta_n - \eta \sum_{i=1}^{k} w_i \Delta_i,
  \qquad w_i = \sum_{j \ge i} c_j ,

the same (to first order: the gradients themselves are not re-evaluated) as
running the window with rate multipliers ``w_i``. Inverting for a decay shape
``psi`` sampled at interval ``i``: ``c_0 = 1 - w_1``,
``c_j = w_j - w_{j+1}``, ``c_k = w_k``. A linear decay gives the uniform
average of the last ``k`` checkpoints.

Optimizer state is not merged. Merging is done in fp32 (or wider).

References:
  Tian et al., *WSM: Decay-Free Learning Rate Schedule via Checkpoint
  Merging for LLM Pre-training*, 2025 (ICLR 2026).
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loc_opt.schedules._common import check_int
from loc_opt.schedules.wsd import decay_shape_fn

# Where psi is read inside interval i = 1..k of the window (fractions of k).
_SAMPLING_OFFSETS = {'left': 1.0, 'endpoint': 1.0, 'midpoint': 0.5,
                     'right': 0.0}


def wsm_coefficients(
    k: int, decay_shape: str = 'linear', sampling: str = 'endpoint',
) -> np.ndarray:
  r"""Merge weights ``c_0..c_k`` that emulate a decay over ``k`` intervals.

  ``w_i = psi(s_i)`` with ``s_i`` the position of interval ``i`` in the
  window:

  * ``'endpoint'`` (alias ``'left'``, the default): ``s_i = (i - 1) / k``,
    the start of the interval. With one checkpoint per step this is exact
    (for gradients that do not depend on the weights) against
    ``wsd_schedule(..., decay_steps=k)`` run over the same window, whose
    count ``T - k + i - 1`` uses ``psi((i - 1) / k)``. ``c_0 = 0`` for every
    shape, and a linear decay gives ``c_j = 1 / k``.
  * ``'midpoint'``: ``s_i = (i - 1/2) / k``.
  * ``'right'``: ``s_i = i / k``, the end of the interval; ``c_k = 0``.

  The WSM paper's own discretization is an open item (spec §6); the spec's
  §5 cosine "endpoint" vector is the ``'right'`` rule here, while its linear
  vector is ``'left'``.

  Args:
    k: the number of intervals (``k + 1`` checkpoints), >= 1.
    decay_shape: a key of ``loc_opt.schedules.DECAY_SHAPES``.
    sampling: ``'endpoint'``/``'left'``, ``'midpoint'`` or ``'right'``.

  Returns:
    A float64 array of ``k + 1`` non-negative weights summing to 1, oldest
    checkpoint first.

  Example:
    >>> wsm_coefficients(4).tolist()
    [0.0, 0.25, 0.25, 0.25, 0.25]
  """
  k = check_int(k, 'k', minimum=1)
  if sampling not in _SAMPLING_OFFSETS:
    raise ValueError(f'unknown sampling {sampling!r}; choose one of '
                     f'{sorted(_SAMPLING_OFFSETS)}')
  psi = decay_shape_fn(decay_shape)
  s = (np.arange(1, k + 1, dtype=np.float64) - _SAMPLING_OFFSETS[sampling]) / k
  w = np.asarray(psi(s, np), np.float64)
  c = np.concatenate([[1.0 - w[0]], w[:-1] - w[1:], [w[-1]]])
  c = np.where(np.abs(c) < 1e-15, 0.0, c)  # exact zeros, not -1e-17
  if np.any(c < 0):
    raise ValueError(f'decay_shape {decay_shape!r} is not non-increasing')
  return c


def wsm_checkpoint_steps(end_step: int, k: int, interval: int) -> list[int]:
  """The ``k + 1`` checkpoint steps of a merge window ending at ``end_step``.

  Returns ``[end - k * interval, ..., end - interval, end]``, matching the
  order of :func:`wsm_coefficients`. Checkpoints whose weight is 0 (the
  first one under ``'endpoint'`` sampling) need not be saved.
  """
  end_step = check_int(end_step, 'end_step')
  k = check_int(k, 'k', minimum=1)
  interval = check_int(interval, 'interval', minimum=1)
  first = end_step - k * interval
  if first < 0:
    raise ValueError(f'a window of k={k} intervals of {interval} steps does '
                     f'not fit before end_step={end_step}')
  return [first + j * interval for j in range(k + 1)]


def _acc_dtype(x) -> Any:
  return jnp.promote_types(jnp.asarray(x).dtype, jnp.float32)


def merge_params(param_trees: Sequence[Any], coefficients: Any) -> Any:
  """The weighted sum ``sum_j c_j theta_j`` of parameter trees.

  Floating leaves are summed in fp32 (or the leaf dtype if wider) and cast
  back to their dtype. Non-floating leaves must agree and are taken from
  the last tree. Jittable; coefficients may be traced.

  Args:
    param_trees: a sequence of trees with the same structure (checkpoints,
      oldest first).
    coefficients: one weight per tree, e.g. :func:`wsm_coefficients`.

  Returns:
    The merged tree, with the dtypes of ``param_trees[-1]``.

  Example:
    >>> merge_params([{'w': jnp.ones(2)}, {'w': jnp.zeros(2)}], [0.25, 0.75])
    {'w': Array([0.25, 0.25], dtype=float32)}
  """
  trees = list(param_trees)
  coefficients = jnp.asarray(coefficients)
  if coefficients.shape != (len(trees),):
    raise ValueError(f'got {len(trees)} parameter trees but coefficients of '
                     f'shape {coefficients.shape}')

  def merge_leaf(*leaves):
    last = jnp.asarray(leaves[-1])
    if not jnp.issubdtype(last.dtype, jnp.inexact):
      return last
    dtype = _acc_dtype(last)
    acc = sum(coefficients[j].astype(dtype) * jnp.asarray(x).astype(dtype)
              for j, x in enumerate(leaves))
    return acc.astype(last.dtype)

  return jax.tree.map(merge_leaf, *trees)


def accumulate_params(acc: Any | None, params: Any,
                      coefficient: jax.typing.ArrayLike) -> Any:
  """Streaming merge: ``acc + coefficient * params`` in fp32 (or wider).

  Keeps one extra copy instead of ``k + 1`` checkpoints when the window is
  known in advance. Start with ``acc=None``; after the last checkpoint cast
  back with ``optax.tree.cast_like(acc, params)``.
  """
  if acc is None:
    acc = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), _acc_dtype(p)),
                       params)
  return jax.tree.map(
      lambda a, p: a + jnp.asarray(coefficient, a.dtype) * jnp.asarray(
          p).astype(a.dtype), acc, params)
