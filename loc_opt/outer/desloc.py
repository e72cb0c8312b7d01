"""DES-LOC, Local Adam and MT-DAO: each state averaged on its own period.

Local Adam averages the parameters *and* both Adam moments over workers
every ``K`` steps; DiLoCo-style methods average parameters only and keep the
moments local. DES-LOC (desynced low communication) gives every state its
own sync period: parameters every ``K_x`` steps, the first moment every
``K_u``, the second every ``K_v`` (by default ``3 K_x`` and ``6 K_x``). With
every period finite the method keeps Local Adam's convergence guarantee at
half its traffic. MT-DAO runs the same scheme over an inner optimizer with
slow momenta (:mod:`loc_opt.inner.multi_timescale`).

Each step's *phase* (see :mod:`loc_opt.outer.plan`) is ``False`` (nothing
crosses workers) or the sorted tuple of what is averaged, e.g.
``('mu', 'params')``. By default the due quantities are averaged before the
step's moment update, as in the paper's algorithm (``average_at``), and
gradients are clipped coordinate-wise first (``clip_radius``).

References:
  Iacob et al., *DES-LOC: Desynced Low Communication Adaptive Optimizers
  for Training Foundation Models*, 2025.

  Iacob et al., *MT-DAO: Multi-Timescale Distributed Adaptive Optimizers
  with Local Updates*, 2025.
"""

from collections.abc import Callable, Mapping, Sequence
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loc_opt import _checks
from loc_opt import compression
from loc_opt.inner import multi_timescale
from loc_opt.outer import _local
from loc_opt.outer import plan as plan_lib
from loc_opt.outer._state_fields import check_fields
from loc_opt.outer._state_fields import find_state_field
from loc_opt.outer._state_fields import map_state_field

ArrayLike = jax.typing.ArrayLike

# The phase name of the parameter sync (state fields use their own names).
PARAMS = 'params'
# Default state periods, as multiples of the parameter period (Adam / ADOPT
# states; ``optax.contrib.adopt`` keeps ``ScaleByAdamState`` too).
DEFAULT_STATE_FACTORS = {'mu': 3, 'nu': 6}

Phase = bool | tuple[str, ...]
# Where in a step the due states are replaced by their worker means.
AVERAGE_AT = ('before_update', 'after_update')
# The default radius of the coordinate-wise gradient clip (see desloc).
DEFAULT_CLIP_RADIUS = 1.0


class DeslocState(NamedTuple):
  """State of :func:`desloc` (one worker's copy).

  Attributes:
    inner_state: the inner optimizer's state; the NamedTuple fields named in
      ``state_sync_every`` are averaged over workers on their periods.
    anchor: the parameters of the last parameter sync (the model to
      evaluate), a tree like the params in ``promote_types(param dtype,
      anchor_dtype)`` (fp32 by default).
    outer_state: the outer optimizer's state over ``anchor``; ``()`` for
      plain averaging.
    count: int32 scalar, inner steps taken.
    num_syncs: int32 scalar, parameter syncs done (a diagnostic).
  """

  inner_state: optax.OptState
  anchor: optax.Params
  outer_state: optax.OptState
  count: jax.Array
  num_syncs: jax.Array


def _periods(sync_every: int,
             state_sync_every: Mapping[str, int] | None) -> dict[str, int]:
  """``{name: period}`` for ``'params'`` and every synced state field."""
  k_x = _checks.positive_int(sync_every, 'sync_every', arrays=True)
  if state_sync_every is None:
    state_sync_every = {name: factor * k_x
                        for name, factor in DEFAULT_STATE_FACTORS.items()}
  periods = {PARAMS: k_x}
  for name, period in state_sync_every.items():
    if not isinstance(name, str) or name == PARAMS:
      raise ValueError(
          f'state_sync_every keys are state field names, got {name!r}')
    periods[name] = _checks.positive_int(
        period, f'state_sync_every[{name!r}]', arrays=True)
  return periods


def _phase_names(sync: Any, periods: Mapping[str, int]) -> tuple[str, ...]:
  """The names a static phase syncs (validated)."""
  if sync is False:
    return ()
  if isinstance(sync, (str, bool)) or not isinstance(sync, Sequence):
    raise ValueError(
        f'sync must be None, False or a tuple of names among '
        f'{sorted(periods)}, got {sync!r}')
  unknown = [name for name in sync if name not in periods]
  if unknown:
    raise ValueError(f'sync names {unknown}, not among {sorted(periods)}')
  return tuple(sorted(set(sync)))


def desloc_phase(count: int, periods: Mapping[str, int]) -> Phase:
  """The phase of the step after ``count`` inner steps (host side)."""
  due = tuple(sorted(name for name, period in periods.items()
                     if (count + 1) % period == 0))
  return due or False


def _mean_fn(comm: compression.Comm | None) -> Callable[[Any], Any]:
  """The mean over workers (each element sent once per worker on a mesh),
  or the identity for one worker."""
  return _local.identity if comm is None else comm.pmean


def _sync_fields(inner_state: Any, names: Sequence[str],
                 comm: compression.Comm | None) -> Any:
  """``inner_state`` with the fields ``names`` averaged over workers."""
  for name in names:
    inner_state = map_state_field(inner_state, name, _mean_fn(comm))
    inner_state = _local.varying_fn(comm)(inner_state)
  return inner_state


def _param_mean(outer: optax.GradientTransformation | None,
                comm: compression.Comm | None, state: DeslocState,
                local: optax.Params) -> tuple[Any, Any]:
  """The parameter sync of the workers' ``local`` parameters:
  ``(anchor, outer state)``, the mean (plain) or the outer step on the mean
  pseudo-gradient ``mean(anchor - local)``."""
  mean = _mean_fn(comm)
  if outer is None:
    anchor = mean(jax.tree.map(lambda a, x: x.astype(a.dtype), state.anchor,
                               local))
    return anchor, state.outer_state
  delta = mean(_local.pseudo_gradient(state.anchor, local))
  outer_updates, outer_state = outer.update(
      delta, state.outer_state, state.anchor)
  return optax.apply_updates(state.anchor, outer_updates), outer_state


def _clip(updates: optax.Updates, radius: ArrayLike | None) -> optax.Updates:
  """Each gradient coordinate clipped to ``[-radius, radius]``."""
  if radius is None:
    return updates
  return jax.tree.map(lambda g: jnp.clip(g, -radius, radius).astype(g.dtype),
                      updates)


class _Due:
  """What a step syncs: decided on device from ``count`` (one ``lax.cond``
  per synced quantity) or at trace time from a static phase."""

  def __init__(self, sync: Any, count: jax.Array,
               periods: Mapping[str, int], comm: compression.Comm | None):
    self.count, self.periods, self.comm = count, periods, comm
    self.names = None if sync is None else _phase_names(sync, periods)

  def _due(self, name: str) -> jax.Array:
    return (self.count + 1) % self.periods[name] == 0

  def states(self, inner_state: Any) -> Any:
    """``inner_state`` with each due field replaced by its worker mean."""
    fields = [name for name in sorted(self.periods) if name != PARAMS]
    if self.names is not None:
      return _sync_fields(
          inner_state, [n for n in self.names if n in fields], self.comm)
    for name in fields:
      inner_state = jax.lax.cond(
          self._due(name),
          lambda s, n=name: _sync_fields(s, (n,), self.comm),
          lambda s: s, inner_state)
    return inner_state

  def params(self, sync: Callable[[], Any], keep: Callable[[], Any]) -> Any:
    """``(sync(), 1)`` on a parameter-sync step, else ``(keep(), 0)`` (the
    outputs typed per-worker inside ``shard_map``; int32 flags)."""
    vary = _local.varying_fn(self.comm)

    def on_sync(_):
      return vary(sync()), jnp.ones([], jnp.int32)

    def on_keep(_):
      return vary(keep()), jnp.zeros([], jnp.int32)

    if self.names is not None:
      return on_sync(None) if PARAMS in self.names else on_keep(None)
    return jax.lax.cond(self._due(PARAMS), on_sync, on_keep, None)


def _step_after(inner_step, outer, comm, state, params, due):
  """``average_at='after_update'``: the inner step on the local states,
  then the due states replaced by their means and, on a parameter sync,
  the parameters after the inner update synced (DiLoCo's order).

  Returns ``(updates, inner state, anchor, outer state, synced)``.
  """
  inner_updates, inner_state = inner_step(state.inner_state, params)
  inner_state = due.states(inner_state)

  def sync():
    local = optax.apply_updates(params, inner_updates)
    anchor, outer_state = _param_mean(outer, comm, state, local)
    return _local.updates_to(anchor, params), anchor, outer_state

  (updates, anchor, outer_state), synced = due.params(
      sync, lambda: (inner_updates, state.anchor, state.outer_state))
  return updates, inner_state, anchor, outer_state, synced


def _step_before(inner_step, outer, comm, state, params, due):
  """``average_at='before_update'``: the due states replaced by their means
  and, on a parameter sync, the parameters synced, before the step; the
  inner step then updates the synced states with this worker's gradient
  (taken at its own parameters) and moves the synced parameters.

  Returns ``(updates, inner state, anchor, outer state, synced)``.
  """
  inner_state = due.states(state.inner_state)

  def sync():
    anchor, outer_state = _param_mean(outer, comm, state, params)
    return (_local.cast_like(anchor, params),
            _local.updates_to(anchor, params), anchor, outer_state)

  def keep():
    return (params, jax.tree.map(jnp.zeros_like, params), state.anchor,
            state.outer_state)

  (base, shift, anchor, outer_state), synced = due.params(sync, keep)
  inner_updates, inner_state = inner_step(inner_state, base)
  # theta + shift lands on the synced parameters, then the inner update.
  updates = jax.tree.map(lambda u, d: (u + d).astype(u.dtype), inner_updates,
                         shift)
  return updates, inner_state, anchor, outer_state, synced


def desloc(
    inner: optax.GradientTransformation,
    *,
    sync_every: int,
    state_sync_every: Mapping[str, int] | None = None,
    outer: optax.GradientTransformation | None = None,
    axis_name: str | None = 'worker',
    anchor_dtype: Any = jnp.float32,
    average_at: str = 'before_update',
    clip_radius: ArrayLike | None = DEFAULT_CLIP_RADIUS,
) -> optax.GradientTransformationExtraArgs:
  r"""DES-LOC: parameters and optimizer states averaged on their own periods.

  Every worker clips its gradient coordinate-wise,
  :math:`\hat g = \mathrm{clip}(g, -\rho, \rho)`, and runs ``inner`` on it.
  On the step after ``count`` inner steps (step :math:`t = count + 1`),
  each state ``s`` whose period is due (:math:`t \bmod K_s = 0`) is
  replaced by its mean over workers, and when the parameter period
  :math:`K_x` is due so are the parameters. By default
  (``average_at='before_update'``) this happens before the step, as in the
  paper's algorithm: with the first moment :math:`u`, the second :math:`v`
  and :math:`\bar s` the worker mean of ``s`` where due (``s`` itself
  otherwise),

  .. math::

    u \leftarrow \beta_1 \bar u + (1 - \beta_1) \hat g, \quad
    v \leftarrow \beta_2 \bar v + (1 - \beta_2) \hat g^2, \quad
    x \leftarrow \bar x - \gamma_t\, u / (\sqrt{v} + \epsilon),

  where :math:`\hat g` was taken at the worker's own :math:`x` and the
  parameter mean :math:`\bar x` is the anchor :math:`\phi` (plain
  averaging) or :math:`\phi + \mathrm{outer}(\operatorname{mean}(\phi -
  x))` with an outer optimizer; the inner update (weight decay included)
  sees :math:`\bar x`. With ``average_at='after_update'`` the step runs on
  the local states and parameters first and the due quantities are then
  replaced by their means, the parameters being those after the inner
  update, :math:`\theta' = \theta + u` (DiLoCo's sync, so that with no
  state synced and ``outer`` given this is :func:`loc_opt.diloco`); the
  next gradient is then taken at the averaged point.

  The returned update lands the parameters where the rule says, so
  ``optax.apply_updates`` stays the only way they change. State means are
  taken in each state's dtype; the parameter mean (or the pseudo-gradient
  mean) in the anchor dtype. On a mesh each element crosses workers once
  per worker (``loc_opt.compression.Comm``).

  With ``K_u = K_v = K_x`` this is Local Adam (:func:`local_adam`); with
  ``outer=optax.sgd(1.0)`` the parameter sync equals plain averaging. Every
  state that the convergence theory covers needs a finite period: fields of
  the inner state that are not named are never averaged (DiLoCo keeps them
  local).

  Which steps sync is decided on device from ``count`` with one ``lax.cond``
  per synced quantity, or at trace time with the keyword-only extra argument
  ``sync``: ``False`` traces an inner step with no collective, a tuple such
  as ``('mu', 'params')`` traces exactly those syncs. :func:`desloc_plan`
  gives the phase of every step on the host; both give the same numbers.

  Args:
    inner: the inner optimizer, e.g. ``optax.adamw(...)`` or
      ``optax.contrib.adopt(...)`` (both keep ``mu`` and ``nu``).
    sync_every: the parameter period :math:`K_x`, a positive int.
    state_sync_every: ``{field name: period}`` for the inner state fields to
      average, looked up in every NamedTuple of the inner state (all matches
      are averaged). Default ``{'mu': 3 K_x, 'nu': 6 K_x}``. Every period is
      a finite positive int.
    outer: the optimizer of the parameter sync, fed the averaged
      pseudo-gradient :math:`\operatorname{mean}(\phi - x)` (e.g.
      ``optax.sgd(0.7, momentum=0.9, nesterov=True)``); ``None`` for plain
      averaging.
    axis_name: the worker axis; ``None`` for one worker (no collectives).
    anchor_dtype: the minimum precision of the anchor, the parameter mean
      and the outer state (fp32 by default).
    average_at: ``'before_update'`` (default: the order of the paper's
      algorithm and of the spec, whose analysis averages the states the
      step reads) or ``'after_update'`` (DiLoCo's sync of the updated
      parameters; the only order of earlier loc_opt versions).
    clip_radius: :math:`\rho` of the coordinate-wise gradient clip the
      paper applies before the moments; the paper gives no value, 1.0 is
      ours. ``None`` turns the clip off (the gradients reach ``inner`` as
      they are).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Raises:
    ValueError: on a period that is not a positive int, an unknown
      ``average_at``, a ``clip_radius`` that is not positive, or (at
      ``init``) a field of ``state_sync_every`` that the inner state lacks.

  Example:
    >>> import optax
    >>> import loc_opt
    >>> tx = loc_opt.desloc(optax.adamw(3e-4, b1=0.95, b2=0.9999),
    ...                     sync_every=256)
    >>> plan = loc_opt.outer.desloc_plan(256)

  References:
    Iacob et al., *DES-LOC: Desynced Low Communication Adaptive Optimizers
    for Training Foundation Models*, 2025. https://arxiv.org/abs/2505.22549
  """
  _checks.transformation(inner, 'inner')
  _checks.transformation(outer, 'outer', optional=True)
  periods = _periods(sync_every, state_sync_every)
  fields = tuple(name for name in sorted(periods) if name != PARAMS)
  step_fn = {'before_update': _step_before, 'after_update': _step_after}[
      _checks.one_of(average_at, 'average_at', AVERAGE_AT)]
  if clip_radius is not None and not _checks.is_traced(clip_radius):
    _checks.positive_float(clip_radius, 'clip_radius')
  inner = optax.with_extra_args_support(inner)
  comm = None if axis_name is None else compression.Comm(axis_name)

  def init_fn(params):
    inner_state = inner.init(params)
    check_fields(inner_state, fields)
    anchor = _local.init_anchor(params, anchor_dtype)
    zero = jnp.zeros([], jnp.int32)
    return DeslocState(
        inner_state=inner_state,
        anchor=anchor,
        outer_state=() if outer is None else outer.init(anchor),
        count=zero,
        num_syncs=zero,
    )

  def update_fn(updates, state, params=None, *, sync=None, **extra_args):
    if params is None:
      raise ValueError('desloc needs params: call update(updates, state, '
                       'params)')
    check_fields(state.inner_state, fields)
    grads = _clip(updates, clip_radius)

    def inner_step(inner_state, at):
      return _local.inner_step(inner, 'desloc', grads, inner_state, at,
                               extra_args)

    new_updates, inner_state, anchor, outer_state, synced = step_fn(
        inner_step, outer, comm, state, params,
        _Due(sync, state.count, periods, comm))
    return new_updates, DeslocState(
        inner_state=inner_state,
        anchor=anchor,
        outer_state=outer_state,
        count=optax.safe_increment(state.count),
        num_syncs=state.num_syncs + synced,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def local_adam(
    inner: optax.GradientTransformation,
    *,
    sync_every: int,
    state_fields: Sequence[str] = ('mu', 'nu'),
    outer: optax.GradientTransformation | None = None,
    axis_name: str | None = 'worker',
    anchor_dtype: Any = jnp.float32,
    average_at: str = 'before_update',
    clip_radius: ArrayLike | None = DEFAULT_CLIP_RADIUS,
) -> optax.GradientTransformationExtraArgs:
  """Local Adam: parameters and all moments averaged every ``sync_every``.

  :func:`desloc` with every state on the parameter period: three payloads
  per sync, twice DES-LOC's default traffic.

  Args:
    inner: the inner optimizer (Adam, AdamW, ADOPT, ...).
    sync_every: the common period ``K``, a positive int.
    state_fields: the inner state fields to average with the parameters.
    outer: as in :func:`desloc` (``None``: plain averaging).
    axis_name: the worker axis; ``None`` for one worker.
    anchor_dtype: as in :func:`desloc`.
    average_at: as in :func:`desloc` (default ``'before_update'``).
    clip_radius: as in :func:`desloc` (``None``: no clip).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import optax
    >>> import loc_opt
    >>> tx = loc_opt.local_adam(optax.adam(1e-3), sync_every=32)

  References:
    Iacob et al., *DES-LOC: Desynced Low Communication Adaptive Optimizers
    for Training Foundation Models*, 2025 (Local Adam is its baseline).
  """
  _checks.transformation(inner, 'inner')
  _checks.transformation(outer, 'outer', optional=True)
  k = _checks.positive_int(sync_every, 'sync_every', arrays=True)
  return desloc(inner, sync_every=k,
                state_sync_every={name: k for name in state_fields},
                outer=outer, axis_name=axis_name, anchor_dtype=anchor_dtype,
                average_at=average_at, clip_radius=clip_radius)


def mt_dao(
    learning_rate: optax.ScalarOrSchedule,
    *,
    sync_every: int,
    slow_sync_every: int | None = None,
    nu_sync_every: int | None = None,
    slow_betas: Sequence[ArrayLike] = (0.995,),
    slow_weights: Sequence[ArrayLike] = (0.8,),
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-8,
    weight_decay: ArrayLike = 0.0,
    mask: Any = None,
    mu_dtype: Any = None,
    outer: optax.GradientTransformation | None = None,
    axis_name: str | None = 'worker',
    anchor_dtype: Any = jnp.float32,
    average_at: str = 'before_update',
    clip_radius: ArrayLike | None = DEFAULT_CLIP_RADIUS,
) -> optax.GradientTransformationExtraArgs:
  r"""MT-DAO: DES-LOC over multi-timescale Adam.

  :func:`desloc` of :func:`loc_opt.inner.multi_timescale.multi_timescale_adam`
  with the parameters synced every :math:`K_x` = ``sync_every`` steps, the
  slow momenta (field ``slow``, all on one period) every ``slow_sync_every``
  and the second moment (``nu``) every ``nu_sync_every``; both default to
  :math:`K_x` (the paper's :math:`K_x = K_1 = K_v = 32`).

  Args:
    learning_rate: the inner learning rate (scalar or schedule).
    sync_every: the parameter period :math:`K_x`.
    slow_sync_every: the period of the slow momenta (default ``sync_every``).
    nu_sync_every: the period of the second moment (default ``sync_every``).
    slow_betas: decays of the slow momenta.
    slow_weights: their mixing weights.
    b2: decay of the second moment.
    eps: added to the denominator.
    weight_decay: decoupled weight decay.
    mask: which leaves decay.
    mu_dtype: dtype of the slow momenta.
    outer: as in :func:`desloc` (``None``: plain averaging).
    axis_name: the worker axis; ``None`` for one worker.
    anchor_dtype: as in :func:`desloc`.
    average_at: as in :func:`desloc` (default ``'before_update'``).
    clip_radius: the coordinate-wise gradient clip (the MT-DAO rule clips
      :math:`\hat g = \mathrm{clip}(g)` too), as in :func:`desloc`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import loc_opt
    >>> tx = loc_opt.mt_dao(3e-4, sync_every=32, b2=0.9999)

  References:
    Iacob et al., *MT-DAO: Multi-Timescale Distributed Adaptive Optimizers
    with Local Updates*, 2025.
  """
  _checks.transformation(outer, 'outer', optional=True)
  inner = multi_timescale.multi_timescale_adam(
      learning_rate, slow_betas=slow_betas, slow_weights=slow_weights, b2=b2,
      eps=eps, weight_decay=weight_decay, mask=mask, mu_dtype=mu_dtype)
  k_x = _checks.positive_int(sync_every, 'sync_every', arrays=True)

  def period(value, name):
    return k_x if value is None else _checks.positive_int(value, name,
                                                          arrays=True)

  return desloc(
      inner,
      sync_every=k_x,
      state_sync_every={'slow': period(slow_sync_every, 'slow_sync_every'),
                        'nu': period(nu_sync_every, 'nu_sync_every')},
      outer=outer,
      axis_name=axis_name,
      anchor_dtype=anchor_dtype,
      average_at=average_at,
      clip_radius=clip_radius,
  )


def desloc_plan(
    sync_every: int, state_sync_every: Mapping[str, int] | None = None
) -> plan_lib.Plan:
  """The host-side plan of :func:`desloc` with the same periods.

  The phase of the step after ``count`` inner steps is the sorted tuple of
  the names (``'params'`` and state fields) whose period divides
  ``count + 1``, or ``False`` when none does.

  Args:
    sync_every: the parameter period, as given to :func:`desloc`.
    state_sync_every: the state periods, as given to :func:`desloc`
      (``None``: its defaults).

  Returns:
    A :class:`loc_opt.outer.plan.Plan`.

  Example:
    >>> from loc_opt import outer
    >>> plan = outer.desloc_plan(2)
    >>> [plan(c) for c in range(6)]
    [False, ('params',), False, ('params',), False, ('mu', 'params')]
  """
  periods = _periods(sync_every, state_sync_every)
  return plan_lib.Plan(lambda count: desloc_phase(count, periods),
                       inner=False)


def desloc_eval_params(state: DeslocState, params: optax.Params) -> Any:
  """The weights to evaluate: those of the last parameter sync (the mean of
  the workers, or the outer optimizer's anchor), in the params' dtypes.

  Between parameter syncs the workers' parameters drift apart; the anchor
  is the one model they share.
  """
  return _local.cast_like(state.anchor, params)


def _tree_bytes(tree: Any) -> int:
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


def desloc_phase_bytes(state: DeslocState, phase: Phase) -> int:
  """Bytes one worker sends in a step of ``phase``.

  The sum of the payloads of what the phase averages: ``'params'`` the
  anchor-dtype parameters (or pseudo-gradient), each state field its own
  leaves (all the NamedTuples that hold it). ``False`` sends nothing.

  Args:
    state: one worker's :class:`DeslocState`, or its abstract shapes
      (``jax.eval_shape(tx.init, params)``).
    phase: a phase of :func:`desloc_plan`.

  Returns:
    Bytes per worker per step of that phase (each element sent once, as
    ``loc_opt.compression.Comm`` does on a mesh).
  """
  if phase is False:
    return 0
  total = 0
  for name in sorted(set(phase)):
    if name == PARAMS:
      total += _tree_bytes(state.anchor)
    else:
      found = find_state_field(state.inner_state, name)
      if not found:
        raise ValueError(f'phase names {name!r}, which the inner state lacks')
      total += _tree_bytes(found)
  return total
