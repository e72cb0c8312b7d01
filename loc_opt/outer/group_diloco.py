"""DiLoCo with a parameter group on a sync period of its own.

The parameters whose path matches ``pattern`` (by default a
Mixture-of-Experts LM's routers, ``loc_opt.models.moe.ROUTER_PATTERN``)
form a *group* with its own sync period ``H_g`` and its own outer
optimizer; the other parameters are synced every ``H`` inner steps by the
main outer optimizer, exactly as :func:`loc_opt.outer.diloco` syncs them.
Each part keeps its own slice of the anchor: on a step where a part is due
the workers average that part's pseudo-gradient ``anchor - local``, its
outer optimizer moves its anchor, and the workers' copies of the part are
reset to it; the other part keeps its local values (the inner update).

A step's *phase* (``loc_opt.outer.plan``) is ``False`` (nothing crosses
workers) or the sorted tuple of the parts it syncs, ``('group',)``,
``('main',)`` or ``('group', 'main')``, so the trainer compiles one
program per phase and each moves exactly its part.

With ``H_g = H`` and the same outer optimizer for both parts the method is
DiLoCo (the test checks it).

References:
  Douillard et al., *DiLoCo: Distributed Low-Communication Training of
  Language Models*, 2023. MaxText's DiLoCo trainer, which gives the
  router of a Mixture-of-Experts model a sync period of its own.
"""

from collections.abc import Callable
import functools
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loc_opt import _checks
from loc_opt import compression
from loc_opt.outer import _local
from loc_opt.outer import plan as plan_lib

MAIN, GROUP = 'main', 'group'
# The routers of loc_opt.models.moe (the same expression; outer does not
# import models).
ROUTER_PATTERN = r'(^|/)router/'
Phase = bool | tuple[str, ...]


class GroupDilocoState(NamedTuple):
  """State of :func:`group_diloco` (one worker's copy).

  Attributes:
    inner_state: the inner optimizer's state, never averaged or reset.
    anchor: the outer parameters (a tree like the params, at least
      ``anchor_dtype``).
    outer_state: ``(main, group)``: each outer optimizer's state over the
      list of its part's anchor leaves (tree-flatten order).
    count: int32 scalar, inner steps taken.
    num_syncs: int32 ``[2]``, syncs of the main part and of the group.
  """

  inner_state: optax.OptState
  anchor: optax.Params
  outer_state: tuple[optax.OptState, optax.OptState]
  count: jax.Array
  num_syncs: jax.Array


def group_mask(params: Any, pattern: str = ROUTER_PATTERN) -> list[bool]:
  """Per leaf (tree-flatten order): whether its path (keys joined by
  ``'/'``) matches ``pattern``."""
  regex = re.compile(pattern)
  return [bool(regex.search(jax.tree_util.keystr(p, simple=True,
                                                  separator='/')))
          for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def group_diloco_phase(count: int, sync_every: int, group_sync_every: int
                       ) -> Phase:
  """The phase of the step after ``count`` inner steps (host side)."""
  due = [name for name, h in ((GROUP, group_sync_every), (MAIN, sync_every))
         if (count + 1) % h == 0]
  return tuple(due) if due else False


def group_diloco_plan(sync_every: int, group_sync_every: int
                      ) -> plan_lib.Plan:
  """The host-side plan of :func:`group_diloco`."""
  _checks.positive_int(sync_every, 'sync_every')
  _checks.positive_int(group_sync_every, 'group_sync_every')
  return plan_lib.Plan(lambda count: group_diloco_phase(
      count, sync_every, group_sync_every))


def _check_phase(sync: Any) -> tuple[str, ...] | None:
  if sync is None:
    return None
  if sync is False:
    return ()
  if (not isinstance(sync, tuple) or not sync
      or not set(sync) <= {MAIN, GROUP}):
    raise ValueError(f'sync must be None, False or a tuple of {MAIN!r} / '
                     f'{GROUP!r}, got {sync!r}')
  return sync


def _mean_fn(reduce_fn, axis_name):
  """The mean over workers: ``reduce_fn``, else ``lax.pmean`` over
  ``axis_name``, else (one worker) the identity."""
  if reduce_fn is not None:
    return reduce_fn
  if axis_name is None:
    return _local.identity

  def mean_fn(tree):
    axis = _checks.axis_bound(axis_name, 'loc_opt.outer.group_diloco')
    return jax.lax.pmean(tree, axis)

  return mean_fn


def _part_step(sync, due, count, period, varying, anchor, outer_state,
               params, inner_updates):
  """One part's step: ``(synced, (anchor, outer_state, updates))``.

  ``due``: a Python bool (static phase) or None (decided on device from
  ``count`` and ``period``). On a sync ``sync(anchor, outer_state, local)``
  gives the part's new anchor and outer state and the update lands on the
  anchor; otherwise the part keeps them and its inner update.
  """
  local = optax.apply_updates(params, inner_updates)
  old = (anchor, outer_state, inner_updates)

  def on_sync():
    new_anchor, new_outer = sync(anchor, outer_state, local)
    return varying((new_anchor, new_outer,
                    _local.updates_to(new_anchor, params)))

  if due is None:
    due = (count + 1) % period == 0
    return due, jax.lax.cond(due, on_sync, lambda: varying(old))
  if due:
    return jnp.ones([], bool), on_sync()
  return jnp.zeros([], bool), old


def group_diloco(
    inner: optax.GradientTransformation,
    *,
    sync_every: int,
    group_sync_every: int,
    pattern: str = ROUTER_PATTERN,
    outer: optax.GradientTransformation | None = None,
    group_outer: optax.GradientTransformation | None = None,
    axis_name: str | None = 'worker',
    anchor_dtype: Any = jnp.float32,
    reduce_fn: Callable[[Any], Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """DiLoCo whose ``pattern`` leaves sync every ``group_sync_every`` steps.

  Args:
    inner: the inner optimizer.
    sync_every: ``H``, the period of the other parameters.
    group_sync_every: ``H_g``, the group's period.
    pattern: regular expression of the group's leaf paths (the routers by
      default); a leaf matches when ``re.search`` finds it in its path
      (keys joined by ``'/'``). A pattern that matches no leaf leaves the
      group empty: the method is then DiLoCo, and the group's phases move
      nothing (a dense model under the default pattern).
    outer: the main outer optimizer (default
      :func:`loc_opt.outer._local.nesterov_outer`).
    group_outer: the group's outer optimizer (default: as ``outer``'s
      default).
    axis_name: the worker axis (``None``: one worker).
    anchor_dtype: the minimum precision of the anchor.
    reduce_fn: the mean over workers (default ``lax.pmean`` over
      ``axis_name``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes the
    static ``sync`` phase (:func:`group_diloco_plan`), or decides it on
    device from the count when ``sync=None``.
  """
  _checks.transformation(inner, 'inner')
  _checks.transformation(outer, 'outer', optional=True)
  _checks.transformation(group_outer, 'group_outer', optional=True)
  _checks.positive_int(sync_every, 'sync_every')
  _checks.positive_int(group_sync_every, 'group_sync_every')
  re.compile(pattern)
  inner = optax.with_extra_args_support(inner)
  txs = {MAIN: _local.nesterov_outer() if outer is None else outer,
         GROUP: _local.nesterov_outer() if group_outer is None
         else group_outer}
  periods = {MAIN: sync_every, GROUP: group_sync_every}
  comm = compression.Comm(axis_name) if axis_name is not None else None
  varying = _local.varying_fn(comm)
  mean_fn = _mean_fn(reduce_fn, axis_name)

  def parts(params):
    mask = group_mask(params, pattern)
    return {MAIN: [i for i, m in enumerate(mask) if not m],
            GROUP: [i for i, m in enumerate(mask) if m]}

  def init_fn(params):
    anchor = _local.init_anchor(params, anchor_dtype)
    leaves = jax.tree.leaves(anchor)
    index = parts(params)
    outer_state = tuple(txs[n].init([leaves[i] for i in index[n]])
                        for n in (MAIN, GROUP))
    return GroupDilocoState(inner_state=inner.init(params), anchor=anchor,
                            outer_state=outer_state,
                            count=jnp.zeros([], jnp.int32),
                            num_syncs=jnp.zeros([2], jnp.int32))

  def sync_part(name, anchor, outer_state, local):
    delta = mean_fn(_local.pseudo_gradient(anchor, local))
    updates, outer_state = txs[name].update(delta, outer_state, anchor)
    return optax.apply_updates(anchor, updates), outer_state

  def update_fn(updates, state, params=None, *, sync=None, **extra_args):
    due_names = _check_phase(sync)
    inner_updates, inner_state = _local.inner_step(
        inner, 'group_diloco', updates, state.inner_state, params,
        extra_args)
    treedef = jax.tree.structure(params)
    p_leaves, u_leaves = jax.tree.leaves(params), jax.tree.leaves(
        inner_updates)
    a_leaves = list(jax.tree.leaves(state.anchor))
    new_updates = list(u_leaves)
    outer_states, synced = [], []
    for k, (name, index) in enumerate(sorted(parts(params).items(),
                                             key=lambda kv: kv[0] != MAIN)):
      pick = lambda leaves, index=index: [leaves[i] for i in index]
      due = None if due_names is None else bool(index) and name in due_names
      due, out = _part_step(
          functools.partial(sync_part, name), due, state.count,
          periods[name], varying, pick(a_leaves), state.outer_state[k],
          pick(p_leaves), pick(u_leaves))
      for j, i in enumerate(index):
        a_leaves[i], new_updates[i] = out[0][j], out[2][j]
      outer_states.append(out[1])
      synced.append(due.astype(jnp.int32))
    return treedef.unflatten(new_updates), state._replace(
        inner_state=inner_state, anchor=treedef.unflatten(a_leaves),
        outer_state=tuple(outer_states),
        count=optax.safe_increment(state.count),
        num_syncs=state.num_syncs + jnp.stack(synced))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def group_diloco_eval_params(state: GroupDilocoState, params: optax.Params
                             ) -> Any:
  """The anchor in the params' dtypes (each part as of its last sync)."""
  return _local.cast_like(state.anchor, params)
