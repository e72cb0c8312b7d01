"""Where the outer state lives: ``outer.state_layout`` in the trainer.

DiLoCo's anchor and outer optimizer state (``Method.outer_fields``) are read
only at a sync. ``outer.state_layout`` chooses where they live between syncs
(issue 20, part 2; docs/sharding.md):

* ``'replicated'`` (default): every worker holds the whole outer state, on
  its devices, split inside the worker like the parameters.
* ``'sharded'``: each worker holds only its strided 1/M of every leaf
  (``loc_opt.diloco(outer_state_layout='sharded')``; ZeRO stage 1,
  Rajbhandari et al., 2020). The fields are then no longer the same on
  every worker, so the method's ``shared_fields`` lose them (a checkpoint
  stores each worker's shard) and a resume cannot change ``mesh.workers``
  (the shards depend on it).
* ``'offloaded'``: replicated, but kept in ``pinned_host`` memory between
  steps (``loc_opt.parallel.host_shardings``); the programs of the phases
  that sync move them to the device and back inside the program
  (``loc_opt.parallel.offloaded``), the inner program passes them through
  untouched (aliased in, aliased out: no transfer). Checkpoints store them
  as the replicated layout does.

References: Rajbhandari, Rasley, Ruwase, He, *ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models*, 2020; Ren et al.,
*ZeRO-Offload: Democratizing Billion-Scale Model Training*, 2021.
"""

import dataclasses
import functools
from typing import Any

import jax
import ml_collections

from loc_opt import models
from loc_opt import outer as outer_lib
from loc_opt import parallel
from loc_opt.train import config as cfg_lib
from loc_opt.train.method import Method

FIELD = 'outer.state_layout'
HOST_MEMORY = 'pinned_host'


def check(config: ml_collections.ConfigDict, method: Method,
          methods: dict[str, Method]) -> str:
  """``outer.state_layout`` if ``method`` supports it, else a ``ValueError``
  naming the field, the method and the methods that do."""
  layout = cfg_lib.state_layout(config)
  if layout not in method.state_layouts:
    supported = sorted(k for k, m in methods.items()
                       if layout in m.state_layouts)
    raise ValueError(
        f'{FIELD}={layout!r}: outer.method={config.outer.method!r} does not '
        f'support it (its layouts: {", ".join(method.state_layouts)}; '
        f'{layout!r} is supported by {", ".join(supported)})')
  if layout != 'sharded':
    return layout
  if config.mesh.workers == 1:
    raise ValueError(f"{FIELD}='sharded' needs mesh.workers > 1 (one worker "
                     "holds the whole outer state); use 'replicated'")
  # The sync is a reduce-scatter of the plain fp32 mean.
  for field, plain in (('codec', 'none'), ('aggregate', 'mean')):
    value = config.outer.get(field, plain)
    if value != plain:
      raise ValueError(
          f"{FIELD}='sharded' reduce-scatters the plain fp32 mean: "
          f'outer.{field} must be {plain!r}, got {value!r} (use '
          f"{FIELD}='replicated' for it)")
  return layout


def param_specs(config: ml_collections.ConfigDict) -> Any:
  """The model's parameter specs over the mesh axes inside a worker: the
  ``param_specs`` of ``loc_opt.diloco(outer_state_layout='sharded')``, so
  that each device reduce-scatters and all-gathers its own block."""
  return models.resolve_specs(models.build_model(config.model).specs,
                              parallel.AXES)


def library_kwargs(config: ml_collections.ConfigDict, codec
                   ) -> dict[str, Any]:
  """``codec``, ``outer_state_layout`` (and ``param_specs``) of
  ``loc_opt.diloco`` / ``local_sgd`` for the config: a sharded outer state
  sends the plain fp32 mean by its reduce-scatter, without a codec
  (:func:`check` refuses ``outer.codec`` other than 'none'), each device
  its own block; otherwise ``codec(config)``, the method's compressor."""
  layout = cfg_lib.library_state_layout(config)
  if layout == 'sharded':
    return {'codec': None, 'outer_state_layout': layout,
            'param_specs': param_specs(config)}
  return {'codec': codec(config), 'outer_state_layout': layout}


def _sharded_eval(opt_state, params, *, specs):
  # The anchor's shards, all-gathered over the workers (under the worker
  # map, as the trainer's programs call it), by device blocks as the sync
  # gathers them (so that a sync's reset of a non-finite worker reuses the
  # sync's gather).
  return outer_lib.diloco_eval_params(opt_state, params,
                                      outer_state_layout='sharded',
                                      axis_name=parallel.WORKER,
                                      param_specs=specs)


def for_layout(method: Method, layout: str, specs: Any = None) -> Method:
  """``method`` as the trainer runs it under ``layout``.

  Under ``'sharded'`` the outer fields hold each worker's own shard: they
  leave ``shared_fields`` (the fault skip, the checkpoint layout), the
  evaluation weights gather the anchor's shards (DiLoCo's state, the one
  library layout that shards; ``specs``: :func:`param_specs`), and the
  method is not elastic. The other layouts keep the method as it is.
  """
  if layout != 'sharded':
    return method
  shared = tuple(f for f in method.shared_fields
                 if f not in method.outer_fields)
  return dataclasses.replace(
      method, shared_fields=shared, elastic=False,
      eval_params=functools.partial(_sharded_eval, specs=specs))


def row_shards(method: Method, layout: str) -> tuple[str, ...]:
  """The state fields that hold row shards of the parameters (split inside
  a worker like them): the outer fields under ``'sharded'``."""
  return method.outer_fields if layout == 'sharded' else ()


def _outer_paths(method: Method) -> tuple[str, ...]:
  return tuple(f"['opt_state'].{f}" for f in method.outer_fields)


def _is_outer(method: Method, path) -> bool:
  keys = jax.tree_util.keystr(tuple(path[:2]))
  return keys in _outer_paths(method)


def at_rest(shardings: Any, method: Method, layout: str) -> Any:
  """The train state's shardings between steps: under ``'offloaded'`` the
  outer fields' in ``pinned_host`` memory, the rest as ``shardings``."""
  if layout != 'offloaded':
    return shardings
  return jax.tree_util.tree_map_with_path(
      lambda path, s: s.with_memory_kind(HOST_MEMORY)
      if _is_outer(method, path) else s, shardings)


def _move(state: Any, to: Any, other: Any) -> Any:
  """``state`` with the leaves whose ``to`` sharding differs from their
  ``other`` one put on ``to``."""
  return jax.tree.map(
      lambda x, s, o: x if s == o else jax.device_put(x, s), state, to,
      other)


def offloaded_step(step, on_device: Any, rest: Any):
  """``step(state, *args) -> (state, *out)`` with the state moved from its
  ``rest`` shardings to ``on_device`` before it and back after it, inside
  the program that jits it; only the leaves whose shardings differ move
  (the tree form of ``loc_opt.parallel.offloaded``)."""

  @functools.wraps(step)
  def wrapped(state, *args):
    new, *out = step(_move(state, on_device, rest), *args)
    return (_move(new, rest, on_device), *out)

  return wrapped


def to_device(fn, on_device: Any, rest: Any):
  """``fn(state, *args)`` with the state's offloaded leaves moved to the
  device first (evaluation reads the anchor)."""

  @functools.wraps(fn)
  def wrapped(state, *args):
    return fn(_move(state, on_device, rest), *args)

  return wrapped
