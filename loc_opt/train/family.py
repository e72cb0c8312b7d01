"""The DiLoCo family as trainer methods: config fields to transforms.

Every method here syncs on a fixed host-side plan (``loc_opt.outer.plan``):
the trainer compiles one program per phase (an inner step, a fragment's
send, a peer-group exchange, a state sync, ...) and reads each one's bytes
from its HLO. Their settings live in ``config.outer`` (``sync_every``,
``learning_rate``, ``momentum``, ``codec``) and in a section per method
(``outer.streaming``, ``outer.noloco``, ...; see ``configs/diloco_lm.py``).
"""

from collections.abc import Mapping
from typing import Any

import jax
import ml_collections

from loc_opt import models

from loc_opt.outer import asynchronous
from loc_opt.outer import server_momentum
from loc_opt.outer import decoupled
from loc_opt.outer import desynced
from loc_opt.outer import eager
from loc_opt.outer import no_allreduce
from loc_opt.outer import robust_average
from loc_opt.outer import stale_overlap
from loc_opt.outer import sparse_outer
from loc_opt.outer import streaming
from loc_opt.train import methods
from loc_opt.train import simulated_time


def _section(config: ml_collections.ConfigDict, name: str
             ) -> ml_collections.ConfigDict:
  return config.outer.get(name) or ml_collections.ConfigDict()


def _h(config) -> int:
  return methods.check_sync_every(config.outer)


def _checked(field: str, fn, *args, **kwargs):
  """Calls ``fn``; a ValueError / TypeError names the config section."""
  try:
    return fn(*args, **kwargs)
  except (TypeError, ValueError) as e:
    raise ValueError(f'{field}: {e}') from e


# Streaming DiLoCo.

def _streaming_args(config) -> dict[str, Any]:
  s = _section(config, 'streaming')
  return {'num_fragments': int(s.get('num_fragments', 3)),
          'overlap': int(s.get('overlap', 0))}


def _streaming_plan(config):
  return _checked('outer.streaming', streaming.streaming_plan, _h(config),
                  **_streaming_args(config))


def _build_streaming(config, inner, axis_name, sync_every):
  del sync_every
  s = _section(config, 'streaming')
  args = _streaming_args(config)
  # Which fragment each parameter is in, from the model's parameter names.
  shapes = jax.eval_shape(models.build_model(config.model).init,
                          jax.random.key(0))
  fragments = _checked(
      'outer.streaming', streaming.fragment_ids, shapes,
      args['num_fragments'], pattern=s.get('pattern', 'strided'))
  return _checked(
      'outer.streaming', streaming.streaming_diloco, inner,
      sync_every=_h(config), num_fragments=args['num_fragments'],
      fragments=fragments, overlap=args['overlap'],
      alpha=s.get('alpha', None),
      outer=methods.outer_optimizer(config.outer),
      axis_name=axis_name, codec=methods.make_compressor(config.outer))


# Eager updates.

def _build_eager(config, inner, axis_name, sync_every):
  del sync_every
  return eager.eager_diloco(
      inner, sync_every=_h(config),
      outer=methods.outer_optimizer(config.outer),
      axis_name=axis_name, codec=methods.make_compressor(config.outer),
      naive=bool(_section(config, 'eager').get('naive', False)))


# NoLoCo.

def _noloco_args(config) -> dict[str, Any]:
  s = _section(config, 'noloco')
  return {'group_size': int(s.get('group_size', 2)),
          'seed': int(s.get('seed', 0))}


def _noloco_plan(config):
  return _checked('outer.noloco', no_allreduce.noloco_plan, _h(config),
                  config.mesh.workers, **_noloco_args(config))


def _build_noloco(config, inner, axis_name, sync_every):
  del sync_every
  s = _section(config, 'noloco')
  consensus = s.get('consensus', -1.0)
  return _checked(
      'outer.noloco', no_allreduce.noloco, inner, sync_every=_h(config),
      learning_rate=config.outer.learning_rate,
      momentum=s.get('momentum', 0.5),
      consensus=None if consensus is None or consensus < 0 else consensus,
      axis_name=axis_name, **_noloco_args(config))


# DeMo.

def _build_demo(config, inner, axis_name, sync_every):
  del inner, sync_every  # DeMo is the whole optimizer
  from loc_opt.train import trainer  # pylint: disable=g-import-not-at-top
  s = _section(config, 'demo')
  schedule = trainer._lr_schedule(config)  # pylint: disable=protected-access
  scale = float(s.get('lr_scale', 1.0))
  lr = schedule if scale == 1.0 else (lambda count: scale * schedule(count))
  tx = _checked(
      'outer.demo', decoupled.demo, lr, beta=s.get('beta', 0.999),
      topk=int(s.get('topk', 32)), chunk=int(s.get('chunk', 64)),
      weight_decay=s.get('weight_decay', 0.0), axis_name=axis_name)
  return tx


# SparseLoCo.

def _build_sparseloco(config, inner, axis_name, sync_every):
  del sync_every
  s = _section(config, 'sparseloco')
  codec = s.get('value_codec', 'two_bit')
  return _checked(
      'outer.sparseloco', sparse_outer.sparseloco, inner,
      sync_every=_h(config), ef_decay=s.get('ef_decay', 0.95),
      topk=int(s.get('topk', 128)), tile=int(s.get('tile', 64)),
      value_codec=None if codec in (None, 'none') else codec,
      learning_rate=s.get('learning_rate', 1.0),
      aggregate=s.get('aggregate', 'mean_of_selected'), axis_name=axis_name)


# DES-LOC and MT-DAO.

def _state_periods(config, mt: bool) -> dict[str, int]:
  s, h = _section(config, 'desloc'), _h(config)
  if mt:
    return {'slow': int(s.get('slow_sync_every', 0)) or h,
            'nu': int(s.get('nu_sync_every', 0)) or h}
  return {'mu': int(s.get('mu_sync_every', 0)) or 3 * h,
          'nu': int(s.get('nu_sync_every', 0)) or 6 * h}


def _desloc_outer(config):
  if _section(config, 'desloc').get('nesterov', False):
    return methods.outer_optimizer(config.outer)
  return None


def _desloc_plan(config, mt=False):
  if mt and config.optimizer.name != 'multi_timescale_adam':
    raise ValueError(f"outer.method='mt_dao' needs optimizer.name="
                     f"'multi_timescale_adam', got {config.optimizer.name!r}")
  return _checked('outer.desloc', desynced.desloc_plan, _h(config),
                  _state_periods(config, mt))


def _build_desloc(config, inner, axis_name, sync_every, mt=False):
  del sync_every
  return _checked(
      'outer.desloc', desynced.desloc, inner, sync_every=_h(config),
      state_sync_every=_state_periods(config, mt),
      outer=_desloc_outer(config), axis_name=axis_name)


# Asynchronous local SGD.

def _async_args(config) -> dict[str, Any]:
  s = _section(config, 'async_sgd')
  return {'speeds': simulated_time.worker_speeds(config),
          'sync_every': _h(config), 'dylu': bool(s.get('dylu', True))}


def _async_plan(config):
  return _checked('outer.async_sgd', asynchronous.async_plan,
                  **_async_args(config))


def _build_async(config, inner, axis_name, sync_every):
  del sync_every
  s = _section(config, 'async_sgd')
  n = int(s.get('buffer_size', 0)) or config.mesh.workers
  server = _checked(
      'outer.async_sgd', server_momentum.delayed_nesterov,
      config.outer.learning_rate, momentum=config.outer.momentum,
      buffer_size=n, activation=s.get('activation', 0.0))
  return _checked('outer.async_sgd', asynchronous.async_local_sgd, inner,
                  outer=server, axis_name=axis_name, **_async_args(config))


# EDiT and CO2.

def _build_edit(config, inner, axis_name, sync_every):
  del sync_every
  s = _section(config, 'edit')
  return _checked(
      'outer.edit', robust_average.edit_diloco, inner, sync_every=_h(config),
      outer=methods.outer_optimizer(config.outer),
      ewma=s.get('ewma', 0.02), warmup_syncs=int(s.get('warmup_syncs', 120)),
      z_threshold=s.get('z_threshold', 3.0),
      temperature=s.get('temperature', 1.0),
      clip_norm=s.get('clip_norm', 0.0) or None, axis_name=axis_name)


def _build_co2(config, inner, axis_name, sync_every):
  del sync_every
  s = _section(config, 'co2')
  return _checked(
      'outer.co2', stale_overlap.co2, inner, sync_every=_h(config),
      outer_lr=s.get('learning_rate', 1.0), momentum=s.get('momentum', 0.5),
      staleness_penalty=s.get('staleness_penalty', 1.0),
      clip=s.get('clip', 1.0) or None, axis_name=axis_name)


METHODS: Mapping[str, methods.Method] = {
    'streaming_diloco': methods.Method(
        per_worker=True, build=_build_streaming,
        eval_params=streaming.streaming_eval_params,
        plan=_streaming_plan,
        overlap_steps=lambda cfg: int(
            (cfg.get('streaming') or {}).get('overlap', 0))),
    'eager_diloco': methods.Method(
        per_worker=True, build=_build_eager,
        eval_params=eager.eager_eval_params,
        plan=lambda config: eager.eager_plan(_h(config)),
        # the average of a round may arrive any time in the next round
        overlap_steps=methods.check_sync_every),
    'noloco': methods.Method(
        per_worker=True, build=_build_noloco,
        eval_params=no_allreduce.noloco_eval_params,
        plan=_noloco_plan),
    'demo': methods.Method(
        per_worker=True, build=_build_demo,
        eval_params=decoupled.demo_eval_params,
        plan=lambda config: decoupled.demo_plan()),
    'sparseloco': methods.Method(
        per_worker=True, build=_build_sparseloco,
        eval_params=sparse_outer.sparseloco_eval_params,
        plan=lambda config: sparse_outer.sparseloco_plan(_h(config))),
    'desloc': methods.Method(
        per_worker=True, build=_build_desloc,
        eval_params=desynced.desloc_eval_params,
        plan=_desloc_plan),
    'mt_dao': methods.Method(
        per_worker=True,
        build=lambda *a: _build_desloc(*a, mt=True),
        eval_params=desynced.desloc_eval_params,
        plan=lambda config: _desloc_plan(config, mt=True)),
    'edit_diloco': methods.Method(
        per_worker=True, build=_build_edit,
        eval_params=robust_average.edit_eval_params,
        plan=lambda config: robust_average.edit_plan(_h(config))),
    'co2': methods.Method(
        per_worker=True, build=_build_co2,
        eval_params=stale_overlap.co2_eval_params,
        plan=lambda config: stale_overlap.co2_plan(_h(config)),
        # the stale average may arrive any time in the next round
        overlap_steps=methods.check_sync_every),
    'async_local_sgd': methods.Method(
        per_worker=True, build=_build_async,
        eval_params=asynchronous.async_eval_params,
        plan=_async_plan, waits_for_stragglers=False),
}
