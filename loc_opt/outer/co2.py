"""CO2: local SGD whose parameter average lands one round late.

Workers run ``H`` local steps, then launch an asynchronous all-reduce of
their parameters and go on training at once; the average is only used at
the end of the *next* round, so its communication overlaps a whole round of
compute. A SlowMo-style outer momentum step turns the stale average into
the next outer parameters, with a staleness-gap penalty (a divisor of the
outer gradient) and an element-wise clip of the outer momentum.

In this synchronous SPMD program the all-reduce runs on the sync step and
its result is stored in the state until the next sync: the numerics of the
overlap are reproduced, not its speed.

References:
  Sun et al., *CO2: Efficient Distributed Training with Full
  Communication-Computation Overlap*, ICLR 2024.

  Wang, Tantia, Ballas, Rabbat, *SlowMo: Improving Communication-Efficient
  Distributed SGD with Slow Momentum*, ICLR 2020.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loc_opt import _checks
from loc_opt import compression
from loc_opt.outer import _local
from loc_opt.outer import plan as plan_lib


class Co2State(NamedTuple):
  """State of :func:`co2` (one worker's copy; all but ``inner_state`` are
  equal on all workers).

  Attributes:
    inner_state: the inner optimizer's state, never averaged or reset.
    anchor: the outer parameters ``phi`` (same tree as the params; dtype
      ``promote_types(param dtype, anchor_dtype)``).
    outer_momentum: the outer momentum ``m`` (anchor dtypes), zeros at init.
    stale_mean: the workers' average parameters launched at the last sync
      (the all-reduce "in flight" during this round), used at the next sync;
      anchor dtypes; the initial ``phi`` before the first sync.
    count: int32 scalar, inner steps taken.
    steps_since_sync: int32 scalar, inner steps since the last sync.
    num_syncs: int32 scalar, syncs done.
  """

  inner_state: optax.OptState
  anchor: optax.Params
  outer_momentum: optax.Params
  stale_mean: optax.Params
  count: jax.Array
  steps_since_sync: jax.Array
  num_syncs: jax.Array


def co2(
    inner: optax.GradientTransformation,
    *,
    sync_every: int,
    outer_lr: jax.typing.ArrayLike = 1.0,
    momentum: jax.typing.ArrayLike = 0.5,
    staleness_penalty: jax.typing.ArrayLike = 1.0,
    clip: jax.typing.ArrayLike | None = 1.0,
    stale: bool = True,
    axis_name: str | None = 'worker',
    anchor_dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
  r"""CO2: local SGD with a one-round-stale average and outer momentum.

  Every ``H = sync_every`` inner steps (the end of round ``r``) each worker
  forms its local parameters after this step's inner update,
  :math:`\theta'_m`, and launches their average
  :math:`\bar x_r = \operatorname{mean}_m \theta'_m`, which arrives during
  round ``r + 1``. The outer step of round ``r`` uses the average launched
  one round earlier, :math:`\bar x_{r-1}`:

  .. math::

    m \leftarrow \operatorname{clip}_{[-c, c]}\big(\mu m
      + (\phi - \bar x_{r-1}) / \lambda\big), \quad
    \phi \leftarrow \phi - \eta m, \quad
    \theta_m \leftarrow \phi .

  Staleness: :math:`\bar x_{r-1}` was trained from the outer parameters of
  one round before the current :math:`\phi`, so the outer gradient
  :math:`\phi - \bar x_{r-1}` also holds the gap between the two; the
  penalty :math:`\lambda` (``staleness_penalty``) divides it. Every worker
  restarts round ``r + 1`` from the new :math:`\phi` (``theta <- phi``): its
  round-``r`` progress reaches :math:`\phi` only through
  :math:`\bar x_r`, one round later. Before the first sync the stale average
  is the initial :math:`\phi`, so the first sync's outer gradient is zero
  (with zero momentum, no outer step).

  The clip is element-wise on the momentum, as the paper's rule. The public
  reference implementation calls a non-in-place clamp and drops its result,
  so it never clips; here the clip is applied (``clip=None`` turns it off).

  With ``stale=False`` the fresh average :math:`\bar x_r` is used instead
  (no overlap); with ``momentum=0``, ``staleness_penalty=1``,
  ``outer_lr=1`` and no clip that is local SGD (parameter averaging every
  ``H`` steps).

  Each sync sends one copy of the parameters (in the anchor dtype) per
  worker, like DiLoCo, but that all-reduce may take a whole round of ``H``
  inner steps (as in Eager updates) instead of blocking.

  ``update(..., sync=None)`` decides on device from the step counter;
  ``sync=True`` / ``False`` (from :func:`co2_plan`) trace the sync or the
  inner step alone.

  Args:
    inner: the inner optimizer; may take extra args.
    sync_every: ``H`` (the paper's local period tau), a positive int.
    outer_lr: ``eta``, the outer learning rate.
    momentum: ``mu``, the outer momentum coefficient, in ``[0, 1)``.
    staleness_penalty: ``lambda > 0``, divides the outer gradient.
    clip: ``c > 0``, the element-wise bound of the outer momentum; ``None``
      for no clip.
    stale: use the one-round-stale average (CO2); ``False`` uses the fresh
      average of this round (SlowMo without overlap).
    axis_name: the worker axis; ``None`` for one worker.
    anchor_dtype: the minimum precision of ``phi``, ``m`` and the stored
      average.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import optax
    >>> import loc_opt
    >>> tx = loc_opt.co2(optax.adamw(4e-4), sync_every=3)

  References:
    Sun et al., *CO2: Efficient Distributed Training with Full
    Communication-Computation Overlap*, ICLR 2024.
  """
  _checks.transformation(inner, 'inner')
  _checks.positive_int(sync_every, 'sync_every')
  for name, value in (('outer_lr', outer_lr),
                      ('staleness_penalty', staleness_penalty),
                      ('clip', clip)):
    if value is not None and not _checks.is_traced(value):
      _checks.positive_or_inf(value, name)
  if not _checks.is_traced(momentum):
    _checks.in_interval(momentum, 'momentum', 0, 1, closed='left')
  inner = optax.with_extra_args_support(inner)
  comm = compression.Comm(axis_name) if axis_name is not None else None

  init_fn = _local.periodic_init(
      Co2State, inner, anchor_dtype, lambda anchor: dict(
          outer_momentum=jax.tree.map(jnp.zeros_like, anchor),
          stale_mean=jax.tree.map(jnp.copy, anchor)))

  def new_momentum(m, phi, x):
    m = momentum * m + (phi - x) / staleness_penalty
    if clip is not None:
      m = jnp.clip(m, -clip, clip)
    return m.astype(phi.dtype)

  def sync_step(state, params, local, _):
    local = jax.tree.map(lambda a, x: x.astype(a.dtype), state.anchor, local)
    fresh = comm.pmean(local) if comm is not None else local  # launched
    target = state.stale_mean if stale else fresh
    mom = jax.tree.map(new_momentum, state.outer_momentum, state.anchor,
                       target)
    anchor = jax.tree.map(lambda phi, m: (phi - outer_lr * m).astype(
        phi.dtype), state.anchor, mom)
    return _local.updates_to(anchor, params), dict(
        anchor=anchor, outer_momentum=mom, stale_mean=fresh)

  update_fn = _local.periodic_update(
      inner, sync_every, name='co2', sync_step=sync_step,
      fields=('anchor', 'outer_momentum', 'stale_mean'),
      varying=_local.varying_fn(comm))
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def co2_plan(sync_every: int) -> plan_lib.Plan:
  """The host-side plan of :func:`co2`: ``True`` (launch this round's
  average, apply the previous one) on counts ``H - 1, 2H - 1, ...``, else
  ``False``."""
  return plan_lib.Plan(plan_lib.every(
      _checks.positive_int(sync_every, 'sync_every')))


def co2_eval_params(state: Co2State, params: optax.Params) -> Any:
  """The weights to evaluate: the outer parameters ``phi`` in params
  dtypes (equal on all workers)."""
  return _local.cast_like(state.anchor, params)


def co2_bytes(params: Any, dtype: Any = jnp.float32) -> int:
  """Bytes one worker sends per sync: its parameters at ``dtype`` (the
  anchor dtype, fp32 by default)."""
  return _local.num_params(params) * jnp.dtype(dtype).itemsize
