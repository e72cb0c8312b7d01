"""Delayed Nesterov: the parameter server's outer optimizer of async local SGD.

Each push (a worker's pseudo-gradient) is applied at once with momentum-free
SGD scaled by ``1 / N``; the momentum is updated and applied only once every
``N`` pushes, from the average of those pushes, so stale pushes do not
compound in the momentum. With ``N = 1`` and ``c = 0`` it is SGD with
Nesterov momentum; over ``N`` pushes with ``c = 0`` the total move is one
Nesterov step on their average.

References:
  Liu et al., *Asynchronous Local-SGD Training for Language Modeling*,
  2024. https://arxiv.org/abs/2401.09135
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loc_opt import _checks


class DelayedNesterovState(NamedTuple):
  """State of :func:`scale_by_delayed_nesterov` (the server's outer state).

  Attributes:
    momentum: the momentum ``m`` (tree like the params; ``state_dtype`` or
      the params' dtypes), updated once every ``buffer_size`` pushes.
    accumulator: the sum ``A`` of the pushes since the last momentum update
      (tree like the params, same dtypes as ``momentum``).
    count: int32 scalar, pushes received.
  """

  momentum: optax.Updates
  accumulator: optax.Updates
  count: jax.Array


def _check_delayed_nesterov(momentum, buffer_size, activation) -> None:
  """Validates the concrete hyperparameters of Delayed Nesterov (traced
  ones, from ``optax.inject_hyperparams``, are not checked)."""
  n = None
  if not _checks.is_traced(buffer_size):
    n = _checks.positive_int(buffer_size, 'buffer_size', arrays=True)
  if not _checks.is_traced(momentum):
    _checks.in_interval(momentum, 'momentum', 0, 1, closed='left')
  if not _checks.is_traced(activation):
    upper = 1.0 / n if n is not None else 1.0
    if not 0.0 <= float(activation) <= upper:
      raise ValueError(
          f'activation must be in [0, 1 / buffer_size] = [0, {upper:g}], '
          f'got {float(activation)}')


def scale_by_delayed_nesterov(
    momentum: jax.typing.ArrayLike = 0.9,
    buffer_size: jax.typing.ArrayLike = 1,
    activation: jax.typing.ArrayLike = 0.0,
    *,
    state_dtype: Any = None,
) -> optax.GradientTransformation:
  r"""The direction of Delayed Nesterov, one push per update.

  With pushes :math:`g`, accumulator :math:`A`, push count :math:`t`,
  :math:`N` = ``buffer_size``, :math:`\beta` = ``momentum`` and
  :math:`c` = ``activation``:

  .. math::

    A &\leftarrow A + g \\
    \text{if } (t + 1) \bmod N = 0:\quad m &\leftarrow \beta m + A / N,\quad
      d = (1 - cN + c)\,\beta m + g / N,\quad A \leftarrow 0 \\
    \text{else}:\quad d &= c\,\beta m + g / N \\
    t &\leftarrow t + 1

  and the emitted update is :math:`d` (scale it by :math:`-\eta`). Over
  ``N`` pushes the momentum enters with total weight 1; with ``c = 0`` the
  total move of ``N`` pushes is one Nesterov step on their average, and
  ``N = 1, c = 0`` is ``optax.sgd(1, momentum, nesterov=True)``'s direction.

  Args:
    momentum: the momentum coefficient :math:`\beta` in ``[0, 1)``.
    buffer_size: :math:`N`, pushes per momentum update (a positive int).
    activation: :math:`c` in ``[0, 1/N]``, the share of the momentum applied
      on every push in between (``0``: momentum only every ``N`` pushes).
    state_dtype: dtype of the momentum and accumulator (default: the
      params' dtypes).

  Returns:
    An ``optax.GradientTransformation``.

  References:
    Liu et al., *Asynchronous Local-SGD Training for Language Modeling*,
    2024.
  """
  _check_delayed_nesterov(momentum, buffer_size, activation)

  def init_fn(params):
    def zeros(p):
      return jnp.zeros_like(p, dtype=state_dtype or p.dtype)

    return DelayedNesterovState(
        momentum=jax.tree.map(zeros, params),
        accumulator=jax.tree.map(zeros, params),
        count=jnp.zeros([], jnp.int32),
    )

  def update_fn(updates, state, params=None):
    del params
    n = jnp.asarray(buffer_size, jnp.int32)
    beta = jnp.asarray(momentum)
    c = jnp.asarray(activation)
    boundary = optax.safe_increment(state.count) % n == 0
    weight = jnp.where(boundary, 1.0 - c * n + c, c)

    def leaf(g, m, a):
      dtype = jnp.promote_types(g.dtype, m.dtype)
      g32, m32 = g.astype(dtype), m.astype(dtype)
      acc = a.astype(dtype) + g32
      new_m = jnp.where(boundary, beta * m32 + acc / n, m32).astype(dtype)
      direction = (weight * beta * new_m + g32 / n).astype(g.dtype)
      new_a = jnp.where(boundary, jnp.zeros_like(acc), acc)
      return direction, new_m.astype(m.dtype), new_a.astype(a.dtype)

    out = jax.tree.map(leaf, updates, state.momentum, state.accumulator)
    treedef = jax.tree.structure(updates)
    direction, new_m, new_a = (
        jax.tree.unflatten(treedef, parts)
        for parts in zip(*treedef.flatten_up_to(out)))
    return direction, DelayedNesterovState(
        momentum=new_m,
        accumulator=new_a,
        count=optax.safe_increment(state.count),
    )

  return optax.GradientTransformation(init_fn, update_fn)


def delayed_nesterov(
    learning_rate: optax.ScalarOrSchedule,
    momentum: jax.typing.ArrayLike = 0.9,
    buffer_size: jax.typing.ArrayLike = 1,
    activation: jax.typing.ArrayLike = 0.0,
    *,
    state_dtype: Any = None,
) -> optax.GradientTransformation:
  r"""Delayed Nesterov (DN): the asynchronous server's outer optimizer.

  Fed one push (a worker's pseudo-gradient, a descent direction) per update,
  it moves the server parameters by :math:`-\eta\, d` with :math:`d` from
  :func:`scale_by_delayed_nesterov`: momentum-free SGD on ``g / N`` for every
  push, and the momentum, built from the average of the last ``N`` pushes,
  applied once per ``N`` pushes (or spread with ``activation``).

  Because every push is divided by ``N`` here, the learning rate of
  synchronous DiLoCo (0.7) gives, per ``N`` pushes, the move of one
  synchronous DiLoCo step with ``N`` workers; rules that do not divide the
  push by ``N`` scale the learning rate with ``N`` instead.

  Args:
    learning_rate: :math:`\eta`, a scalar or a schedule over pushes.
    momentum: :math:`\beta` in ``[0, 1)``.
    buffer_size: :math:`N`, a positive int (about the number of workers).
    activation: :math:`c` in ``[0, 1/N]``; ``0`` by default.
    state_dtype: dtype of the momentum and accumulator.

  Returns:
    An ``optax.GradientTransformation``; its state is
    ``(DelayedNesterovState, ScaleByLearningRateState)``.

  Example:
    >>> import jax.numpy as jnp
    >>> tx = delayed_nesterov(0.7, 0.9, buffer_size=4)
    >>> state = tx.init({'w': jnp.zeros(3)})

  References:
    Liu, Douillard, Ranzato, Szlam, Rusu, *Asynchronous Local-SGD Training
    for Language Modeling*, 2024.
  """
  return optax.chain(
      scale_by_delayed_nesterov(momentum, buffer_size, activation,
                                state_dtype=state_dtype),
      optax.scale_by_learning_rate(learning_rate),
  )
