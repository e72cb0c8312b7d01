"""DiLoCo and parameter averaging as Optax gradient transformations.

Every worker runs the inner optimizer on its own data. Every ``sync_every``
steps the workers average their pseudo-gradients ``anchor - local`` over the
worker axis and one outer optimizer step moves the shared anchor; the local
parameters are then reset to it. Between syncs nothing crosses workers.

References:
  Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen,
  *DiLoCo: Distributed Low-Communication Training of Language Models*, 2023.
  https://arxiv.org/abs/2311.08105

  McMahan, Moore, Ramage, Hampson, Agüera y Arcas, *Communication-Efficient
  Learning of Deep Networks from Decentralized Data* (FedAvg), 2017.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loc_opt import _checks
from loc_opt import compression
from loc_opt.outer import _local
from loc_opt.outer import _sharded
from loc_opt.outer import plan as plan_lib
from loc_opt.outer import robust
from loc_opt.outer.plan import sync_period

SyncEvery = plan_lib.SyncEvery


class DilocoState(NamedTuple):
  """State of :func:`diloco` (one worker's copy).

  Attributes:
    inner_state: the inner optimizer's state, never averaged or reset.
    anchor: the outer parameters ``phi`` (same tree as the params; dtype
      ``promote_types(param dtype, anchor_dtype)``, fp32 by default).
    outer_state: the outer optimizer's state, over ``anchor``.
    count: int32 scalar, inner steps taken.
    steps_since_sync: int32 scalar, inner steps since the last sync.
    num_syncs: int32 scalar, syncs done (a diagnostic for the loop).
    codec_state: the pseudo-gradient compressor's per-worker state (e.g.
      error-feedback buffers, kept across syncs); ``()`` without a codec.
    left_out: int32 scalar, syncs this worker's pseudo-gradient was left
      out of the mean (absent, or not finite).
  """

  inner_state: optax.OptState
  anchor: optax.Params
  outer_state: optax.OptState
  count: jax.Array
  steps_since_sync: jax.Array
  num_syncs: jax.Array
  codec_state: Any = ()
  left_out: Any = 0


def _check_sync_every(sync_every: SyncEvery) -> None:
  """Validates a concrete sync period; traced values (inject_hyperparams)
  and schedules are checked where they are used."""
  if callable(sync_every) or _checks.is_traced(sync_every):
    return
  value = np.asarray(sync_every)
  if (isinstance(sync_every, bool) or value.ndim
      or not np.issubdtype(value.dtype, np.integer)):
    raise TypeError(
        f'sync_every must be an int or a schedule, got {sync_every!r}')
  _checks.positive_int(sync_every, 'sync_every', arrays=True)


def diloco(
    inner: optax.GradientTransformation,
    *,
    sync_every: SyncEvery,
    outer: optax.GradientTransformation | None = None,
    axis_name: str | None = 'worker',
    anchor_dtype: Any = jnp.float32,
    reduce_fn: Callable[[Any], Any] | None = None,
    codec: compression.Scheme = None,
    codec_seed: int = 0,
    aggregate: str = 'mean',
    trim: int = 1,
    clip_multiple: float = 1.0,
    outer_state_layout: str = 'replicated',
    param_specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""DiLoCo: local inner steps, periodic outer steps on averaged deltas.

  On every step the inner optimizer produces an update from this worker's
  gradient. On a sync step (every ``H = sync_every`` inner steps) the worker
  also forms the local parameters the inner update would give,
  ``theta' = theta + u``, and

  .. math::

    \Delta = \operatorname{mean}_{workers}(\phi - \theta'), \quad
    \phi \leftarrow \phi + \mathrm{outer}(\Delta), \quad
    \theta \leftarrow \phi .

  The pseudo-gradient :math:`\Delta` is a descent direction and is handed to
  the outer optimizer as its gradient. The returned update is
  :math:`\phi_{new} - \theta`, so ``optax.apply_updates`` lands on the new
  anchor (within one rounding of ``theta + (phi - theta)``). The inner state
  is kept across syncs.

  The mean over workers is a ``jax.lax.pmean`` over ``axis_name``: run the
  transform under ``jax.vmap(..., axis_name=...)`` or ``jax.shard_map`` over
  that axis (see ``loc_opt.parallel``); ``axis_name=None`` means one worker.

  Which steps sync is decided by the state's counter with ``lax.cond``, or
  fixed at trace time with the keyword-only extra argument ``sync``:
  ``update(..., sync=False)`` traces the inner step alone (a program with no
  cross-worker collective) and ``sync=True`` the sync step. A loop that picks
  between the two compiled programs must pass ``sync=True`` exactly on the
  steps where ``steps_since_sync + 1 == H``.

  Workers that miss a sync: ``update(..., present=False)`` on a sync step
  leaves this worker out of the mean, which is then over the present
  workers (the count travels with the values: 4 bytes more per worker);
  the absent worker's update is ``phi_new - theta`` like every worker's,
  and its codec state stays as it was. A worker whose
  pseudo-gradient is not finite is left out the same way, present or not:
  without ``present`` the plain mean is taken and, only when it comes out
  non-finite, recomputed over the finite workers (a conditional second
  round, free when every worker is finite). ``left_out`` in the state
  counts the syncs each worker missed.

  Rejoining: ``optax.apply_updates`` computes ``theta + (phi_new - theta)``,
  which is the new anchor within one rounding for ordinary workers, only
  approximately for a worker with huge (finite) parameters, and NaN for a
  worker whose parameters went NaN: such a worker is left out of every
  sync but never comes back. :func:`diloco_apply_updates` applies the
  update and, on a sync step, sets every worker's parameters to the new
  anchor exactly (a select, not a difference), so a left-out worker
  rejoins from there.

  Robust aggregation: ``aggregate`` replaces the mean by a rule that one
  bad worker cannot wreck (see :mod:`loc_opt.outer.robust`): the
  coordinate-wise ``'median'`` or ``'trimmed_mean'`` (an all-gather of
  every worker's pseudo-gradient instead of the all-reduce: fp32, or the
  payloads of a stateless ``codec``, decoded on every worker),
  or the ``'norm_clipped_mean'`` (each pseudo-gradient clipped to
  ``clip_multiple`` times the median of the workers' norms, then the
  all-reduce, through the codec if any). Absent and non-finite workers are
  left out of every rule.

  Outer state layout: by default (``'replicated'``) every worker holds the
  whole anchor and outer-optimizer state. ``outer_state_layout='sharded'``
  keeps on each worker only its 1/M of every anchor leaf (strided rows,
  the leading axis zero-padded to a multiple of M) and the outer state
  over it, as ZeRO stage 1 partitions optimizer state (Rajbhandari et
  al., 2020): the sync becomes a reduce-scatter of the local parameters,
  the outer step on the shard and an all-gather of the new anchor, the two
  halves of the all-reduce it replaces (see :mod:`loc_opt.outer._sharded`).
  The state's ``anchor`` then holds the shards, so ``init`` must run under
  the worker map too (``loc_opt.parallel.vmap_workers(tx.init)``) and
  evaluation weights come from ``diloco_eval_params(..., outer_state_layout=
  'sharded')`` under it. Worker dropout (``present``) and the non-finite
  guard work as above (a 4-byte count is all-reduced at every sync);
  ``codec``, ``reduce_fn`` and robust rules are refused. Exact, up to
  float rounding, for element-wise outer optimizers.

  Args:
    inner: the inner optimizer (e.g. ``optax.adamw(...)``); may take extra
      args.
    sync_every: the sync period H (a positive int) or a schedule
      ``count -> H``.
    outer: the outer optimizer, fed the averaged pseudo-gradient (default:
      :func:`nesterov_outer`, SGD lr 0.7 with Nesterov momentum 0.9). Do not
      add weight decay here.
    axis_name: the worker axis to average over; ``None`` for one worker.
    anchor_dtype: the minimum precision of the anchor and its outer state
      (fp32 by default, so bf16 parameters keep an fp32 anchor).
    reduce_fn: how to average the pseudo-gradient tree over workers; default
      ``lax.pmean(tree, axis_name)``. On a mesh, pass
      ``loc_opt.parallel.worker_mean(axis_name)`` so data-parallel replicas
      inside a worker do not each send their copy across workers.
    codec: compress the pseudo-gradients: a ``loc_opt.compression``
      compressor or codec (e.g. ``compression.int8()``, or one wrapped in
      ``compression.error_feedback``), a registered name (``'int8'``) or
      ``(name, kwargs)`` (see ``compression.as_compressor``). Only its payload crosses workers, each
      element once per worker (spread over the worker's devices on a mesh);
      its state (error buffers) persists across syncs in ``codec_state``.
      Exclusive with ``reduce_fn``.
    codec_seed: seed of the key shared by all workers at each sync (folded
      with the sync index), for codecs that draw random numbers.
    aggregate: how the pseudo-gradients are combined: ``'mean'`` (default),
      ``'median'``, ``'trimmed_mean'`` or ``'norm_clipped_mean'``.
    trim: ``'trimmed_mean'``: values dropped at each end per coordinate
      (the worker count must exceed ``2 trim``).
    clip_multiple: ``'norm_clipped_mean'``: the clip bound as a multiple of
      the median of the workers' pseudo-gradient norms.
    outer_state_layout: ``'replicated'`` (default) or ``'sharded'`` (each
      worker holds 1/M of the anchor and outer state; see above).
    param_specs: ``'sharded'`` only, under a ``jax.shard_map`` manual over
      the worker axis only: the parameters' partition specs over the mesh
      axes inside a worker (a tree of ``jax.P`` like the parameters, e.g.
      FSDP's). The reduce-scatter and all-gather of a leaf whose rows split
      into blocks of a multiple of M then run on each device's block,
      manual over those axes, instead of XLA gathering the leaf inside the
      worker first (see :func:`loc_opt.outer._sharded.scatter_delta`);
      same values. Pass the same specs to :func:`diloco_eval_params`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import optax, loc_opt
    >>> tx = loc_opt.diloco(optax.adamw(4e-4), sync_every=100)
    >>> robust = loc_opt.diloco(optax.adamw(4e-4), sync_every=100,
    ...                         aggregate='median')

  References:
    Douillard et al., *DiLoCo: Distributed Low-Communication Training of
    Language Models*, 2023. Yin et al., *Byzantine-Robust Distributed
    Learning: Towards Optimal Statistical Rates*, 2018 (median, trimmed
    mean). Rajbhandari et al., *ZeRO: Memory Optimizations Toward Training
    Trillion Parameter Models*, 2020 (the sharded layout).
  """
  _checks.transformation(inner, 'inner')
  _checks.transformation(outer, 'outer', optional=True)
  _check_sync_every(sync_every)
  if _sharded.check_layout(outer_state_layout) == 'sharded':
    return _sharded_diloco(inner, sync_every=sync_every, outer=outer,
                           axis_name=axis_name, anchor_dtype=anchor_dtype,
                           reduce_fn=reduce_fn, codec=codec,
                           aggregate=aggregate, param_specs=param_specs)
  if param_specs is not None:
    raise ValueError("diloco takes param_specs with outer_state_layout="
                     "'sharded' only")
  inner = optax.with_extra_args_support(inner)
  outer = _local.nesterov_outer() if outer is None else outer
  if codec is not None and reduce_fn is not None:
    raise ValueError('diloco takes a codec or a reduce_fn, not both')
  if codec is not None and axis_name is None:
    raise ValueError('diloco with a codec needs an axis_name')
  robust.check(aggregate, trim=trim, clip_multiple=clip_multiple,
               codec=codec, reduce_fn=reduce_fn)
  gathered = aggregate in robust.GATHERED
  average = robust.averager(aggregate, trim=trim, clip_multiple=clip_multiple,
                            codec=codec if gathered else None)
  compressor = (None if codec is None or gathered
                else compression.as_compressor(codec))
  comm = compression.Comm(axis_name) if axis_name is not None else None

  init_fn = _local.periodic_init(
      DilocoState, inner, anchor_dtype, lambda anchor: dict(
          outer_state=outer.init(anchor),
          codec_state=() if compressor is None else compressor.init(anchor),
          left_out=jnp.zeros([], jnp.int32)))

  if reduce_fn is not None:
    mean_fn = reduce_fn
  elif axis_name is not None:
    def mean_fn(tree):
      axis = _checks.axis_bound(axis_name, 'loc_opt.diloco or local_sgd')
      return jax.lax.pmean(tree, axis)
  else:
    mean_fn = _local.identity

  def sync_step(state, params, local, _, present):
    delta, _, codec_state, included = average(
        _local.pseudo_gradient(state.anchor, local), state.codec_state,
        present, compressor=compressor, comm=comm, seed=codec_seed,
        index=state.num_syncs, mean_fn=mean_fn)
    outer_updates, outer_state = outer.update(
        delta, state.outer_state, state.anchor)
    anchor = optax.apply_updates(state.anchor, outer_updates)
    left_out = state.left_out + jnp.logical_not(included).astype(jnp.int32)
    return _local.updates_to(anchor, params), dict(
        anchor=anchor, outer_state=outer_state, codec_state=codec_state,
        left_out=left_out)

  update_fn = _local.periodic_update(
      inner, sync_every, name='diloco', sync_step=sync_step,
      fields=('anchor', 'outer_state', 'codec_state', 'left_out'),
      varying=_local.varying_fn(comm), period=sync_period,
      takes_present=True)
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _sharded_diloco(inner, *, sync_every, outer, axis_name, anchor_dtype,
                    reduce_fn, codec, aggregate, param_specs
                    ) -> optax.GradientTransformationExtraArgs:
  """:func:`diloco` with ``outer_state_layout='sharded'``."""
  refused = {'a codec': codec is not None,
             'a reduce_fn': reduce_fn is not None,
             f'aggregate={aggregate!r}': aggregate != 'mean',
             'axis_name=None': axis_name is None}
  for what, bad in refused.items():
    if bad:
      raise ValueError(f"diloco(outer_state_layout='sharded') does not take "
                       f'{what} (the sync is a reduce-scatter of the plain '
                       'mean); use the replicated layout')
  inner = optax.with_extra_args_support(inner)
  outer = _local.nesterov_outer() if outer is None else outer
  who = "loc_opt.diloco(outer_state_layout='sharded')"

  def init_fn(params):
    axis = _checks.axis_bound(axis_name, who)
    anchor = _sharded.shard_tree(_local.init_anchor(params, anchor_dtype),
                                 axis)
    return DilocoState(inner_state=inner.init(params), anchor=anchor,
                       outer_state=outer.init(anchor), codec_state=(),
                       left_out=jnp.zeros([], jnp.int32),
                       **_local.zero_counters())

  def sync_step(state, params, local, _, present):
    axis = _checks.axis_bound(axis_name, who)
    included = _local.all_finite(local)
    if present is not None:
      included = jnp.logical_and(present, included)
    delta = _sharded.scatter_delta(state.anchor, local, included, axis,
                                   param_specs=param_specs)
    outer_updates, outer_state = outer.update(
        delta, state.outer_state, state.anchor)
    anchor = optax.apply_updates(state.anchor, outer_updates)
    full = _sharded.gather_tree(anchor, local, axis,
                                param_specs=param_specs)
    left_out = state.left_out + jnp.logical_not(included).astype(jnp.int32)
    return _local.updates_to(full, params), dict(
        anchor=anchor, outer_state=outer_state, codec_state=(),
        left_out=left_out)

  update_fn = _local.periodic_update(
      inner, sync_every, name='diloco', sync_step=sync_step,
      fields=('anchor', 'outer_state', 'codec_state', 'left_out'),
      varying=_local.varying_fn(compression.Comm(axis_name)),
      period=sync_period, takes_present=True)
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def local_sgd(
    inner: optax.GradientTransformation,
    *,
    sync_every: SyncEvery,
    axis_name: str | None = 'worker',
    anchor_dtype: Any = jnp.float32,
    reduce_fn: Callable[[Any], Any] | None = None,
    codec: compression.Scheme = None,
    codec_seed: int = 0,
    aggregate: str = 'mean',
    trim: int = 1,
    clip_multiple: float = 1.0,
    outer_state_layout: str = 'replicated',
    param_specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Local SGD / FedAvg: every ``sync_every`` steps, average the parameters.

  The outer-SGD case of :func:`diloco` with learning rate 1 and no momentum:
  the new anchor is ``phi - mean(phi - theta') = mean(theta')`` (or the
  robust ``aggregate`` of the local parameters, see :func:`diloco`).

  References:
    McMahan et al., *Communication-Efficient Learning of Deep Networks from
    Decentralized Data*, 2017; Stich, *Local SGD Converges Fast and
    Communicates Little*, 2019.
  """
  _checks.transformation(inner, 'inner')
  return diloco(
      inner,
      sync_every=sync_every,
      outer=optax.sgd(1.0),
      axis_name=axis_name,
      anchor_dtype=anchor_dtype,
      reduce_fn=reduce_fn,
      codec=codec,
      codec_seed=codec_seed,
      aggregate=aggregate,
      trim=trim,
      clip_multiple=clip_multiple,
      outer_state_layout=outer_state_layout,
      param_specs=param_specs,
  )


def diloco_eval_params(state: DilocoState, params: optax.Params, *,
                       outer_state_layout: str = 'replicated',
                       axis_name: str = 'worker',
                       param_specs: Any = None) -> Any:
  """The weights to evaluate: the outer parameters (anchor) in params dtypes.

  Between syncs the workers' local parameters drift apart; the anchor is the
  one shared model (Streaming DiLoCo, Table 3, finds it evaluates best).
  With ``outer_state_layout='sharded'`` the anchor's shards are all-gathered
  over ``axis_name`` (call it under the worker map; ``param_specs`` as
  in :func:`diloco`).
  """
  if _sharded.check_layout(outer_state_layout) == 'sharded':
    axis = _checks.axis_bound(axis_name, 'loc_opt.diloco_eval_params')
    return _local.cast_like(
        _sharded.gather_tree(state.anchor, params, axis,
                             param_specs=param_specs), params)
  return _local.cast_like(state.anchor, params)


def diloco_apply_updates(params: optax.Params, updates: optax.Updates,
                         state: DilocoState) -> optax.Params:
  """``optax.apply_updates(params, updates)``, except that right after a
  sync every worker's parameters are the new anchor exactly.

  ``state`` is the state that :func:`diloco` (or :func:`local_sgd`)
  returned with ``updates``. On a sync step the update is ``anchor -
  params``, and ``params + (anchor - params)`` is the anchor only up to
  rounding, far from it for a worker with huge parameters and NaN for a
  worker whose parameters went NaN (left out of the sync, it could never
  rejoin). Here the parameters are *set* to the anchor (in their dtypes)
  on that step; on inner steps this is ``optax.apply_updates``. Call it
  per worker (under the same ``vmap`` / ``shard_map`` as the update);
  replicated outer state only.

  Example:
    >>> updates, state = tx.update(grads, state, params)
    >>> params = loc_opt.diloco_apply_updates(params, updates, state)
  """
  anchor_shapes = [jnp.shape(a) for a in jax.tree.leaves(state.anchor)]
  if anchor_shapes != [jnp.shape(p) for p in jax.tree.leaves(params)]:
    raise ValueError(
        'diloco_apply_updates needs the replicated layout (the state\'s '
        'anchor shaped like params); with outer_state_layout=\'sharded\' '
        'the anchor holds 1/M shards: reset from diloco_eval_params(..., '
        'outer_state_layout=\'sharded\') instead')
  moved = optax.apply_updates(params, updates)
  synced = (state.steps_since_sync == 0) & (state.count > 0)
  return jax.tree.map(
      lambda a, p: jnp.where(synced, a.astype(p.dtype), p),
      state.anchor, moved)


def next_step_syncs(
    sync_every: SyncEvery, count: int, steps_since_sync: int
) -> bool:
  """Host-side: whether the step after ``count`` inner steps is a sync step.

  Loops that compile the inner and the sync step as two programs use this to
  pick one without reading device memory.
  """
  period = int(sync_period(sync_every, jnp.asarray(count, jnp.int32)))
  return steps_since_sync + 1 >= period

