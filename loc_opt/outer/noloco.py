"""NoLoCo: local steps with gossip outer steps inside small random groups.

Every worker keeps its own outer parameters ``phi_i`` and outer momentum
``delta_i``. Every ``sync_every`` inner steps the workers split into random
groups of ``group_size`` (new groups every round, the same on all workers
because they come from a shared seed folded with the round index). Inside a
group the workers exchange their outer parameters and pseudo-gradients point
to point; no collective spans all workers. Repeated random groups mix the
workers' models over rounds.

References:
  Kolehmainen, Blagoev, Donaghy, Ersoy, Nies, *NoLoCo: No-all-reduce Low
  Communication Training Method for Large Models*, 2025.
  https://arxiv.org/abs/2506.10911
"""

from collections.abc import Hashable
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loc_opt import _checks
from loc_opt import compression
from loc_opt.outer import _local
from loc_opt.outer import plan as plan_lib

Groups = tuple[tuple[int, ...], ...]


class NolocoState(NamedTuple):
  """State of :func:`noloco` (one worker's copy).

  Attributes:
    inner_state: the inner optimizer's state, never averaged or reset.
    anchor: this worker's outer parameters ``phi_i`` (same tree as the
      params; dtype ``promote_types(param dtype, anchor_dtype)``).
    momentum: this worker's outer momentum ``delta_i`` (tree and dtypes of
      ``anchor``; zeros at init).
    count: int32 scalar, inner steps taken.
    steps_since_sync: int32 scalar, inner steps since the last sync.
    num_syncs: int32 scalar, syncs done; the round index that seeds the next
      sync's groups.
  """

  inner_state: optax.OptState
  anchor: optax.Params
  momentum: optax.Params
  count: jax.Array
  steps_since_sync: jax.Array
  num_syncs: jax.Array


def _check_group_size(num_workers: int, group_size: int) -> None:
  _checks.positive_int(group_size, 'group_size', arrays=True)
  _checks.positive_int(num_workers, 'num_workers', arrays=True)
  if num_workers % group_size:
    raise ValueError(f'group_size={group_size} must divide the number of '
                     f'workers num_workers={num_workers}')


def _check_sync_every(sync_every: Any) -> None:
  """A positive int (or a concrete int array); traced values pass."""
  if not _checks.is_traced(sync_every):
    _checks.positive_int(sync_every, 'sync_every', arrays=True)


def _round_key(seed: int, round_index: Any) -> jax.Array:
  return jax.random.fold_in(jax.random.key(seed), round_index)


@functools.lru_cache(maxsize=4096)
def noloco_groups(
    seed: int, round_index: int, num_workers: int, group_size: int = 2
) -> Groups:
  """Host-side: the groups of round ``round_index`` (pure, deterministic).

  A permutation ``perm`` of the worker ranks is drawn from
  ``fold_in(key(seed), round_index)``; rank ``perm[k]`` joins group
  ``k mod (num_workers / group_size)`` (the rule of the reference code).
  The result is canonical: members ascending inside a group, groups ordered
  by their smallest member, so a round's phase names one program.
  :func:`noloco_group_ids` computes the same groups on device.

  Args:
    seed: the seed shared by all workers.
    round_index: the 0-based sync round (``num_syncs`` before the sync).
    num_workers: M, the number of workers.
    group_size: n, workers per group; must divide M.

  Returns:
    ``M / n`` tuples of ``n`` worker indices, a partition of ``range(M)``.

  Raises:
    ValueError: if ``group_size`` does not divide ``num_workers``.
  """
  _check_group_size(num_workers, group_size)
  num_groups = num_workers // group_size
  perm = np.asarray(jax.random.permutation(
      _round_key(seed, round_index), num_workers))
  groups = [sorted(int(r) for r in perm[g::num_groups])
            for g in range(num_groups)]
  return tuple(tuple(g) for g in sorted(groups))


def noloco_group_ids(
    seed: int, round_index: jax.typing.ArrayLike, num_workers: int,
    group_size: int = 2
) -> jax.Array:
  """On device: the group index of every rank in round ``round_index``.

  The jittable twin of :func:`noloco_groups` (``round_index`` may be
  traced): entry ``j`` is the position in ``noloco_groups(seed,
  round_index, num_workers, group_size)`` of the group that holds rank
  ``j``.

  Returns:
    An int32 array of shape ``[num_workers]``.
  """
  _check_group_size(num_workers, group_size)
  num_groups = num_workers // group_size
  perm = jax.random.permutation(_round_key(seed, round_index), num_workers)
  ranks = jnp.arange(num_workers, dtype=jnp.int32)
  position = jnp.zeros(num_workers, jnp.int32).at[perm].set(ranks)
  raw = position % num_groups
  smallest = jnp.full(num_groups, num_workers, jnp.int32).at[raw].min(ranks)
  canonical = jnp.argsort(jnp.argsort(smallest))  # groups by smallest rank
  return canonical[raw].astype(jnp.int32)


def _check_groups(groups: Any, num_workers: int, group_size: int) -> Groups:
  """Validates a static groups phase; returns it as tuples of ints."""
  try:
    groups = tuple(tuple(int(r) for r in g) for g in groups)
  except (TypeError, ValueError):
    raise ValueError(f'sync must be None, a bool or a tuple of groups, got '
                     f'{groups!r}') from None
  members = sorted(r for g in groups for r in g)
  if (members != list(range(num_workers))
      or any(len(g) != group_size for g in groups)):
    raise ValueError(
        f'sync={groups!r} must split the {num_workers} workers into groups '
        f'of group_size={group_size}')
  return groups


def _group_sum(own: Any, received: list[Any]) -> Any:
  """``own + received[0] + received[1] + ...`` in this order, leafwise."""
  return jax.tree.map(lambda x, *rs: functools.reduce(jnp.add, rs, x),
                      own, *received)


def _exchange_static(comm: compression.Comm, payload: Any, groups: Groups,
                     group_size: int) -> list[Any]:
  """What each shift's peer sent, by ring shifts inside static groups."""
  received = []
  for shift in range(1, group_size):
    perm = [(g[k], g[(k + shift) % group_size])
            for g in groups for k in range(group_size)]
    received.append(comm.ppermute(payload, perm))
  return received


def _exchange_dynamic(comm: compression.Comm | None, payload: Any,
                      round_index: jax.Array, seed: int, group_size: int
                      ) -> list[Any]:
  """The same peers' payloads from groups computed on device (an
  all-gather over all workers, then a dynamic index)."""
  if group_size == 1:
    return []
  ids = noloco_group_ids(seed, round_index, comm.size(), group_size)
  me = comm.index()
  members = jnp.nonzero(ids == ids[me], size=group_size)[0]
  k = jnp.argmax(members == me)
  gathered = comm.all_gather(payload)
  received = []
  for shift in range(1, group_size):
    src = members[(k - shift) % group_size]
    received.append(jax.tree.map(lambda x: x[src], gathered))
  return received


def noloco(
    inner: optax.GradientTransformation,
    *,
    sync_every: int,
    learning_rate: jax.typing.ArrayLike = 0.7,
    momentum: jax.typing.ArrayLike = 0.5,
    consensus: jax.typing.ArrayLike | None = None,
    group_size: int = 2,
    seed: int = 0,
    axis_name: str | None = 'worker',
    anchor_dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
  r"""NoLoCo: local inner steps, outer steps averaged in small random groups.

  On every step the inner optimizer produces an update from this worker's
  gradient. On a sync step (every ``H = sync_every`` inner steps) worker
  ``i`` of group ``G`` (``n = group_size`` workers) forms the local
  parameters ``theta'_i = theta_i + u`` and

  .. math::

    \Delta_j = \phi_j - \theta'_j, \quad
    \bar\Delta_G = \tfrac1n \sum_{j \in G} \Delta_j, \quad
    \bar\phi_G = \tfrac1n \sum_{j \in G} \phi_j, \\
    \delta_i \leftarrow \alpha \delta_i - \beta \bar\Delta_G
      - \gamma (\phi_i - \bar\phi_G), \quad
    \phi_i \leftarrow \phi_i + \delta_i, \quad
    \theta_i \leftarrow \phi_i,

  with momentum :math:`\alpha`, outer learning rate :math:`\beta` and
  consensus weight :math:`\gamma` (``= beta`` by default, as the reference
  code). The heavy-ball step is that of ``optax.sgd(beta, momentum=alpha)``
  with :math:`\delta = -\beta v`; with one group of all workers the
  consensus term vanishes and NoLoCo is DiLoCo with that outer optimizer.
  The returned update is :math:`\phi_i - \theta_i`, so
  ``optax.apply_updates`` lands on the new outer parameters. The inner state
  is kept across syncs. There is no single global model: each worker keeps
  its own :math:`\phi_i` (see :func:`noloco_eval_params`).

  Groups are redrawn every round from ``seed`` folded with the round index
  ``num_syncs`` (:func:`noloco_groups`). The keyword-only static ``sync``
  argument names the phase of the step:

  * ``False``: an inner step, no cross-worker collective;
  * a groups tuple (as returned by :func:`noloco_groups`): a sync in those
    groups, exchanged with ``n - 1`` static ``lax.ppermute`` ring shifts
    inside each group (each worker sends ``phi`` and ``Delta`` to ``n - 1``
    peers, no all-reduce or all-gather); :func:`noloco_plan` gives the
    phase of every step;
  * ``True``: a sync in the groups computed on device from ``num_syncs``;
  * ``None`` (default): decided on device from the counters with
    ``lax.cond``; syncs use the on-device groups.

  The on-device groups are data, not program structure, so ``True`` and
  ``None`` exchange through an ``all_gather`` over all workers and pick the
  peers by dynamic index: the same numbers as the planned phase, but every
  worker receives ``M - 1`` workers' payloads instead of ``n - 1``. Training
  loops should use the plan.

  Args:
    inner: the inner optimizer (e.g. ``optax.adamw(...)``); may take extra
      args.
    sync_every: the sync period H (a positive int).
    learning_rate: the outer learning rate beta (0.7 in the paper).
    momentum: the outer momentum alpha (0.5 in the paper).
    consensus: the weight gamma of the pull toward the group's mean outer
      parameters; ``None`` means ``learning_rate``.
    group_size: n, workers per group (2 in the paper); must divide the
      number of workers.
    seed: the seed of the groups, shared by all workers.
    axis_name: the worker axis (a ``vmap`` axis name or a manual
      ``shard_map`` axis); ``None`` for one worker (then ``group_size``
      must be 1).
    anchor_dtype: the minimum precision of ``phi`` and ``delta`` (fp32 by
      default); also the wire dtype of the exchange.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import optax, loc_opt
    >>> tx = loc_opt.noloco(optax.adamw(6e-4), sync_every=50)
    >>> plan = loc_opt.outer.noloco_plan(50, num_workers=8)

  References:
    Kolehmainen, Blagoev, Donaghy, Ersoy, Nies, *NoLoCo: No-all-reduce Low
    Communication Training Method for Large Models*, 2025.
  """
  _checks.transformation(inner, 'inner')
  _check_sync_every(sync_every)
  _checks.positive_int(group_size, 'group_size')
  if axis_name is None and group_size != 1:
    raise ValueError(f'group_size={group_size} needs workers: pass an '
                     'axis_name, or group_size=1 for one worker')
  inner = optax.with_extra_args_support(inner)
  consensus = learning_rate if consensus is None else consensus
  comm = compression.Comm(axis_name) if axis_name is not None else None

  def num_workers():
    return 1 if axis_name is None else jax.lax.axis_size(
        _checks.axis_bound(axis_name, 'loc_opt.noloco'))

  def phase(sync):
    """``(branch phase, static groups or None)`` of the ``sync`` argument."""
    if sync is not None and not isinstance(sync, bool):
      return True, _check_groups(sync, num_workers(), group_size)
    if num_workers() % group_size:
      raise ValueError(f'group_size={group_size} must divide the number of '
                       f'workers {num_workers()}')
    return sync, None

  init_fn = _local.periodic_init(
      NolocoState, inner, anchor_dtype,
      lambda anchor: dict(momentum=jax.tree.map(jnp.zeros_like, anchor)))

  def sync_step(state, params, local, groups):
    payload = (state.anchor, _local.pseudo_gradient(state.anchor, local))
    if groups is not None:
      received = _exchange_static(comm, payload, groups, group_size)
    else:
      received = _exchange_dynamic(comm, payload, state.num_syncs, seed,
                                   group_size)
    mean_anchor, mean_delta = jax.tree.map(
        lambda s: s / group_size, _group_sum(payload, received))
    momentum_ = jax.tree.map(
        lambda v, d, a, ma: (momentum * v - learning_rate * d
                             - consensus * (a - ma)).astype(v.dtype),
        state.momentum, mean_delta, state.anchor, mean_anchor)
    anchor = jax.tree.map(lambda a, v: a + v, state.anchor, momentum_)
    return _local.updates_to(anchor, params), dict(anchor=anchor,
                                                   momentum=momentum_)

  update_fn = _local.periodic_update(
      inner, sync_every, name='noloco', sync_step=sync_step,
      fields=('anchor', 'momentum'), phase=phase,
      varying=_local.varying_fn(comm))
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def noloco_plan(
    sync_every: int, num_workers: int, group_size: int = 2, seed: int = 0
) -> plan_lib.Plan:
  """The host-side plan of :func:`noloco` (same ``sync_every``, ``seed``).

  The step after ``count`` inner steps is a sync when ``count + 1`` is a
  multiple of ``sync_every``; its phase is that round's groups,
  ``noloco_groups(seed, (count + 1) // sync_every - 1, num_workers,
  group_size)``; every other step is ``False``.

  Raises:
    ValueError: if ``sync_every`` is not positive or ``group_size`` does not
      divide ``num_workers``.
  """
  _check_sync_every(sync_every)
  _check_group_size(num_workers, group_size)
  sync_every = int(sync_every)
  due = plan_lib.every(int(sync_every))

  def phase(count: int) -> Hashable:
    if not due(count):
      return False
    round_index = (count + 1) // sync_every - 1
    return noloco_groups(seed, round_index, num_workers, group_size)

  return plan_lib.Plan(phase)


def noloco_eval_params(state: NolocoState, params: optax.Params) -> Any:
  """This worker's outer parameters ``phi_i``, in params dtypes.

  NoLoCo keeps no single global model: the workers' ``phi_i`` stay slightly
  different forever. Evaluate one worker's (say worker 0, and report it) or
  the mean over workers.
  """
  return _local.cast_like(state.anchor, params)


def noloco_bytes(params: Any, dtype: Any = jnp.float32) -> int:
  """Bytes one worker sends per sync to each peer: ``phi`` and ``Delta``.

  Two params-sized tensors at ``dtype`` (8 B/param in fp32). With
  ``group_size = n`` each worker sends this to ``n - 1`` peers.
  """
  return 2 * _local.num_params(params) * jnp.dtype(dtype).itemsize
