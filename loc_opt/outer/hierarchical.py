"""Hierarchical DiLoCo: workers sync inside their group often, groups rarely.

Real deployments have two link speeds: fast inside a datacenter or region,
slow between them. Here the worker axis is split into groups of
``group_size`` consecutive workers. Every ``H1 = sync_every`` inner steps the
workers of a group average their pseudo-gradients and a *group* outer step
moves the group's anchor; every ``H2 = global_sync_every`` steps (a multiple
of ``H1``) the groups' anchors are averaged too and a *global* outer step
moves the global anchor, which every worker then starts from. Only the
global step sends bytes between groups.

The group average is gathered by ``G - 1`` point-to-point shifts inside
each group (``lax.ppermute``: ``jax.lax.psum`` has no ``axis_index_groups``
under ``vmap`` or ``shard_map``; see
:class:`loc_opt.compression.GroupComm`), so its collectives name only pairs
of workers of one group, which the compiled program shows. A shift moves the
whole payload: ``(G - 1) n`` bytes per worker against ``2 (G - 1) / G n`` for
a ring all-reduce, the same for ``G = 2``. With a ``group_codec`` the shifts
move the encoded payloads, ``(G - 1)`` codec payloads per worker, and every
member decodes all of them (its own too) in the members' order, so the
members of a group hold bit-identical means; optional error feedback keeps
each worker's residual in ``group_codec_state``.

References:
  Kim, Kim, Lee, Jeon, Kim, *HALoS: Hierarchical Asynchronous Local SGD over
  Slow Networks for Geo-Distributed Large Language Model Training*, ICML
  2025. https://arxiv.org/abs/2506.04531

  Therien et al., *MuLoCo: Muon is a practical inner optimizer for DiLoCo*,
  2025 (its code's TreeLoCo: a tree of DiLoCo reductions).
  https://arxiv.org/abs/2505.23725

  Douillard et al., *DiLoCo: Distributed Low-Communication Training of
  Language Models*, 2023.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loc_opt import _checks
from loc_opt import compression
from loc_opt.outer import _local
from loc_opt.outer import plan as plan_lib

PHASES = (False, 'group', 'global')
GLOBAL_EXCHANGES = ('all', 'representatives')
# The defaults of both levels, shared with the trainer
# (``loc_opt.train.hierarchy``, ``configs/diloco_lm.py``): the group step
# is DiLoCo's outer Nesterov step, the global step a plain merge (SGD with
# rate 1, no momentum: the group anchors' mean), so momentum is not
# stacked twice.
GROUP_LEARNING_RATE = 0.7
GROUP_MOMENTUM = 0.9
GLOBAL_LEARNING_RATE = 1.0
GLOBAL_MOMENTUM = 0.0


def global_outer(learning_rate: float = GLOBAL_LEARNING_RATE,
                 momentum: float = GLOBAL_MOMENTUM
                 ) -> optax.GradientTransformation:
  """The global outer optimizer: SGD at ``learning_rate`` (a merge at the
  default 1.0), with Nesterov momentum when ``momentum > 0``."""
  if not momentum:
    return optax.sgd(learning_rate)
  return _local.nesterov_outer(learning_rate, momentum)


class HierarchicalDilocoState(NamedTuple):
  """State of :func:`hierarchical_diloco` (one worker's copy).

  Attributes:
    inner_state: the inner optimizer's state, never averaged or reset.
    group_anchor: the group's outer parameters (params tree, fp32 or wider;
      equal on the workers of a group).
    group_outer_state: the group outer optimizer's state, over
      ``group_anchor`` (kept across global syncs).
    anchor: the global outer parameters (equal on every worker).
    outer_state: the global outer optimizer's state, over ``anchor``.
    count: int32 scalar, inner steps taken.
    steps_since_sync: int32 scalar, inner steps since the last (group or
      global) sync.
    num_syncs: int32 scalar, syncs of either level.
    num_global_syncs: int32 scalar, global syncs.
    codec_state: the global codec's per-worker state; ``()`` without one.
    group_codec_state: the group codec's per-worker state (with error
      feedback, ``ErrorFeedbackState(inner, error)``, ``error`` a float32
      params tree); ``()`` without one.
  """

  inner_state: optax.OptState
  group_anchor: optax.Params
  group_outer_state: optax.OptState
  anchor: optax.Params
  outer_state: optax.OptState
  count: jax.Array
  steps_since_sync: jax.Array
  num_syncs: jax.Array
  num_global_syncs: jax.Array
  codec_state: Any = ()
  group_codec_state: Any = ()


group_shifts = compression.group_shifts

# Folded into the codec seed's key for the group level's keys, a stream
# apart from the global level's (which folds the global sync index in).
GROUP_STREAM = 2**31 - 1


def as_group_comm(comm: compression.Comm, group_size: int
                  ) -> compression.GroupComm:
  """``comm``'s collectives over groups of ``group_size`` workers."""
  return compression.GroupComm(axis_name=comm.axis_name,
                               spread_over=comm.spread_over,
                               group_size=group_size)


def group_mean(tree: Any, comm: compression.Comm | None,
               group_size: int) -> Any:
  """The fp32 (or the tree's dtypes) mean of ``tree`` over this worker's
  group (``group_size`` consecutive workers), by ``G - 1`` point-to-point
  shifts, summed in the members' order (bit-identical on every member)."""
  if group_size == 1:
    return tree
  if comm is None:
    raise ValueError('a group mean needs an axis_name')
  return as_group_comm(comm, group_size).pmean(tree)


def group_codec_mean(delta: Any, codec_state: Any,
                     compressor: compression.Compressor,
                     comm: compression.Comm, group_size: int, seed: int,
                     index: jax.Array) -> tuple[Any, Any]:
  """The mean of ``delta`` over this worker's group through
  ``compressor``: the encoded payloads cross by ``G - 1`` shifts and every
  member decodes all of them, its own included.

  The key, the same on every worker, is ``fold_in(fold_in(key(seed),
  GROUP_STREAM), index)``; codecs with ``randomness='per_worker'`` fold in
  the worker's index on the whole axis, ``'shared'`` ones decode with it.

  Returns:
    ``(mean, codec_state)``; the mean in ``delta``'s dtypes.
  """
  key = jax.random.fold_in(
      jax.random.fold_in(jax.random.key(seed), GROUP_STREAM), index)
  group_comm = as_group_comm(comm, group_size)
  mean, _, codec_state = compressor.mean(delta, codec_state, group_comm, key)
  mean = jax.tree.map(lambda m, d: m.astype(d.dtype), mean, delta)
  return mean, comm.varying(codec_state)


def group_compressor(group_codec: compression.Scheme,
                      group_error_feedback: str, group_ef_decay: float
                      ) -> compression.Compressor | None:
  """The group level's compressor from :func:`hierarchical_diloco`'s
  ``group_codec``, ``group_error_feedback`` and ``group_ef_decay``
  (``None``: the fp32 mean); raises ``ValueError`` for a bad one."""
  if group_codec is None:
    if group_error_feedback != 'none':
      raise ValueError(f'group_error_feedback={group_error_feedback!r} '
                       'needs a group_codec (the fp32 group mean loses '
                       'nothing to feed back)')
    return None
  return compression.build_compressor(
      compression.as_compressor(group_codec, field='group_codec'),
      error_feedback=group_error_feedback, ef_decay=group_ef_decay)


def hierarchical_plan(sync_every: int, global_sync_every: int
                      ) -> plan_lib.Plan:
  """The phases of :func:`hierarchical_diloco`: ``'global'`` on the last
  step of every ``H2`` steps, ``'group'`` on the other last steps of every
  ``H1``, else ``False`` (inner)."""
  h1, h2 = _check_periods(sync_every, global_sync_every)

  def phase(count):
    if (count + 1) % h2 == 0:
      return 'global'
    return 'group' if (count + 1) % h1 == 0 else False

  return plan_lib.Plan(phase)


def _check_periods(sync_every, global_sync_every) -> tuple[int, int]:
  h1 = _checks.positive_int(sync_every, 'sync_every')
  h2 = _checks.positive_int(global_sync_every, 'global_sync_every')
  if h2 % h1:
    raise ValueError(f'global_sync_every={h2} must be a multiple of '
                     f'sync_every={h1}')
  return h1, h2


def _phase(sync: Any) -> tuple[Any, Any]:
  if sync not in (None,) + PHASES:
    raise ValueError(f'sync must be None or one of {PHASES}, got {sync!r}')
  if sync is None:
    return None, None
  return bool(sync), sync


def _init(compressor: compression.Compressor | None, anchor: Any) -> Any:
  return () if compressor is None else compressor.init(anchor)


def _group_delta(state: HierarchicalDilocoState, local: optax.Params, *,
                 compressor: compression.Compressor | None,
                 comm: compression.Comm | None, group_size: int, seed: int
                 ) -> tuple[Any, Any]:
  """The group's mean pseudo-gradient (fp32, or through ``compressor``
  keyed by the sync index) and the new group codec state."""
  delta = _local.pseudo_gradient(state.group_anchor, local)
  if compressor is None:
    return group_mean(delta, comm, group_size), state.group_codec_state
  return group_codec_mean(delta, state.group_codec_state, compressor, comm,
                          group_size, seed, state.num_syncs)


def representative_shifts(num_workers: int, group_size: int
                          ) -> list[list[tuple[int, int]]]:
  """The ``R - 1`` permutations (``R = M / G`` groups) that exchange the
  groups' representatives (the first worker of each group): shift ``s``
  sends worker ``g G`` to ``((g + s) mod R) G``."""
  r = num_workers // group_size
  return [[(g * group_size, ((g + s) % r) * group_size) for g in range(r)]
          for s in range(1, r)]


def _partial_ppermute(comm: compression.Comm, tree: Any,
                      perm: list[tuple[int, int]], num_workers: int) -> Any:
  """``comm.ppermute`` with pairs for some workers only (the others
  receive zeros). Under ``vmap``, whose ``ppermute`` takes only a
  permutation of the whole axis, the other workers keep their own value
  (a copy, no transfer) and receive zeros after it."""
  mesh = jax.sharding.get_abstract_mesh()
  if comm.axis_name in (getattr(mesh, 'manual_axes', ()) or ()):
    return comm.ppermute(tree, perm)
  targets = {d for _, d in perm}
  sources = {s for s, _ in perm}
  rest = [i for i in range(num_workers) if i not in sources]
  idle = [i for i in range(num_workers) if i not in targets]
  full = list(perm) + list(zip(rest, idle))
  out = comm.ppermute(tree, full)
  hit = jnp.isin(comm.index(), jnp.asarray(sorted(targets)))
  return jax.tree.map(lambda x: jnp.where(hit, x, jnp.zeros_like(x)), out)


def representatives_mean(tree: Any, comm: compression.Comm,
                         group_size: int) -> Any:
  """TreeLoCo's cross-group mean: the mean over groups of ``tree`` (equal
  on the members of a group), exchanged among the groups' first workers
  only (``R - 1`` point-to-point shifts, so each representative sends
  ``(R - 1)`` copies and no other worker sends anything across groups),
  summed in the groups' order (bit-identical on every representative),
  then sent from each representative to its ``G - 1`` members (shifts
  inside the group). Non-finite groups are left out (a count travels
  with the values); with none finite the mean is 0."""
  m = jax.lax.axis_size(comm.bound_axis)
  if m % group_size:
    raise ValueError(f'group_size={group_size} does not divide the {m} '
                     'workers')
  r = m // group_size
  ok = _local.all_finite(tree)
  payload = (jax.tree.map(lambda x: jnp.where(ok, x, jnp.zeros_like(x)),
                          tree), ok.astype(jnp.float32))
  received = [payload] + [_partial_ppermute(comm, payload, perm, m)
                          for perm in representative_shifts(m, group_size)]
  group = comm.index() // group_size
  # received[s] came from group (g - s) mod R: row j is received[(g-j) % R]
  order = (group - jnp.arange(r)) % r

  def total(*xs):
    rows = jnp.stack(xs)[order]
    out = rows[0]
    for j in range(1, r):
      out = out + rows[j]
    return out

  summed, count = jax.tree.map(total, *received)
  inv = jnp.where(count > 0, 1. / jnp.maximum(count, 1.), 0.)
  mean = jax.tree.map(lambda x: x * inv.astype(x.dtype), summed)
  if group_size == 1:
    return mean
  copies = [mean] + [_partial_ppermute(
      comm, mean, [(g * group_size, g * group_size + j) for g in range(r)], m)
                     for j in range(1, group_size)]
  member = comm.index() % group_size
  return jax.tree.map(lambda *xs: jnp.stack(xs)[member], *copies)


def _global_step(state: HierarchicalDilocoState, group_anchor: Any, *,
                 outer: optax.GradientTransformation,
                 compressor: compression.Compressor | None,
                 comm: compression.Comm | None, seed: int,
                 exchange: str = 'all', group_size: int = 1
                 ) -> dict[str, Any]:
  """The global sync's new fields: the groups' anchors merged (mean of
  ``phi - phi_g`` over every worker, through ``compressor`` if given, with
  DiLoCo's guard against non-finite workers; or, with ``exchange=
  'representatives'``, over the groups' first workers only) and the global
  outer step."""
  delta = _local.pseudo_gradient(state.anchor, group_anchor)
  if exchange == 'representatives' and comm is not None:
    delta, codec_state = representatives_mean(delta, comm, group_size), \
        state.codec_state
  else:
    delta, _, codec_state, _ = _local.guarded_mean(
        delta, state.codec_state, None, compressor=compressor, comm=comm,
        seed=seed, index=state.num_global_syncs,
        mean_fn=_local.identity if comm is None else comm.pmean)
  updates, outer_state = outer.update(delta, state.outer_state, state.anchor)
  anchor = optax.apply_updates(state.anchor, updates)
  return _local.varying_fn(comm)(
      {'group_anchor': anchor, 'anchor': anchor, 'outer_state': outer_state,
       'codec_state': codec_state,
       'num_global_syncs': state.num_global_syncs + 1})


def _check_exchange(global_exchange: str, axis_name: str | None,
                    group_size: int, codec: Any, group_codec: Any) -> None:
  """Refuses exchanges that :func:`hierarchical_diloco` cannot run."""
  _checks.one_of(global_exchange, 'global_exchange', GLOBAL_EXCHANGES)
  if global_exchange == 'representatives' and codec is not None:
    raise ValueError("hierarchical_diloco(global_exchange='representatives')"
                     ' sends the fp32 group deltas between representatives; '
                     'it takes no global codec (use group_codec inside '
                     "groups, or global_exchange='all')")
  if axis_name is None and (group_size > 1 or codec is not None
                            or group_codec is not None):
    raise ValueError('hierarchical_diloco with group_size > 1 or a codec '
                     'needs an axis_name')


def hierarchical_diloco(
    inner: optax.GradientTransformation,
    *,
    sync_every: int,
    global_sync_every: int,
    group_size: int,
    group_outer: optax.GradientTransformation | None = None,
    outer: optax.GradientTransformation | None = None,
    axis_name: str | None = 'worker',
    anchor_dtype: Any = jnp.float32,
    codec: compression.Scheme = None,
    codec_seed: int = 0,
    group_codec: compression.Scheme = None,
    group_error_feedback: str = 'none',
    group_ef_decay: float = 1.0,
    global_exchange: str = 'all',
) -> optax.GradientTransformationExtraArgs:
  r"""Two-level DiLoCo over groups of workers.

  Every ``H1 = sync_every`` inner steps, after the inner update
  ``theta' = theta + u``, the workers of group ``g`` take

  .. math::

    \Delta_g = \operatorname{mean}_{w \in g}(\phi_g - \theta'_w), \quad
    \phi_g \leftarrow \phi_g + \mathrm{group\_outer}(\Delta_g), \quad
    \theta \leftarrow \phi_g ,

  and every ``H2 = global_sync_every`` steps (a multiple of ``H1``; that
  step makes the group step first)

  .. math::

    \Delta = \operatorname{mean}_{g}(\phi - \phi_g), \quad
    \phi \leftarrow \phi + \mathrm{outer}(\Delta), \quad
    \phi_g \leftarrow \phi, \quad \theta \leftarrow \phi .

  The global mean is an all-reduce over the whole worker axis (each worker
  of a group sends the same ``phi - phi_g``), through ``codec`` if given;
  it is the only collective that crosses groups. With
  ``global_exchange='representatives'`` (TreeLoCo's one representative per
  group, after the vestiges in MuLoCo's code) only the first worker of
  each group sends ``phi - phi_g`` across groups, by ``R - 1``
  point-to-point shifts among the ``R = M / G`` representatives
  (:func:`representatives_mean`), and forwards the mean to its members
  inside the group: ``R (R - 1) n`` bytes cross groups per global sync
  instead of the all-reduce's ``M n`` operands, ``G`` times fewer at
  ``R = 2`` (read from the compiled program in the tests). The group mean is by
  ``G - 1`` point-to-point shifts inside each group: of the fp32
  pseudo-gradients, or, with ``group_codec`` ``C``, of their payloads,

  .. math::

    p_w = \phi_g - \theta'_w + e_w, \quad
    \Delta_g = \operatorname{mean}_{w \in g} C(p_w), \quad
    e_w \leftarrow \beta \, (p_w - C(p_w)),

  where ``C(p)`` is ``p`` encoded and decoded, and ``e_w = 0`` without
  error feedback (``group_error_feedback='ef'``, ``beta =
  group_ef_decay``). Every member decodes every payload, its own too, and
  sums them in the members' order: all members hold the same bits. The
  group outer state is kept across global syncs.

  With ``group_size = M`` and ``group_outer = optax.sgd(1.0)`` the group
  step is parameter averaging and the global step at ``H2 = H1`` is
  :func:`loc_opt.diloco` with ``H = H1``; with ``group_size = 1`` and
  ``group_outer = optax.sgd(1.0)`` it is :func:`loc_opt.diloco` with
  ``H = H2``.

  ``update(..., sync=None)`` decides the phase on device from the counters
  (``lax.cond``); a loop may pass the static phase
  ``hierarchical_plan(H1, H2)(count)`` (``False``, ``'group'`` or
  ``'global'``) so that each compiles to its own program.

  Args:
    inner: the inner optimizer.
    sync_every: ``H1``, inner steps between group syncs (an int).
    global_sync_every: ``H2``, inner steps between global syncs, a
      multiple of ``H1``.
    group_size: ``G``, consecutive workers per group; divides the worker
      count.
    group_outer: the group outer optimizer (default Nesterov SGD, rate
      :data:`GROUP_LEARNING_RATE` 0.7, momentum :data:`GROUP_MOMENTUM` 0.9).
    outer: the global outer optimizer (default :func:`global_outer`: SGD
      with rate 1 and no momentum, a plain merge of the group anchors; the
      trainer's default too).
    axis_name: the worker axis; ``None`` for one worker (``G = 1``).
    anchor_dtype: the minimum precision of both anchors.
    codec: compress the global pseudo-gradients (as :func:`loc_opt.diloco`).
    codec_seed: seed of the codecs' shared keys (folded with the global
      sync index; for ``group_codec``, with :data:`GROUP_STREAM` and the
      sync index ``num_syncs``).
    group_codec: compress the group pseudo-gradients: a codec or compressor
      of :mod:`loc_opt.compression`, a name (``'int8'``, ``'fp4_e3m0'``,
      ``'statistical'``) or ``(name, kwargs)``; ``None``: fp32. Per-tensor
      codecs encode each leaf on its own, padded to their block size.
      Codecs that need keys (``randomness='per_worker'`` or ``'shared'``)
      get them as described under ``codec_seed``; ``reduce='two_phase'``
      codecs are refused when traced (no all-to-all inside groups).
    group_error_feedback: ``'none'``, ``'ef'`` (classic error feedback, one
      float32 residual per worker in ``group_codec_state``), ``'ef21'`` or
      ``'econtrol'``; needs ``group_codec``.
    group_ef_decay: ``beta`` of ``'ef'``, in ``[0, 1]``.
    global_exchange: ``'all'`` (the all-reduce over every worker) or
      ``'representatives'`` (TreeLoCo: the groups' first workers only; no
      global ``codec``).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import optax, loc_opt
    >>> tx = loc_opt.outer.hierarchical_diloco(
    ...     optax.adamw(3e-3), sync_every=30, global_sync_every=60,
    ...     group_size=2)
    >>> tx = loc_opt.outer.hierarchical_diloco(
    ...     optax.adamw(3e-3), sync_every=30, global_sync_every=60,
    ...     group_size=2, group_codec='int8', group_error_feedback='ef',
    ...     codec=('statistical', {'bits': 2}))

  References:
    Kim et al., *HALoS: Hierarchical Asynchronous Local SGD over Slow
    Networks for Geo-Distributed Large Language Model Training*, 2025.
  """
  _checks.transformation(inner, 'inner')
  _checks.transformation(outer, 'outer', optional=True)
  _checks.transformation(group_outer, 'group_outer', optional=True)
  h1, h2 = _check_periods(sync_every, global_sync_every)
  group_size = _checks.positive_int(group_size, 'group_size')
  _check_exchange(global_exchange, axis_name, group_size, codec, group_codec)
  inner = optax.with_extra_args_support(inner)
  group_outer = (_local.nesterov_outer(GROUP_LEARNING_RATE, GROUP_MOMENTUM)
                 if group_outer is None else group_outer)
  outer = global_outer() if outer is None else outer
  compressor = None if codec is None else compression.as_compressor(codec)
  group_scheme = group_compressor(group_codec, group_error_feedback,
                                 group_ef_decay)
  comm = compression.Comm(axis_name) if axis_name is not None else None
  varying = _local.varying_fn(comm)

  def init_fields(anchor):
    return {'group_anchor': anchor,
            'group_outer_state': group_outer.init(anchor),
            'outer_state': outer.init(anchor),
            'codec_state': _init(compressor, anchor),
            'group_codec_state': _init(group_scheme, anchor),
            'num_global_syncs': jnp.zeros([], jnp.int32)}

  init_fn = _local.periodic_init(HierarchicalDilocoState, inner,
                                 anchor_dtype, init_fields)

  global_step = functools.partial(
      _global_step, outer=outer, compressor=compressor, comm=comm,
      seed=codec_seed, exchange=global_exchange, group_size=group_size)

  def sync_step(state, params, local, phase):
    delta, group_codec_state = _group_delta(
        state, local, compressor=group_scheme, comm=comm,
        group_size=group_size, seed=codec_seed)
    updates, group_outer_state = group_outer.update(
        delta, state.group_outer_state, state.group_anchor)
    group_anchor = optax.apply_updates(state.group_anchor, updates)
    kept = varying({'group_anchor': group_anchor, 'anchor': state.anchor,
                    'outer_state': state.outer_state,
                    'codec_state': state.codec_state,
                    'num_global_syncs': state.num_global_syncs})
    if phase == 'group':
      new = kept
    elif phase == 'global':
      new = global_step(state, group_anchor)
    else:  # decided on device: every (H2 / H1)-th sync is global
      due = (state.num_syncs + 1) % (h2 // h1) == 0
      new = jax.lax.cond(due, lambda: global_step(state, group_anchor),
                         lambda: kept)
    new['group_outer_state'] = group_outer_state
    new['group_codec_state'] = group_codec_state
    return _local.updates_to(new['group_anchor'], params), new

  update_fn = _local.periodic_update(
      inner, h1, name='hierarchical_diloco', sync_step=sync_step,
      fields=('group_anchor', 'group_outer_state', 'anchor', 'outer_state',
              'codec_state', 'num_global_syncs', 'group_codec_state'),
      phase=_phase, varying=varying)
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def hierarchical_eval_params(state: HierarchicalDilocoState,
                             params: optax.Params) -> Any:
  """The weights to evaluate: the global anchor in params dtypes (the one
  model all workers share; after a global sync, their parameters)."""
  return _local.cast_like(state.anchor, params)
