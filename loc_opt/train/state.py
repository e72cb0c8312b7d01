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
    opt_state = jax.vmap(tx.init)(params)
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


def _leaf_spec(path, leaf, specs: dict[tuple, Any]):
  """The within-worker spec of a state leaf: the param whose key path is the
  longest suffix of the leaf's path (and shape matches), else replicated."""
  keys = tuple(str(k) for k in path)
  for start in range(len(keys)):
    hit = specs.get(keys[start:])
    if hit is not None and hit[1] == tuple(leaf.shape[-len(hit[1]):] if
                                           hit[1] else ()):
      return hit[0]
  return P()


def state_shardings(abstract_state, specs, mesh, per_worker: bool):
  """NamedShardings for every leaf of the train state."""
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
      spec = _leaf_spec(path[1:], leaf, by_path)
      if per_worker:
        spec = P(parallel.WORKER, *spec)
      return jax.NamedSharding(mesh, spec)
    if top == "['faults']" and per_worker:
      return jax.NamedSharding(mesh, P(parallel.WORKER))
    return jax.NamedSharding(mesh, P())

  return jax.tree_util.tree_map_with_path(leaf_sharding, abstract_state)
