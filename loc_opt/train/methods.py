"""Training methods by name: how the optimizer wraps the inner optimizer.

A method says whether each worker keeps its own state (a leading worker axis
on every array), how to build the transform from the config, which weights
to evaluate, and whether the next step is a sync step.
"""

from collections.abc import Callable, Mapping
import dataclasses
from typing import Any

import ml_collections
import numpy as np
import optax

from loc_opt import compression
from loc_opt import outer as outer_lib
from loc_opt import parallel


@dataclasses.dataclass(frozen=True)
class Method:
  """A training method the trainer can run.

  Attributes:
    per_worker: whether parameters and optimizer state carry a leading worker
      axis (local-update methods) or are one replicated copy (data parallel).
    build: ``(outer_config, inner_tx, axis_name) -> GradientTransformation``.
    eval_params: ``(opt_state, params) -> params`` to evaluate.
    syncs: ``(outer_config, step, steps_since_sync) -> bool``, whether the
      step after ``step`` steps needs the sync program (None: the method has
      a single program).
  """

  per_worker: bool
  build: Callable[[ml_collections.ConfigDict, optax.GradientTransformation,
                   str], optax.GradientTransformation]
  eval_params: Callable[[Any, Any], Any] = lambda opt_state, params: params
  syncs: Callable[[ml_collections.ConfigDict, int, int], bool] | None = None


def check_sync_every(cfg: ml_collections.ConfigDict) -> int:
  """Validates and returns `outer.sync_every` of a config."""
  h = cfg.sync_every
  if isinstance(h, bool) or not isinstance(h, (int, np.integer)) or h <= 0:
    raise ValueError(f'outer.sync_every must be a positive int, got {h!r}')
  return int(h)


def _reduce_fn(cfg, axis_name):
  """The cross-worker mean of pseudo-gradients: spread over the worker's
  devices, through the configured codec."""
  codec = compression.make_codec(cfg.get('codec', 'none'))
  return parallel.worker_mean(axis_name, codec=codec)


def _build_diloco(cfg, inner, axis_name):
  outer = outer_lib.nesterov_outer(cfg.learning_rate, cfg.momentum)
  if not cfg.get('nesterov', True):
    outer = optax.sgd(cfg.learning_rate, momentum=cfg.momentum or None)
  return outer_lib.diloco(inner, sync_every=check_sync_every(cfg),
                          outer=outer, axis_name=axis_name,
                          reduce_fn=_reduce_fn(cfg, axis_name))


def _build_local_sgd(cfg, inner, axis_name):
  return outer_lib.local_sgd(inner, sync_every=check_sync_every(cfg),
                             axis_name=axis_name,
                             reduce_fn=_reduce_fn(cfg, axis_name))


def _diloco_syncs(cfg, step, steps_since_sync):
  return outer_lib.next_step_syncs(check_sync_every(cfg), step,
                                   steps_since_sync)


def _diloco_eval(opt_state, params):
  return outer_lib.diloco_eval_params(opt_state, params)


METHODS: Mapping[str, Method] = {
    'data_parallel': Method(per_worker=False,
                            build=lambda cfg, inner, axis_name: inner),
    'diloco': Method(per_worker=True, build=_build_diloco,
                     eval_params=_diloco_eval, syncs=_diloco_syncs),
    'local_sgd': Method(per_worker=True, build=_build_local_sgd,
                        eval_params=_diloco_eval, syncs=_diloco_syncs),
}


def get_method(name: str) -> Method:
  if name not in METHODS:
    raise ValueError(f'unknown method {name!r} (field outer.method); choose '
                     f'one of {sorted(METHODS)}')
  return METHODS[name]
