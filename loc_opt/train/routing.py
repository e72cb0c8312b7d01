"""Routing diagnostics of a Mixture-of-Experts LM, logged by the loop.

At every log step and before every sync step the loop runs
:func:`routing_program` on the step's batch and the parameters that enter
the step (each worker's own, for local-update methods) and writes
:func:`routing_scalars`:

* ``routing/load_e{i}``: the fraction of the token assignments that the
  router sends to expert ``i`` (before capacity), averaged over the blocks
  and workers;
* ``routing/imbalance``: ``E * max_e load_e`` per block (1: uniform),
  averaged over blocks and workers; ``routing/imbalance_max``, the largest;
* ``routing/dropped``: the fraction of the assignments past an expert's
  capacity;
* ``routing/entropy``: the router's mean entropy per token (nats; ``ln E``
  at a uniform router);
* ``routing/router_drift`` (local-update methods): how far the workers'
  routers are apart, ``sqrt(mean_m |W_m - mean W|^2) / |mean W|`` over
  every router kernel; 0 right after a sync of the routers, so the value
  written before a sync step is the drift since the last one.

The diagnostics program is not a train step: it is compiled apart (its
cost is one forward pass per logged step) and the drift is read on the
host from the router kernels, so the steps' compiled programs and their
cross-worker bytes are unchanged.
"""

import re
from typing import Any

import jax
import numpy as np

from loc_opt import models
from loc_opt import parallel
from loc_opt.models import moe as moe_lib
from loc_opt.train import hosts

_STATS = ('load', 'dropped', 'entropy')


def routing_program(model: models.Model, mesh: jax.sharding.Mesh,
                    params_sharding: Any, batch_sharding: Any,
                    per_worker: bool, stacked: bool = False):
  """``(params, batch) -> statistics`` (per worker for local-update
  methods), or None for a model without routing (``apply_aux``)."""
  if model.apply_aux is None:
    return None

  def stats(params, batch):
    _, aux = model.apply_aux(params, batch[..., :-1])
    return {k: aux[k] for k in _STATS}

  if per_worker:
    stats = parallel.shard_map_workers(stats, mesh, stacked=stacked)
  program = jax.jit(stats, in_shardings=(params_sharding, batch_sharding))
  if per_worker:
    return program

  def on_mesh(params, batch):  # data parallel: the model's constraints
    with jax.set_mesh(mesh):
      return program(params, batch)

  return on_mesh


def router_drift(params: Any) -> float:
  """``sqrt(mean_m |W_m - mean W|^2) / |mean W|`` over the router kernels
  of per-worker ``params`` (leading worker axis), on the host."""
  spread = norm = 0.0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = jax.tree_util.keystr(path, simple=True, separator='/')
    if not re.search(moe_lib.ROUTER_PATTERN, name):
      continue
    w = np.asarray(hosts.fetch(leaf), np.float64)
    mean = w.mean(axis=0)
    spread += np.sum((w - mean) ** 2) / w.shape[0]
    norm += np.sum(mean ** 2)
  return float(np.sqrt(spread / norm)) if norm else 0.0


def routing_scalars(stats: Any, params: Any, per_worker: bool
                    ) -> dict[str, float]:
  """The metrics of :func:`routing_program`'s statistics and the
  parameters they were computed at (see the module docstring)."""
  load = np.asarray(hosts.fetch(stats['load']), np.float64)
  load = load.reshape(-1, load.shape[-1])  # [workers * blocks, E]
  experts = load.shape[-1]
  imbalance = experts * load.max(axis=-1)
  out = {f'routing/load_e{i}': float(v)
         for i, v in enumerate(load.mean(axis=0))}
  out['routing/imbalance'] = float(imbalance.mean())
  out['routing/imbalance_max'] = float(imbalance.max())
  for key in ('dropped', 'entropy'):
    out[f'routing/{key}'] = float(np.mean(hosts.fetch(stats[key])))
  if per_worker:
    out['routing/router_drift'] = router_drift(params)
  return out
