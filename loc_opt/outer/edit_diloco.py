"""EDiT: DiLoCo with a pseudo-gradient penalty before the outer step.

Before the workers' pseudo-gradients are averaged, EDiT guards the outer step
against a worker whose round went wrong (a loss spike, bad data):

1. *anomaly elimination*: every worker keeps running statistics of its own
   pseudo-gradient norm and leaves the average when its new norm is an
   outlier (z-score above a threshold);
2. *weighted averaging*: the remaining workers are weighted by a softmax of
   their negated norms, so a larger pseudo-gradient counts less;
3. *clipping*: the aggregated pseudo-gradient is clipped to a global norm.

Then the outer (Nesterov) step runs as in DiLoCo. Only scalars (each
worker's norm and keep flag) cross workers besides the one all-reduce of the
weighted pseudo-gradients, so the bytes per sync stay those of DiLoCo.

The paper also syncs layer by layer during the next forward pass (with
prefetch, so each collective overlaps compute) and has a time-based variant
(A-EDiT); both are out of scope here: this module reproduces the numerics of
the penalty, with one sync step every ``H`` inner steps.

References:
  Cheng et al., *EDiT: A Local-SGD-Based Efficient Distributed Training
  Method for Large Language Models*, ICLR 2025.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loc_opt import _checks
from loc_opt import compression
from loc_opt.outer import _local
from loc_opt.outer import plan as plan_lib

# A detector that has seen (nearly) equal norms has a (nearly) zero standard
# deviation; flooring it at this fraction of the mean keeps rounding noise
# from being flagged.
_STD_FLOOR = 1e-3


class EditState(NamedTuple):
  """State of :func:`edit_diloco` (one worker's copy).

  Attributes:
    inner_state: the inner optimizer's state, never averaged or reset.
    anchor: the outer parameters ``phi`` (same tree as the params; dtype
      ``promote_types(param dtype, anchor_dtype)``), equal on all workers.
    outer_state: the outer optimizer's state, over ``anchor``.
    norm_mean: fp32 scalar, running mean of this worker's pseudo-gradient
      norm (over the syncs where it was not flagged).
    norm_var: fp32 scalar, running variance of the same.
    num_norms: int32 scalar, norms recorded into ``norm_mean``/``norm_var``.
    weight: fp32 scalar, this worker's weight in the last sync's average
      (``0`` when dropped, and before the first sync).
    num_dropped: int32 scalar, workers left out of the last sync's average.
    total_dropped: int32 scalar, sum of ``num_dropped`` over all syncs.
    count: int32 scalar, inner steps taken.
    steps_since_sync: int32 scalar, inner steps since the last sync.
    num_syncs: int32 scalar, syncs done.
  """

  inner_state: optax.OptState
  anchor: optax.Params
  outer_state: optax.OptState
  norm_mean: jax.Array
  norm_var: jax.Array
  num_norms: jax.Array
  weight: jax.Array
  num_dropped: jax.Array
  total_dropped: jax.Array
  count: jax.Array
  steps_since_sync: jax.Array
  num_syncs: jax.Array


def _check_args(ewma, warmup_syncs, z_threshold, temperature, clip_norm
                ) -> None:
  """Validates EDiT's concrete hyperparameters (traced ones, from
  ``optax.inject_hyperparams``, are not checked)."""
  _checks.positive_int(warmup_syncs, 'warmup_syncs')
  if not _checks.is_traced(ewma):
    _checks.in_interval(ewma, 'ewma', 0, 1, closed='right')
  for name, value in (('z_threshold', z_threshold),
                      ('temperature', temperature)):
    if not _checks.is_traced(value):  # inf: never drop / equal weights
      _checks.positive_or_inf(value, name)
  if clip_norm is not None and not _checks.is_traced(clip_norm):
    _checks.positive_float(clip_norm, 'clip_norm')


def _detect(norm: jax.Array, state: EditState, *, ewma: Any,
            warmup_syncs: int, z_threshold: Any) -> tuple[jax.Array, ...]:
  """The anomaly detector: ``(keep flag, new mean, new var, new count)`` of
  this worker's pseudo-gradient norm statistics."""
  std = jnp.maximum(jnp.sqrt(state.norm_var), _STD_FLOOR * state.norm_mean)
  z = (norm - state.norm_mean) / jnp.maximum(std, 1e-30)
  flagged = (state.num_norms >= warmup_syncs) & (z > z_threshold)
  k = optax.safe_increment(state.num_norms)
  a = jnp.maximum(jnp.asarray(ewma, jnp.float32),
                  1.0 / k.astype(jnp.float32))
  diff = norm - state.norm_mean
  mean = state.norm_mean + a * diff
  var = (1 - a) * (state.norm_var + a * diff * diff)
  keep = ~flagged
  return (keep, jnp.where(keep, mean, state.norm_mean),
          jnp.where(keep, var, state.norm_var),
          jnp.where(keep, k, state.num_norms))


def _weights(norm: jax.Array, keep: jax.Array,
             comm: compression.Comm | None, temperature: Any
             ) -> tuple[jax.Array, Any, jax.Array]:
  """``(this worker's weight, M, workers dropped)`` from every worker's norm
  and keep flag (an all-gather of two scalars each)."""
  own = jnp.stack([norm, keep.astype(jnp.float32)])
  if comm is not None:
    table = jax.lax.all_gather(own, comm.bound_axis)  # [M, 2]: a few bytes
    index = comm.index()
    workers = comm.size()
  else:
    table, index, workers = own[None], 0, 1
  norms, keeps = table[:, 0], table[:, 1] > 0
  keeps = jnp.where(jnp.any(keeps), keeps, True)  # all dropped: mean
  weights = jax.nn.softmax(-norms / temperature, where=keeps)
  weights = jnp.where(keeps, weights, 0.0)
  dropped = workers - jnp.sum(keeps.astype(jnp.int32))
  return weights[index], workers, dropped.astype(jnp.int32)


def _clip(tree: Any, clip_norm: Any) -> Any:
  """``tree`` scaled to global norm at most ``clip_norm``."""
  scale = jnp.minimum(1.0, clip_norm / jnp.maximum(optax.tree.norm(tree),
                                                   1e-30))
  return jax.tree.map(lambda g: (scale * g).astype(g.dtype), tree)


def edit_diloco(
    inner: optax.GradientTransformation,
    *,
    sync_every: int,
    outer: optax.GradientTransformation | None = None,
    ewma: jax.typing.ArrayLike = 0.02,
    warmup_syncs: int = 120,
    z_threshold: jax.typing.ArrayLike = 3.0,
    temperature: jax.typing.ArrayLike = 1.0,
    clip_norm: jax.typing.ArrayLike | None = None,
    axis_name: str | None = 'worker',
    anchor_dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
  r"""EDiT: DiLoCo with anomaly elimination, weighted averaging and clipping.

  Every ``H = sync_every`` inner steps worker ``m`` forms its pseudo-gradient
  :math:`\Delta_m = \phi - \theta'_m` (``theta'`` = the local parameters
  after this step's inner update) and its norm :math:`n_m = \|\Delta_m\|_2`.

  *Anomaly elimination.* The worker keeps a running mean :math:`\mu_m` and
  variance :math:`\sigma_m^2` of its own norms. Once it has recorded
  ``warmup_syncs`` of them it is dropped (``keep_m = 0``) when

  .. math::

    z_m = (n_m - \mu_m) / \max(\sigma_m, 10^{-3} \mu_m) > z_{thr}

  (one-sided: only a too *large* pseudo-gradient is an anomaly). Norms that
  are not flagged update the statistics with weight
  :math:`a_k = \max(\alpha, 1 / k)` for the ``k``-th record,
  :math:`\mu \leftarrow \mu + a (n - \mu)`,
  :math:`\sigma^2 \leftarrow (1 - a)(\sigma^2 + a (n - \mu_{old})^2)`: the
  exact mean and variance of the first ``1 / alpha`` norms, an exponential
  moving average (``alpha = ewma``) after that.

  *Weighted averaging.* The workers share their norms and keep flags (an
  all-gather of two scalars each) and weight the kept ones by

  .. math::

    w_m = \frac{keep_m \, e^{-n_m / T}}{\sum_j keep_j \, e^{-n_j / T}}

  (``T = temperature``; ``T = inf`` gives equal weights). If every worker is
  dropped all are kept (the plain mean). The weighted mean
  :math:`\bar\Delta = \sum_m w_m \Delta_m` is one all-reduce (a mean of
  :math:`M w_m \Delta_m`), so each worker sends one pseudo-gradient, as in
  DiLoCo. The sign (larger norm, smaller weight) is our reading of the
  paper's abstract and of the atorch documentation of its implementation;
  we could not check it against the paper's equations.

  *Clipping.* With ``clip_norm = c``,
  :math:`\bar\Delta \leftarrow \bar\Delta \min(1, c / \|\bar\Delta\|_2)`.

  Then, as in DiLoCo, :math:`\phi \leftarrow \phi + \mathrm{outer}(\bar
  \Delta)` and :math:`\theta_m \leftarrow \phi`; the returned update is
  :math:`\phi_{new} - \theta` so that ``optax.apply_updates`` lands on the
  new anchor. With ``z_threshold = inf``, ``temperature = inf`` and no clip
  this is :func:`loc_opt.diloco`.

  ``update(..., sync=None)`` decides on device from the step counter;
  ``sync=True`` / ``False`` (from :func:`edit_plan`) trace the sync or the
  inner step alone. Out of scope: the paper's layer-wise sync during the
  next forward pass (its speed, not its numerics) and A-EDiT's time-based
  sync period.

  Args:
    inner: the inner optimizer; may take extra args.
    sync_every: ``H``, a positive int.
    outer: the outer optimizer (default :func:`loc_opt.outer.nesterov_outer`,
      SGD lr 0.7 with Nesterov momentum 0.9).
    ewma: ``alpha``, the weight of a new norm in the detector's moving
      statistics, in ``(0, 1]`` (atorch default 0.02).
    warmup_syncs: norms a worker records before its detector may drop it
      (a positive int; 120 as atorch's detector warmup, whose unit we read
      as syncs).
    z_threshold: drop a worker whose norm z-score exceeds this (``inf``:
      never drop).
    temperature: ``T`` of the softmax weights (``inf``: equal weights).
    clip_norm: clip the aggregated pseudo-gradient to this global norm
      (``None``: no clip; atorch examples use 1 or 10).
    axis_name: the worker axis; ``None`` for one worker.
    anchor_dtype: the minimum precision of the anchor and its outer state.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import optax
    >>> import loc_opt
    >>> tx = loc_opt.edit_diloco(optax.adamw(4e-4), sync_every=10,
    ...                          clip_norm=10.0)

  References:
    Cheng et al., *EDiT: A Local-SGD-Based Efficient Distributed Training
    Method for Large Language Models*, ICLR 2025.
  """
  _checks.transformation(inner, 'inner')
  _checks.transformation(outer, 'outer', optional=True)
  _checks.positive_int(sync_every, 'sync_every')
  _check_args(ewma, warmup_syncs, z_threshold, temperature, clip_norm)
  inner = optax.with_extra_args_support(inner)
  outer = _local.nesterov_outer() if outer is None else outer
  comm = compression.Comm(axis_name) if axis_name is not None else None

  def fields(anchor):
    zero = jnp.zeros([], jnp.int32)
    return dict(outer_state=outer.init(anchor),
                norm_mean=jnp.zeros([], jnp.float32),
                norm_var=jnp.zeros([], jnp.float32), num_norms=zero,
                weight=jnp.zeros([], jnp.float32), num_dropped=zero,
                total_dropped=zero)

  init_fn = _local.periodic_init(EditState, inner, anchor_dtype, fields)

  def sync_step(state, params, local, _):
    delta = _local.pseudo_gradient(state.anchor, local)
    norm = optax.tree.norm(delta).astype(jnp.float32)
    keep, mean, var, num_norms = _detect(
        norm, state, ewma=ewma, warmup_syncs=warmup_syncs,
        z_threshold=z_threshold)
    weight, workers, dropped = _weights(norm, keep, comm, temperature)
    scaled = jax.tree.map(lambda d: (workers * weight).astype(d.dtype) * d,
                          delta)
    agg = comm.pmean(scaled) if comm is not None else scaled
    if clip_norm is not None:
      agg = _clip(agg, clip_norm)
    outer_updates, outer_state = outer.update(agg, state.outer_state,
                                              state.anchor)
    anchor = optax.apply_updates(state.anchor, outer_updates)
    return _local.updates_to(anchor, params), dict(
        anchor=anchor, outer_state=outer_state, norm_mean=mean,
        norm_var=var, num_norms=num_norms, weight=weight,
        num_dropped=dropped, total_dropped=state.total_dropped + dropped)

  update_fn = _local.periodic_update(
      inner, sync_every, name='edit_diloco', sync_step=sync_step,
      fields=('anchor', 'outer_state', 'norm_mean', 'norm_var', 'num_norms',
              'weight', 'num_dropped', 'total_dropped'),
      varying=_local.varying_fn(comm))
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def edit_plan(sync_every: int) -> plan_lib.Plan:
  """The host-side plan of :func:`edit_diloco`: ``True`` on counts ``H - 1,
  2H - 1, ...``, else ``False`` (DiLoCo's phases)."""
  return plan_lib.Plan(plan_lib.every(
      _checks.positive_int(sync_every, 'sync_every')))


def edit_eval_params(state: EditState, params: optax.Params) -> Any:
  """The weights to evaluate: the outer parameters ``phi`` in params dtypes
  (equal on all workers)."""
  return _local.cast_like(state.anchor, params)


def edit_bytes(params: Any, dtype: Any = jnp.float32) -> int:
  """Bytes one worker sends per sync: its (weighted) pseudo-gradient at
  ``dtype`` plus its norm and keep flag (two fp32 scalars)."""
  return _local.pseudo_gradient_bytes(params, dtype) + 2 * 4
