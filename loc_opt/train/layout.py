"""How a checkpoint stores the train state: what every worker shares, once.

Under a local-update method every leaf of ``params``, ``opt_state`` and
``faults`` has a leading worker axis, but the fields of the method's state
listed in ``Method.shared_fields`` (DiLoCo's anchor, outer optimizer state
and counters) are bit-identical on every worker. A checkpoint stores those
once: the train state is split into two trees before Orbax's
``StandardSave``::

  {'shared': {'opt_state': {field: tree, ...},  # worker 0's copy, no
                                                # worker axis
              'step': ..., 'data_position': ..., 'rng': ...},
   'per_worker': {'params': tree,                # [workers, ...]
                  'opt_state': {field: tree, ...},  # the other fields
                  'faults': {...}}}

(``opt_state`` of ``per_worker`` is the optimizer state itself when the
method shares nothing, and ``shared`` then has no ``opt_state``.) A JSON item
``layout`` beside it records ``{'format': 1, 'workers': M, 'shared_fields':
[...], 'outer_state_layout': ...}``, so a restore knows what it reads.
Under ``outer.state_layout='sharded'`` the anchor and outer optimizer state
hold each worker's own shard, are not shared fields, and are stored per
worker; a checkpoint without ``outer_state_layout`` was written by the
replicated layout (``'offloaded'`` stores as ``'replicated'`` does).
Shared leaves are saved sharded like their parameter inside a worker and
replicated over ``worker``, and restored broadcast back to every worker: a
copy, so resume stays bit-exact.

A checkpoint without the ``layout`` item (written before this layout) holds
the whole state and is restored as such.

A restore onto another worker count (``loc_opt.train.elastic``) reads the
per-worker tree with the saved leading size, replicated over ``worker``,
and builds the new state from it.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from loc_opt.train import elastic
from loc_opt.train.method import Method
from loc_opt.train.method import state_fields

P = jax.P
FORMAT = 1
# The state entries without a worker axis (stored under 'shared').
_SCALARS = ('step', 'data_position', 'rng')


def _within_worker(sharding: jax.NamedSharding) -> jax.NamedSharding:
  """``sharding`` without its leading (worker) dimension: the sharding of
  one worker's slice, replicated over ``worker``."""
  return jax.NamedSharding(sharding.mesh, P(*sharding.spec[1:]))


def _over_workers(sharding: jax.NamedSharding) -> jax.NamedSharding:
  """``sharding`` with its leading dimension replicated (not split over
  ``worker``): any number of workers fits it."""
  return jax.NamedSharding(sharding.mesh, P(None, *sharding.spec[1:]))


def _abstract(x: jax.ShapeDtypeStruct, shape, sharding
              ) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)


class StateLayout:
  """The checkpoint layout of one experiment's train state.

  Args:
    method: the training method.
    tx: its optimizer (for new workers' state on an elastic resume).
    abstract_state: the train state's shapes, dtypes and shardings.
    workers: ``mesh.workers``.
    batch_size: the global batch (reported on an elastic resume).
    outer_state_layout: ``outer.state_layout`` (how the method's outer
      fields are laid out; ``loc_opt.train.outer_layout``).

  Attributes:
    shared_fields: the fields of the method's state stored once (those of
      ``method.shared_fields``; ``()`` for a method that shares nothing).
  """

  def __init__(self, method: Method, tx: optax.GradientTransformation,
               abstract_state: Any, workers: int, batch_size: int, *,
               outer_state_layout: str = 'replicated'):
    self.method, self.tx = method, tx
    self.outer_state_layout = outer_state_layout
    self.abstract_state = abstract_state
    self.workers, self.batch_size = workers, batch_size
    self.fields = state_fields(method, abstract_state['opt_state'])
    self.shared_fields = tuple(f for f in self.fields
                               if f in method.shared_fields)

  @property
  def info(self) -> dict[str, Any]:
    """The JSON item saved beside the state."""
    return {'format': FORMAT, 'workers': self.workers,
            'shared_fields': list(self.shared_fields),
            'outer_state_layout': self.outer_state_layout}

  def check(self, info: dict[str, Any]) -> None:
    """Raises a ``ValueError`` if a checkpoint saved with layout ``info``
    cannot resume here: its outer state is laid out otherwise (sharded
    against whole), or sharded over another worker count."""
    saved = info.get('outer_state_layout', 'replicated')
    now = self.outer_state_layout
    if (saved == 'sharded') != (now == 'sharded'):
      raise ValueError(
          f'the checkpoint stores the outer state with outer.state_layout='
          f'{saved!r} and this run uses {now!r}: a sharded outer state '
          "(each worker's 1/M) and a whole one cannot be exchanged on "
          'resume; use the checkpoint\'s outer.state_layout')
    old = int(info['workers'])
    if now == 'sharded' and old != self.workers:
      raise ValueError(
          f'the checkpoint has {old} workers and this run {self.workers}: '
          "with outer.state_layout='sharded' each worker stores its own "
          f'1/{old} of the anchor and outer state, so the worker count '
          f'cannot change on resume; resume with mesh.workers={old}')

  # ------------------------------------------------------------ split ---
  def _split(self, state: Any, shared_fields) -> dict[str, Any]:
    """``{'shared', 'per_worker'}`` trees of ``state`` (leaves untouched)."""
    opt = state['opt_state']
    shared = {k: state[k] for k in _SCALARS}
    if shared_fields:
      fields = opt._asdict()
      shared['opt_state'] = {f: fields[f] for f in shared_fields}
      opt = {f: v for f, v in fields.items() if f not in shared_fields}
    return {'shared': shared,
            'per_worker': {'params': state['params'], 'opt_state': opt,
                           'faults': state['faults']}}

  def _join(self, shared_opt: dict[str, Any] | None, saved: dict[str, Any],
            per_worker: dict[str, Any]) -> dict[str, Any]:
    """The train state from its parts (``shared_opt`` with the worker
    axis already, or None when nothing is shared)."""
    opt = per_worker['opt_state']
    if shared_opt is not None:
      opt = type(self.abstract_state['opt_state'])(**shared_opt, **opt)
    return {'params': per_worker['params'], 'opt_state': opt,
            'faults': per_worker['faults'],
            **{k: saved[k] for k in _SCALARS}}

  @functools.cached_property
  def _take_first(self):
    """Jitted: worker 0's slice of every shared leaf, replicated."""
    abstract = self._split(self.abstract_state, self.shared_fields)
    out = jax.tree.map(lambda x: _within_worker(x.sharding),
                       abstract['shared']['opt_state'])
    return jax.jit(lambda tree: jax.tree.map(lambda x: x[0], tree),
                   out_shardings=out)

  def broadcast_fn(self, workers: int, shardings: Any):
    """Jitted: every shared leaf copied to ``workers`` workers, laid out
    by ``shardings`` (the state's shardings of those leaves)."""
    return jax.jit(
        lambda tree: jax.tree.map(
            lambda x: jnp.broadcast_to(x[None], (workers,) + x.shape), tree),
        out_shardings=shardings)

  def to_saved(self, state: Any) -> dict[str, Any]:
    """The tree to save: shared leaves once (worker 0's copy)."""
    tree = self._split(state, self.shared_fields)
    if self.shared_fields:
      tree['shared']['opt_state'] = self._take_first(
          tree['shared']['opt_state'])
    return tree

  # ---------------------------------------------------------- restore ---
  def abstract_saved(self, info: dict[str, Any] | None) -> Any:
    """The restore target of a checkpoint saved with layout ``info``
    (None: a checkpoint of the whole state, restored as it is)."""
    if info is None:
      return self.abstract_state
    saved_fields = tuple(info['shared_fields'])
    old = int(info['workers'])
    tree = self._split(self.abstract_state, saved_fields)
    if saved_fields:
      tree['shared']['opt_state'] = jax.tree.map(
          lambda x: _abstract(x, x.shape[1:], _within_worker(x.sharding)),
          tree['shared']['opt_state'])
    if old != self.workers:
      tree['per_worker'] = jax.tree.map(
          lambda x: _abstract(x, (old,) + x.shape[1:],
                              _over_workers(x.sharding)),
          tree['per_worker'])
    return tree

  def from_saved(self, tree: Any, info: dict[str, Any] | None, step: int
                 ) -> tuple[Any, str | None]:
    """The train state from a restored tree, and a one-line note of an
    elastic resume (None otherwise).

    Raises:
      ValueError: if the checkpoint's worker count differs and cannot be
        changed (no layout item, or no shared anchor).
    """
    if info is None:
      return tree, None
    self.check(info)
    saved_fields = tuple(info['shared_fields'])
    old = int(info['workers'])
    shared, per_worker = tree['shared'], tree['per_worker']
    if old != self.workers:
      return elastic.resize(self, shared, per_worker, saved_fields, old,
                            step)
    shared_opt = None
    if saved_fields:
      abstract = self._split(self.abstract_state, saved_fields)
      shardings = jax.tree.map(lambda x: x.sharding,
                               abstract['shared']['opt_state'])
      shared_opt = self.broadcast_fn(self.workers, shardings)(
          shared['opt_state'])
    return self._join(shared_opt, shared, per_worker), None
