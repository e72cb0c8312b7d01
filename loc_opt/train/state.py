"""The train state: one pytree with everything a run needs to resume.

``{'params', 'opt_state', 'faults', 'step', 'data_position', 'rng'}``.
Under a local-update method (``Method.per_worker``) every array of
``params``, ``opt_state`` and ``faults`` carries a leading worker axis
sharded over the mesh's
``worker`` axis; inside a worker each leaf keeps the sharding of the
parameter it belongs to (FSDP / tensor specs of the model).
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from loc_opt import models
from loc_opt import parallel
from loc_opt.train import faults
from loc_opt.train.method import Method

P = jax.P


def init_state(rng: jax.Array, *, model: models.Model,
               tx: optax.GradientTransformation, method: Method,
               workers: int) -> dict[str, Any]:
  """One model initialisation, copied to every worker (identical init)."""
  params = model.init(rng)
  if method.per_worker:
    params = jax.tree.map(
        lambda x: jnp.broadcast_to(x, (workers,) + x.shape), params)
    # The worker axis is bound: a sharded outer state (outer.state_layout)
    # takes each worker's shard of the anchor by its index.
    opt_state = jax.vmap(tx.init, axis_name=parallel.WORKER)(params)
  else:
    opt_state = tx.init(params)
  return {
      'params': params,
      'opt_state': opt_state,
      # Non-finite steps per worker (loc_opt.train.faults).
      'faults': faults.init(workers if method.per_worker else None),
      'step': jnp.zeros([], jnp.int32),
      'data_position': jnp.zeros([], jnp.int32),
      'rng': jax.random.key_data(rng),
  }


def param_specs(model: models.Model, mesh: jax.sharding.Mesh) -> Any:
  """The model's within-worker partition specs on ``mesh``."""
  return models.resolve_specs(model.specs, mesh.axis_names)


def _axis_size(mesh: jax.sharding.Mesh, entry) -> int:
  """Devices a spec entry (None, an axis or a tuple of axes) splits over."""
  names = () if entry is None else (
      (entry,) if isinstance(entry, str) else tuple(entry))
  size = 1
  for name in names:
    size *= mesh.shape[name]
  return size


def _leaf_spec(path, leaf, specs: dict[tuple, Any], mesh=None, *,
               pieces=None):
  """The within-worker spec of a state leaf: the param whose key path is the
  longest suffix of the leaf's path (and shape matches), else (with
  ``pieces``: the mesh and 1 under a leading worker axis, else 0) the spec
  of the parameter it is a piece of
  (:func:`_piece_spec`), else replicated.

  With ``mesh``, a leaf may also be a row shard of its parameter (the same
  shape but the leading axis; ``outer.state_layout='sharded'``): it takes
  the parameter's spec, its leading entry dropped where that does not
  divide the shard's rows."""
  keys = tuple(str(k) for k in path)
  for start in range(len(keys)):
    hit = specs.get(keys[start:])
    if hit is None:
      continue
    spec, shape = hit
    tail = tuple(leaf.shape[-len(shape):]) if shape else ()
    if tail == shape:
      return spec
    if mesh is not None and shape and len(tail) == len(shape) and \
        tail[1:] == shape[1:]:
      entries = tuple(spec) + (None,) * (len(shape) - len(spec))
      if tail[0] % _axis_size(mesh, entries[0]):
        entries = (None,) + entries[1:]
      return P(*entries)
  if pieces is not None:
    return _piece_spec(leaf, specs, *pieces)
  return P()


def _piece_spec(leaf, specs: dict[tuple, Any], mesh, lead: int) -> Any:
  """The spec of a state leaf that no parameter path names but that is a
  piece of a parameter, by shape: Streaming DiLoCo's per-fragment outer
  state, in-flight buffers (lists over the fragment's pieces: whole leaves,
  or rows of a stacked leaf's leading axis). The parameters whose shape it
  has (a whole leaf), or whose shape but the leading axis it has (rows of
  a stacked leaf), give its spec (the leading entry dropped where the
  piece's rows do not divide over it); issue 46: before, every such piece
  was replicated inside the worker. Where parameters of that shape differ
  in spec (an attention block's square kernels), the first one's is taken:
  the piece is split over the same devices, and a sync may move it to its
  own parameter's layout inside the worker. Leaves under 2-D stay
  replicated."""
  for spec, shape in specs.values():
    if len(shape) < 2 or len(leaf.shape) - len(shape) != lead:
      continue
    tail = tuple(leaf.shape[-len(shape):])
    if tail[1:] != shape[1:]:
      continue
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    if tail[0] != shape[0] and tail[0] % _axis_size(mesh, entries[0]):
      entries = (None,) + entries[1:]
    return P(*entries)
  return P()


def state_shardings(abstract_state, specs, mesh, per_worker: bool, *,
                    row_shards: tuple[str, ...] = ()):
  """NamedShardings for every leaf of the train state.

  ``row_shards``: fields of the optimizer state (a NamedTuple) whose leaves
  are row shards of their parameters (``outer.state_layout='sharded'``);
  they take their parameter's spec inside a worker."""
  shard_paths = tuple(f"['opt_state'].{f}" for f in row_shards)
  params_abstract = abstract_state['params']
  by_path = {}
  for (path, leaf), spec in zip(
      jax.tree_util.tree_leaves_with_path(params_abstract),
      jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
    shape = leaf.shape[1:] if per_worker else leaf.shape
    by_path[tuple(str(k) for k in path)] = (spec, tuple(shape))

  def leaf_sharding(path, leaf):
    top = str(path[0]) if path else ''
    if top in ("['opt_state']", "['params']"):
      rows = jax.tree_util.keystr(tuple(path[:2])) in shard_paths
      spec = _leaf_spec(path[1:], leaf, by_path, mesh if rows else None,
                        pieces=(mesh, int(per_worker))
                        if top == "['opt_state']" else None)
      if per_worker:
        spec = P(parallel.WORKER, *spec)
      return jax.NamedSharding(mesh, spec)
    if top == "['faults']" and per_worker:
      return jax.NamedSharding(mesh, P(parallel.WORKER))
    return jax.NamedSharding(mesh, P())

  return jax.tree_util.tree_map_with_path(leaf_sharding, abstract_state)
