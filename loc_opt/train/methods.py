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


def make_compressor(cfg: ml_collections.ConfigDict) -> compression.Compressor:
  """The compressor an ``outer`` config section names.

  Fields: ``codec`` (a name of ``loc_opt.compression.make_compressor``),
  ``codec_kwargs`` (its arguments), ``error_feedback`` (``'none'``, ``'ef'``,
  ``'ef21'``, ``'econtrol'``), ``econtrol_eta`` and ``compress_min_size``
  (smaller leaves are sent in fp32 and get no error buffer).
  """
  name = cfg.get('codec', 'none')
  try:
    scheme = compression.make_compressor(
        name, field='outer.codec', **dict(cfg.get('codec_kwargs', {})))
  except TypeError as e:
    raise ValueError(f'outer.codec_kwargs do not fit codec {name!r}: {e}') \
        from e
  mode = cfg.get('error_feedback', 'none')
  if mode not in compression.FEEDBACK:
    raise ValueError(f'unknown outer.error_feedback {mode!r}; choose one of '
                     f'{sorted(compression.FEEDBACK)}')
  min_size = cfg.get('compress_min_size', 0)
  if min_size < 0:
    raise ValueError(f'outer.compress_min_size must be >= 0, got {min_size}')
  return compression.build_compressor(
      scheme, error_feedback=mode,
      econtrol_eta=cfg.get('econtrol_eta', 0.1),
      eligible=compression.min_size(min_size) if min_size else None)


def _build_diloco(cfg, inner, axis_name):
  outer = outer_lib.nesterov_outer(cfg.learning_rate, cfg.momentum)
  if not cfg.get('nesterov', True):
    outer = optax.sgd(cfg.learning_rate, momentum=cfg.momentum or None)
  return outer_lib.diloco(inner, sync_every=check_sync_every(cfg),
                          outer=outer, axis_name=axis_name,
                          codec=make_compressor(cfg))


def _build_local_sgd(cfg, inner, axis_name):
  return outer_lib.local_sgd(inner, sync_every=check_sync_every(cfg),
                             axis_name=axis_name,
                             codec=make_compressor(cfg))


def _build_compressed_dp(cfg, inner, axis_name):
  start = cfg.get('compress_start_step', 0)
  if start < 0:
    raise ValueError(f'outer.compress_start_step must be >= 0, got {start}')
  reduce = compression.compressed_all_reduce(
      make_compressor(cfg), axis_name, start_step=start)
  return optax.chain(reduce, inner)


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
    # Data parallel where each worker computes its own gradient and only the
    # compressed payloads (outer.codec) cross workers, every step.
    'compressed_data_parallel': Method(per_worker=True,
                                       build=_build_compressed_dp),
}


def get_method(name: str) -> Method:
  if name not in METHODS:
    raise ValueError(f'unknown method {name!r} (field outer.method); choose '
                     f'one of {sorted(METHODS)}')
  return METHODS[name]
