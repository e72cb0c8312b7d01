"""Eager updates: overlap a whole outer round of communication in DiLoCo.

The all-reduce of round ``r``'s pseudo-gradients may take the whole next
inner phase. Waiting for it (a one-round delay) hurts; instead each worker
steps its own outer parameters at once with a proxy made of its own fresh
pseudo-gradient and the other workers' pseudo-gradients of the previous
round, which have arrived by then. The workers' outer parameters therefore
differ slightly: every worker keeps its own ``phi_m`` and outer state.

In this synchronous SPMD program the all-reduce runs on the sync step and
its result is stored until the next sync: the numerics of the overlap are
reproduced, not its speed.

References:
  Kale, Douillard, Donchev, *Eager Updates For Overlapped Communication and
  Computation in DiLoCo*, 2025. https://arxiv.org/abs/2502.12996
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loc_opt import _checks
from loc_opt import compression
from loc_opt.outer import _local
from loc_opt.outer import plan as plan_lib


class EagerDilocoState(NamedTuple):
  """State of :func:`eager_diloco` (one worker's copy).

  Attributes:
    inner_state: the inner optimizer's state, never averaged or reset.
    anchor: this worker's outer parameters ``phi_m`` (same tree as the
      params; dtype ``promote_types(param dtype, anchor_dtype)``).
    outer_state: this worker's outer optimizer state, over ``anchor``.
    prev_sent: this worker's pseudo-gradient of the previous round as it
      entered the average (after the codec, if any); anchor dtypes; zeros
      before the first sync.
    prev_mean: the average over workers of the previous round's
      pseudo-gradients (the all-reduce "in flight" during this round);
      anchor dtypes; zeros before the first sync.
    count: int32 scalar, inner steps taken.
    steps_since_sync: int32 scalar, inner steps since the last sync.
    num_syncs: int32 scalar, syncs done.
    codec_state: the pseudo-gradient compressor's per-worker state (kept
      across syncs); ``()`` without a codec.
  """

  inner_state: optax.OptState
  anchor: optax.Params
  outer_state: optax.OptState
  prev_sent: optax.Params
  prev_mean: optax.Params
  count: jax.Array
  steps_since_sync: jax.Array
  num_syncs: jax.Array
  codec_state: Any = ()


def eager_diloco(
    inner: optax.GradientTransformation,
    *,
    sync_every: int,
    outer: optax.GradientTransformation | None = None,
    axis_name: str | None = 'worker',
    anchor_dtype: Any = jnp.float32,
    codec: compression.Scheme = None,
    codec_seed: int = 0,
    naive: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""DiLoCo with eager outer updates (one round of communication overlap).

  Every ``H = sync_every`` inner steps, worker ``m`` forms its local
  parameters after the inner update, ``theta'_m``, its pseudo-gradient
  :math:`\Delta_m^{(r)} = \phi_m - \theta'_m`, and starts the average
  :math:`\bar\Delta^{(r)}` over the ``M`` workers, which is only used in the
  next round. The outer step uses the eager proxy

  .. math::

    \tilde\Delta_m^{(r)} = \tfrac{1}{M} \Delta_m^{(r)}
      + \bar\Delta^{(r-1)} - \tfrac{1}{M} \Delta_m^{(r-1)}, \quad
    \phi_m \leftarrow \phi_m + \mathrm{outer}_m(\tilde\Delta_m^{(r)}),
    \quad \theta_m \leftarrow \phi_m,

  its own fresh share plus the other workers' shares of the previous round
  (zeros before the first sync). With ``naive=True`` the proxy is
  :math:`\bar\Delta^{(r-1)}` alone (the one-round-delayed ablation). With
  ``M = 1`` the eager proxy is :math:`\Delta^{(r)}`: plain DiLoCo.

  With a codec, :math:`\Delta_m^{(r-1)}` is what this worker contributed to
  the average (its value after compression), so the subtraction removes
  exactly its own stale share; the fresh share is exact (it never leaves the
  worker).

  ``update(..., sync=None)`` decides on device from the step counter;
  ``sync=True`` / ``False`` (from :func:`eager_plan`) trace the sync or the
  inner step alone.

  Args:
    inner: the inner optimizer; may take extra args.
    sync_every: ``H``, a positive int.
    outer: the outer optimizer (default :func:`loc_opt.outer.nesterov_outer`),
      one copy of its state per worker.
    axis_name: the worker axis; ``None`` for one worker (``M = 1``).
    anchor_dtype: the minimum precision of ``phi_m``, the outer state and the
      stored pseudo-gradients.
    codec: compress the pseudo-gradients (a ``loc_opt.compression`` codec or
      compressor, a registered name such as ``'int8'``, or ``(name,
      kwargs)``); its state persists across syncs.
    codec_seed: seed of the key shared by all workers at each sync.
    naive: use the stale average alone (the paper's naive delayed baseline).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import optax
    >>> import loc_opt
    >>> tx = loc_opt.eager_diloco(optax.adamw(4e-4), sync_every=30)

  References:
    Kale, Douillard, Donchev, *Eager Updates For Overlapped Communication and
    Computation in DiLoCo*, 2025.
  """
  _checks.transformation(inner, 'inner')
  _checks.transformation(outer, 'outer', optional=True)
  _checks.positive_int(sync_every, 'sync_every')
  if codec is not None and axis_name is None:
    raise ValueError('eager_diloco with a codec needs an axis_name')
  inner = optax.with_extra_args_support(inner)
  outer = _local.nesterov_outer() if outer is None else outer
  compressor = None if codec is None else compression.as_compressor(codec)
  comm = compression.Comm(axis_name) if axis_name is not None else None

  init_fn = _local.periodic_init(
      EagerDilocoState, inner, anchor_dtype, lambda anchor: dict(
          outer_state=outer.init(anchor),
          prev_sent=jax.tree.map(jnp.zeros_like, anchor),
          prev_mean=jax.tree.map(jnp.zeros_like, anchor),
          codec_state=() if compressor is None else compressor.init(anchor)))

  def sync_step(state, params, local, _):
    delta = _local.pseudo_gradient(state.anchor, local)
    mean, sent, codec_state = _local.worker_mean(
        delta, state.codec_state, compressor=compressor, comm=comm,
        seed=codec_seed, index=state.num_syncs,
        mean_fn=_local.identity if comm is None else comm.pmean)
    workers = 1 if comm is None else comm.size()
    if naive:
      proxy = state.prev_mean
    else:  # (stale mean - own stale share) + own fresh share
      proxy = jax.tree.map(
          lambda d, pm, ps: (pm - ps / workers) + d / workers, delta,
          state.prev_mean, state.prev_sent)
    outer_updates, outer_state = outer.update(proxy, state.outer_state,
                                              state.anchor)
    anchor = optax.apply_updates(state.anchor, outer_updates)
    return _local.updates_to(anchor, params), dict(
        anchor=anchor, outer_state=outer_state, prev_sent=sent,
        prev_mean=mean, codec_state=codec_state)

  update_fn = _local.periodic_update(
      inner, sync_every, name='eager_diloco', sync_step=sync_step,
      fields=('anchor', 'outer_state', 'prev_sent', 'prev_mean',
              'codec_state'),
      varying=_local.varying_fn(comm))
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def eager_plan(sync_every: int) -> plan_lib.Plan:
  """The host-side plan of :func:`eager_diloco`: ``True`` on counts ``H - 1,
  2H - 1, ...``, else ``False``."""
  return plan_lib.Plan(plan_lib.every(
      _checks.positive_int(sync_every, 'sync_every')))


def eager_eval_params(state: EagerDilocoState, params: optax.Params) -> Any:
  """The weights to evaluate: this worker's outer parameters ``phi_m``, in
  params dtypes (the workers' ``phi_m`` differ slightly by construction)."""
  return _local.cast_like(state.anchor, params)


def eager_bytes(
    params: Any, dtype: Any = jnp.float32,
    codec: compression.Scheme = None) -> int:
  """Bytes one worker sends per sync: its pseudo-gradient at ``dtype`` or
  the payload of ``codec`` (the same as DiLoCo; only the latency budget
  grows to a whole round)."""
  return _local.pseudo_gradient_bytes(params, dtype, codec)
