"""Hierarchical DiLoCo: workers sync inside their group often, groups rarely.

Real deployments have two link speeds: fast inside a datacenter or region,
slow between them. Here the worker axis is split into groups of
``group_size`` consecutive workers. Every ``H1 = sync_every`` inner steps the
workers of a group average their pseudo-gradients and a *group* outer step
moves the group's anchor; every ``H2 = global_sync_every`` steps (a multiple
of ``H1``) the groups' anchors are averaged too and a *global* outer step
moves the global anchor, which every worker then starts from. Only the
global step sends bytes between groups.

The group average is a sum of ``G - 1`` point-to-point shifts inside each
group (``lax.ppermute``: ``jax.lax.psum`` has no ``axis_index_groups``
under ``vmap`` or ``shard_map``), so its collectives name only pairs of
workers of one group, which the compiled program shows. A shift moves the
whole payload: ``(G - 1) n`` bytes per worker against ``2 (G - 1) / G n`` for
a ring all-reduce, the same for ``G = 2``.

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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loc_opt import _checks
from loc_opt import compression
from loc_opt.outer import _local
from loc_opt.outer import plan as plan_lib

PHASES = (False, 'group', 'global')


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


def group_shifts(num_workers: int, group_size: int
                 ) -> list[list[tuple[int, int]]]:
  """The ``G - 1`` permutations whose sum with the own value is the group
  sum: shift ``s`` sends worker ``g G + i`` to worker ``g G + (i + s) % G``.
  """
  return [[(g + i, g + (i + s) % group_size)
           for g in range(0, num_workers, group_size)
           for i in range(group_size)]
          for s in range(1, group_size)]


def group_mean(tree: Any, comm: compression.Comm | None,
               group_size: int) -> Any:
  """The mean of ``tree`` over this worker's group (``group_size``
  consecutive workers), by ``G - 1`` point-to-point shifts."""
  if group_size == 1:
    return tree
  if comm is None:
    raise ValueError('a group mean needs an axis_name')
  m = comm.size()
  if m % group_size:
    raise ValueError(f'group_size={group_size} does not divide the '
                     f'{m} workers')
  total = tree
  for perm in group_shifts(m, group_size):
    total = jax.tree.map(jnp.add, total, comm.ppermute(tree, perm))
  return jax.tree.map(lambda t: t / group_size, total)


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
  it is the only collective that crosses groups. The group mean is fp32,
  by ``G - 1`` point-to-point shifts inside each group. The group outer
  state is kept across global syncs.

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
    group_outer: the group outer optimizer (default
      :func:`loc_opt.outer.nesterov_outer`).
    outer: the global outer optimizer (default
      :func:`loc_opt.outer.nesterov_outer`).
    axis_name: the worker axis; ``None`` for one worker (``G = 1``).
    anchor_dtype: the minimum precision of both anchors.
    codec: compress the global pseudo-gradients (as :func:`loc_opt.diloco`).
    codec_seed: seed of the codec's shared key (folded with the global
      sync index).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import optax, loc_opt
    >>> tx = loc_opt.outer.hierarchical_diloco(
    ...     optax.adamw(3e-3), sync_every=30, global_sync_every=60,
    ...     group_size=2)

  References:
    Kim et al., *HALoS: Hierarchical Asynchronous Local SGD over Slow
    Networks for Geo-Distributed Large Language Model Training*, 2025.
  """
  h1, h2 = _check_periods(sync_every, global_sync_every)
  group_size = _checks.positive_int(group_size, 'group_size')
  if axis_name is None and (group_size > 1 or codec is not None):
    raise ValueError('hierarchical_diloco with group_size > 1 or a codec '
                     'needs an axis_name')
  inner = optax.with_extra_args_support(inner)
  group_outer = _local.nesterov_outer() if group_outer is None else \
      group_outer
  outer = _local.nesterov_outer() if outer is None else outer
  compressor = None if codec is None else compression.as_compressor(codec)
  comm = compression.Comm(axis_name) if axis_name is not None else None
  varying = _local.varying_fn(comm)
  mean_fn = _local.identity if comm is None else comm.pmean

  def init_fields(anchor):
    return {'group_anchor': anchor,
            'group_outer_state': group_outer.init(anchor),
            'outer_state': outer.init(anchor),
            'codec_state': () if compressor is None else compressor.init(
                anchor),
            'num_global_syncs': jnp.zeros([], jnp.int32)}

  init_fn = _local.periodic_init(HierarchicalDilocoState, inner,
                                 anchor_dtype, init_fields)

  def global_step(state, group_anchor):
    delta, _, codec_state, _ = _local.guarded_mean(
        _local.pseudo_gradient(state.anchor, group_anchor),
        state.codec_state, None, compressor=compressor, comm=comm,
        seed=codec_seed, index=state.num_global_syncs, mean_fn=mean_fn)
    updates, outer_state = outer.update(delta, state.outer_state,
                                        state.anchor)
    anchor = optax.apply_updates(state.anchor, updates)
    return varying({'group_anchor': anchor, 'anchor': anchor,
                    'outer_state': outer_state, 'codec_state': codec_state,
                    'num_global_syncs': state.num_global_syncs + 1})

  def sync_step(state, params, local, phase):
    delta = group_mean(_local.pseudo_gradient(state.group_anchor, local),
                       comm, group_size)
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
    return _local.updates_to(new['group_anchor'], params), new

  update_fn = _local.periodic_update(
      inner, h1, name='hierarchical_diloco', sync_step=sync_step,
      fields=('group_anchor', 'group_outer_state', 'anchor', 'outer_state',
              'codec_state', 'num_global_syncs'),
      phase=_phase, varying=varying)
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def hierarchical_eval_params(state: HierarchicalDilocoState,
                             params: optax.Params) -> Any:
  """The weights to evaluate: the global anchor in params dtypes (the one
  model all workers share; after a global sync, their parameters)."""
  return _local.cast_like(state.anchor, params)
