"""Every training method by name (``outer.method``): config to transform.

One entry per method: how its transform is built from the config, its plan
of phases, its evaluation weights and what the wall-clock model needs (see
:class:`loc_opt.train.method.Method`). The trainer reads :data:`METHODS`;
nothing here reads the trainer back.

A method's own settings live in the config section named after it,
``outer.<method>`` (``outer.streaming_diloco``, ``outer.noloco``, ...; see
``configs/diloco_lm.py``), beside the shared ``outer`` fields
(``sync_every``, ``learning_rate``, ``momentum``, ``codec``). Fields the
library functions also take are passed by name with the functions' defaults
in the config file (``tests/train/test_registry.py``): one source each.
"""

from collections.abc import Callable, Mapping
import functools
import json
from typing import Any

import jax
import jax.numpy as jnp
import optax

from loc_opt import _checks
from loc_opt import compression
from loc_opt import models
from loc_opt import outer as outer_lib
from loc_opt.outer import plan as plan_lib
from loc_opt.outer.desloc import DEFAULT_STATE_FACTORS
from loc_opt.train import config as cfg_lib
from loc_opt.train import faults
from loc_opt.train import group_sync
from loc_opt.train import hierarchy
from loc_opt.train import outer_layout
from loc_opt.train import simulated_time
from loc_opt.train.method import library_default
from loc_opt.train.method import Method

_section = cfg_lib.section
_h = cfg_lib.sync_every


def _pick(config, name: str, fields: tuple[str, ...],
          rename: Mapping[str, str] | None = None) -> dict[str, Any]:
  """The ``fields`` present in section ``outer.<name>``, keyed by the library
  argument they set (``rename`` maps field -> argument)."""
  s, rename = _section(config, name), rename or {}
  return {rename.get(f, f): cfg_lib.plain(s[f]) for f in fields if f in s}


_required = cfg_lib.required


def _kwargs(method: str, fn: Callable[..., Any], config) -> dict[str, Any]:
  """The arguments method ``method``'s section gives library function
  ``fn``."""
  return dict(METHODS[method].library_kwargs(config)[fn])


# --------------------------------------------- DiLoCo, local SGD, data parallel


def _period_plan(config) -> plan_lib.Plan:
  return plan_lib.period_plan(cfg_lib.make_sync_every(config),
                              config.num_steps)


def _codec(config):
  """``outer.codec``'s compressor; under a rule that all-gathers every
  worker's pseudo-gradient (median, trimmed mean) its stateless codec by
  name, or None for fp32."""
  rule = cfg_lib.aggregate_kwargs(config).get('aggregate', 'mean')
  if rule in outer_lib.robust.GATHERED:
    return cfg_lib.gather_codec(config)
  return cfg_lib.make_compressor(config)


def _build_diloco(config, inner, axis_name):
  return cfg_lib.checked(
      'outer.aggregate', outer_lib.diloco, inner,
      sync_every=cfg_lib.make_sync_every(config),
      outer=cfg_lib.outer_optimizer(config), axis_name=axis_name,
      **outer_layout.library_kwargs(config, _codec),
      **cfg_lib.aggregate_kwargs(config))


def _build_local_sgd(config, inner, axis_name):
  return cfg_lib.checked(
      'outer.aggregate', outer_lib.local_sgd, inner,
      sync_every=cfg_lib.make_sync_every(config), axis_name=axis_name,
      **outer_layout.library_kwargs(config, _codec),
      **cfg_lib.aggregate_kwargs(config))


def _build_compressed_dp(config, inner, axis_name):
  start = _checks.nonnegative_int(config.outer.compress_start_step,
                                  'outer.compress_start_step')
  reduce = compression.compressed_all_reduce(
      cfg_lib.make_compressor(config), axis_name, start_step=start)
  return optax.chain(reduce, inner)


def _diloco_eval(opt_state, params):
  # The anchor, whatever the inner optimizer. With a schedule-free inner
  # optimizer too: the anchor is the one shared model, built from the
  # workers' y-iterates; the schedule-free average x = (y - (1 - b1) z) / b1
  # needs each worker's own z, which is never averaged, and after a sync
  # the local y is reset to the anchor while z is not, so that formula no
  # longer gives the average of any trajectory.
  return outer_lib.diloco_eval_params(opt_state, params)


def _diloco_counters(opt_state):
  return opt_state.num_syncs, opt_state.steps_since_sync


def _left_out(opt_state):
  return opt_state.left_out


# ------------------------------------------------------- Streaming DiLoCo


def _streaming_kwargs(config):
  return {
      outer_lib.streaming_diloco: _pick(config, 'streaming_diloco',
                                        ('overlap', 'alpha')),
      outer_lib.fragment_ids: _pick(config, 'streaming_diloco', ('pattern',)),
  }


def _streaming_overlap(config) -> int:
  kwargs = _kwargs('streaming_diloco', outer_lib.streaming_diloco, config)
  return int(kwargs.get('overlap', library_default(
      outer_lib.streaming_diloco, 'overlap')))


def _streaming_fragments(config) -> int:
  p = int(_required(config, 'streaming_diloco', 'num_fragments'))
  return cfg_lib.streaming_fragments(p, _h(config))


def _streaming_plan(config):
  return cfg_lib.checked(
      'outer.streaming_diloco', outer_lib.streaming_plan, _h(config),
      _streaming_fragments(config), _streaming_overlap(config))


def _build_streaming(config, inner, axis_name):
  num_fragments = _streaming_fragments(config)
  # Which fragment each parameter is in, from the model's parameter names.
  shapes = jax.eval_shape(models.build_model(config.model).init,
                          jax.random.key(0))
  fragments = cfg_lib.checked(
      'outer.streaming_diloco', outer_lib.fragment_ids, shapes,
      num_fragments, **_kwargs('streaming_diloco', outer_lib.fragment_ids,
                               config))
  return cfg_lib.checked(
      'outer.streaming_diloco', outer_lib.streaming_diloco, inner,
      sync_every=_h(config), num_fragments=num_fragments,
      fragments=fragments, outer=cfg_lib.outer_optimizer(config),
      axis_name=axis_name, codec=_codec(config),
      **cfg_lib.aggregate_kwargs(config),
      **_kwargs('streaming_diloco', outer_lib.streaming_diloco, config))


# ------------------------------------------------------- Decoupled DiLoCo

_DECOUPLED_TX = ('merge', 'rda_scope', 'weighting', 'alpha', 'rejoin_state')
_DECOUPLED_CLOCK = ('overlap', 'quorum', 'grace', 'grace_cap', 'sync_steps',
                    'jitter')


def _decoupled_kwargs(config):
  return {outer_lib.decoupled_diloco: _pick(config, 'decoupled_diloco',
                                            _DECOUPLED_TX),
          outer_lib.decoupled_timeline: _pick(config, 'decoupled_diloco',
                                              _DECOUPLED_CLOCK)}


@functools.lru_cache(maxsize=8)
def _timeline_of(key: str) -> outer_lib.Timeline:
  args = json.loads(key)
  return outer_lib.decoupled_timeline(args.pop('num_steps'), **args)


def decoupled_timeline(config) -> outer_lib.Timeline:
  """The run's Decoupled DiLoCo timeline (``loc_opt.outer.decoupled_clock``)
  from the config: ``outer.decoupled_diloco``'s clock fields, learner speeds
  ``wallclock.worker_speeds``, and the fault trace ``faults.failures`` plus
  the chaos model's (seeded with ``seed``). A pure function of the config,
  so a resumed run rebuilds the same timeline."""
  s, m = faults.settings(config), config.mesh.workers
  num_fragments = int(_required(config, 'decoupled_diloco', 'num_fragments'))
  if _h(config) // max(num_fragments, 1) > config.num_steps:
    raise ValueError(
        f'outer.sync_every={_h(config)} with outer.decoupled_diloco.'
        f'num_fragments={num_fragments} opens no fragment window in '
        f'num_steps={config.num_steps}: outer.method=\'decoupled_diloco\' '
        'would never merge; lower outer.sync_every or raise num_steps')
  trace = list(s['failures'])
  if s['chaos_mtbf_steps']:
    trace += cfg_lib.checked(
        'faults.chaos_mtbf_steps', outer_lib.chaos_failures, m,
        config.num_steps, mtbf=s['chaos_mtbf_steps'],
        downtime=s['chaos_downtime_steps'],
        chips=s['chaos_chips_per_learner'], seed=config.seed)
  tx_kwargs = _kwargs('decoupled_diloco', outer_lib.decoupled_diloco, config)
  args = dict(
      num_steps=config.num_steps, num_learners=m, sync_every=_h(config),
      num_fragments=num_fragments,
      speeds=list(simulated_time.worker_speeds(config)),
      failures=[list(f) for f in trace],
      peer_rejoin=tx_kwargs.get('rejoin_state') == 'peer', seed=config.seed,
      **_kwargs('decoupled_diloco', outer_lib.decoupled_timeline, config))
  return cfg_lib.checked('outer.decoupled_diloco', _timeline_of,
                         json.dumps(args, sort_keys=True))


def _decoupled_inputs(config):
  """``(step, worker) -> update kwargs`` from the timeline's tables."""
  timeline = decoupled_timeline(config)
  last = timeline.num_steps - 1
  tables = {k: timeline.inputs(slice(None))[k] for k in
            ('active', 'admitted', 'receive', 'rejoin')}

  def inputs(step, worker):
    t = jnp.minimum(step, last)
    return {k: jnp.asarray(v)[t, worker] for k, v in tables.items()}

  return inputs


def _build_decoupled(config, inner, axis_name):
  return cfg_lib.checked(
      'outer.decoupled_diloco', outer_lib.decoupled_diloco, inner,
      num_fragments=int(_required(config, 'decoupled_diloco',
                                  'num_fragments')),
      outer=cfg_lib.outer_optimizer(config), axis_name=axis_name,
      codec=cfg_lib.make_compressor(config),
      **_kwargs('decoupled_diloco', outer_lib.decoupled_diloco, config))


def _decoupled_overlap(config) -> int:
  kwargs = _kwargs('decoupled_diloco', outer_lib.decoupled_timeline, config)
  return int(kwargs.get('overlap', library_default(
      outer_lib.decoupled_timeline, 'overlap')))


# --------------------------------------------------------- Eager updates


def _build_eager(config, inner, axis_name):
  return cfg_lib.checked(
      'outer.eager_diloco', outer_lib.eager_diloco, inner, sync_every=_h(
          config), outer=cfg_lib.outer_optimizer(config, 'eager_diloco'),
      axis_name=axis_name, codec=cfg_lib.make_compressor(config),
      **_kwargs('eager_diloco', outer_lib.eager_diloco, config))


# ----------------------------------------------------------------- NoLoCo

_NOLOCO_GROUPS = ('group_size', 'seed')


def _noloco_plan(config):
  kwargs = _kwargs('noloco', outer_lib.noloco, config)
  return cfg_lib.checked(
      'outer.noloco', outer_lib.noloco_plan, _h(config), config.mesh.workers,
      **{k: v for k, v in kwargs.items() if k in _NOLOCO_GROUPS})


def _build_noloco(config, inner, axis_name):
  return cfg_lib.checked(
      'outer.noloco', outer_lib.noloco, inner, sync_every=_h(config),
      learning_rate=config.outer.learning_rate, axis_name=axis_name,
      **_kwargs('noloco', outer_lib.noloco, config))


# ------------------------------------------------------------------- DeMo


def _build_demo(config, inner, axis_name):
  del inner  # DeMo is the whole optimizer
  schedule = cfg_lib.lr_schedule(config)
  scale = float(_required(config, 'demo', 'lr_scale'))
  lr = schedule if scale == 1.0 else (lambda count: scale * schedule(count))
  return cfg_lib.checked(
      'outer.demo', outer_lib.demo, lr, axis_name=axis_name,
      **_kwargs('demo', outer_lib.demo, config))


# ------------------------------------------------------------- SparseLoCo


def _sparseloco_kwargs(config):
  kwargs = _pick(config, 'sparseloco', (
      'ef_decay', 'topk', 'tile', 'value_codec', 'learning_rate',
      'aggregate'))
  if kwargs.get('value_codec') == 'none':
    kwargs['value_codec'] = None
  return {outer_lib.sparseloco: kwargs}


def _build_sparseloco(config, inner, axis_name):
  return cfg_lib.checked(
      'outer.sparseloco', outer_lib.sparseloco, inner, sync_every=_h(config),
      axis_name=axis_name,
      **_kwargs('sparseloco', outer_lib.sparseloco, config))


# ------------------------------------------------------- DES-LOC, MT-DAO


def _state_periods(config, mt: bool) -> dict[str, int]:
  """Each synced optimizer-state field's period; a 0 field is a multiple of
  ``sync_every`` (DES-LOC: the library's factors; MT-DAO: 1x)."""
  s, h = _section(config, 'desloc'), _h(config)
  if mt:
    return {'slow': int(s.get('slow_sync_every', 0)) or h,
            'nu': int(s.get('nu_sync_every', 0)) or h}
  return {name: int(s.get(f'{name}_sync_every', 0)) or factor * h
          for name, factor in DEFAULT_STATE_FACTORS.items()}


def _desloc_plan(config, mt=False):
  if mt:
    cfg_lib.mt_dao_optimizer(config)  # checks optimizer.name
  # Building the transform checks average_at and clip_radius up front.
  cfg_lib.checked('outer.desloc', outer_lib.desloc, optax.identity(),
                  sync_every=_h(config),
                  **_kwargs('mt_dao' if mt else 'desloc', outer_lib.desloc,
                            config))
  return cfg_lib.checked('outer.desloc', outer_lib.desloc_plan, _h(config),
                         _state_periods(config, mt))


_DESLOC_FIELDS = ('average_at', 'clip_radius')


def _build_desloc(config, inner, axis_name, mt=False):
  nesterov = bool(_required(config, 'desloc', 'nesterov'))
  return cfg_lib.checked(
      'outer.desloc', outer_lib.desloc, inner, sync_every=_h(config),
      state_sync_every=_state_periods(config, mt),
      outer=cfg_lib.outer_optimizer(config) if nesterov else None,
      axis_name=axis_name,
      **_kwargs('mt_dao' if mt else 'desloc', outer_lib.desloc, config))


# ------------------------------------------------- Asynchronous local SGD


def _async_kwargs(config):
  return {outer_lib.async_local_sgd: _pick(config, 'async_local_sgd',
                                           ('dylu',)),
          outer_lib.delayed_nesterov: _pick(config, 'async_local_sgd',
                                            ('activation',))}


def _async_args(config) -> dict[str, Any]:
  return {'speeds': simulated_time.worker_speeds(config),
          'sync_every': _h(config),
          **_kwargs('async_local_sgd', outer_lib.async_local_sgd, config)}


def _async_plan(config):
  return cfg_lib.checked('outer.async_local_sgd', outer_lib.async_plan,
                         **_async_args(config))


def _build_async(config, inner, axis_name):
  # DN's buffer N: 0 in the config means one push per worker.
  n = int(_required(config, 'async_local_sgd', 'buffer_size'))
  server = cfg_lib.checked(
      'outer.async_local_sgd', outer_lib.delayed_nesterov,
      config.outer.learning_rate, momentum=config.outer.momentum,
      buffer_size=n or config.mesh.workers,
      **_kwargs('async_local_sgd', outer_lib.delayed_nesterov, config))
  return cfg_lib.checked('outer.async_local_sgd', outer_lib.async_local_sgd,
                         inner, outer=server, axis_name=axis_name,
                         **_async_args(config))


# ----------------------------------------------------------- EDiT and CO2


def _build_edit(config, inner, axis_name):
  return cfg_lib.checked(
      'outer.edit_diloco', outer_lib.edit_diloco, inner,
      sync_every=_h(config), outer=cfg_lib.outer_optimizer(config),
      axis_name=axis_name,
      **_kwargs('edit_diloco', outer_lib.edit_diloco, config))


def _co2_kwargs(config):
  kwargs = _pick(config, 'co2', ('learning_rate', 'momentum',
                                 'staleness_penalty', 'clip'),
                 rename={'learning_rate': 'outer_lr'})
  if 'clip' in kwargs and not kwargs['clip']:
    kwargs['clip'] = None  # 0: no clip
  return {outer_lib.co2: kwargs}


def _build_co2(config, inner, axis_name):
  return cfg_lib.checked(
      'outer.co2', outer_lib.co2, inner, sync_every=_h(config),
      axis_name=axis_name, **_kwargs('co2', outer_lib.co2, config))


# The optimizer-state fields that are bit-identical on every worker
# (Method.shared_fields; tests/train/test_layout.py checks each set).
_COUNTERS = ('count', 'steps_since_sync', 'num_syncs')
_OUTER_FIELDS = ('anchor', 'outer_state')  # outer.state_layout places them
_DILOCO_SHARED = _OUTER_FIELDS + _COUNTERS
# DES-LOC's inner state is averaged field by field on its own periods, so
# it is shared only right after those syncs: per worker.
_DESLOC_SHARED = ('anchor', 'outer_state', 'count', 'num_syncs')


def _fixed_plan(plan_fn):
  """A plan from ``plan_fn(H)`` (the methods that sync every H steps)."""
  return lambda config: plan_fn(_h(config))


def _section_kwargs(fn, name, fields):
  return lambda config: {fn: _pick(config, name, fields)}


METHODS: Mapping[str, Method] = {
    # Gradients all-reduced every step; the inner optimizer ignores the
    # phase every method's update is given.
    'data_parallel': Method(
        per_worker=False,
        build=lambda config, inner, axis_name: optax.with_extra_args_support(
            inner),
        plan=lambda config: plan_lib.no_sync_plan()),
    'diloco': Method(
        per_worker=True, build=_build_diloco, plan=_period_plan,
        eval_params=_diloco_eval, counters=_diloco_counters,
        follows_sync_schedule=True, shared_fields=_DILOCO_SHARED,
        elastic=True, left_out=_left_out,
        state_layouts=cfg_lib.STATE_LAYOUTS, outer_fields=_OUTER_FIELDS),
    'local_sgd': Method(
        per_worker=True, build=_build_local_sgd, plan=_period_plan,
        eval_params=_diloco_eval, counters=_diloco_counters,
        follows_sync_schedule=True, shared_fields=_DILOCO_SHARED,
        elastic=True, left_out=_left_out,
        state_layouts=cfg_lib.STATE_LAYOUTS, outer_fields=_OUTER_FIELDS),
    # Data parallel where each worker computes its own gradient and only the
    # compressed payloads (outer.codec) cross workers, every step.
    'compressed_data_parallel': Method(
        per_worker=True, build=_build_compressed_dp,
        plan=lambda config: plan_lib.no_sync_plan(),
        local_inner_steps=False),
    'streaming_diloco': Method(
        per_worker=True, build=_build_streaming, plan=_streaming_plan,
        eval_params=outer_lib.streaming_eval_params,
        overlap_steps=_streaming_overlap, section='streaming_diloco',
        library_kwargs=_streaming_kwargs,
        shared_fields=('anchor', 'outer_state', 'in_flight', 'count', 'sends',
                       'applies'),
        elastic=True, left_out=_left_out),
    # Learners on their own clocks; the timeline (worker speeds, failures,
    # quorum and grace) gives each step's per-learner masks.
    'decoupled_diloco': Method(
        per_worker=True, build=_build_decoupled,
        plan=lambda config: decoupled_timeline(config).plan(),
        eval_params=outer_lib.decoupled_eval_params,
        overlap_steps=_decoupled_overlap, waits_for_stragglers=False,
        section='decoupled_diloco', library_kwargs=_decoupled_kwargs,
        shared_fields=('anchor', 'outer_state', 'count', 'merges'),
        left_out=_left_out, step_inputs=_decoupled_inputs),
    'eager_diloco': Method(
        per_worker=True, build=_build_eager,
        plan=_fixed_plan(outer_lib.eager_plan),
        eval_params=outer_lib.eager_eval_params,
        # the average of a round may arrive any time in the next round
        overlap_steps=_h, section='eager_diloco',
        library_kwargs=_section_kwargs(outer_lib.eager_diloco,
                                       'eager_diloco', ('naive',)),
        # each worker keeps its own anchor and outer state
        shared_fields=('prev_mean',) + _COUNTERS),
    'noloco': Method(
        per_worker=True, build=_build_noloco, plan=_noloco_plan,
        eval_params=outer_lib.noloco_eval_params, section='noloco',
        library_kwargs=_section_kwargs(outer_lib.noloco, 'noloco', (
            'momentum', 'consensus') + _NOLOCO_GROUPS),
        # each worker keeps its own anchor and momentum
        shared_fields=_COUNTERS),
    'demo': Method(
        per_worker=True, build=_build_demo,
        plan=lambda config: outer_lib.demo_plan(),
        eval_params=outer_lib.demo_eval_params, section='demo',
        library_kwargs=_section_kwargs(outer_lib.demo, 'demo', (
            'beta', 'topk', 'chunk', 'weight_decay'))),
    'sparseloco': Method(
        per_worker=True, build=_build_sparseloco,
        plan=_fixed_plan(outer_lib.sparseloco_plan),
        eval_params=outer_lib.sparseloco_eval_params, section='sparseloco',
        library_kwargs=_sparseloco_kwargs,
        shared_fields=('anchor',) + _COUNTERS),
    'desloc': Method(
        per_worker=True, build=_build_desloc, plan=_desloc_plan,
        eval_params=outer_lib.desloc_eval_params, section='desloc',
        library_kwargs=_section_kwargs(outer_lib.desloc, 'desloc',
                                       _DESLOC_FIELDS),
        shared_fields=_DESLOC_SHARED),
    'mt_dao': Method(
        per_worker=True,
        build=lambda *args: _build_desloc(*args, mt=True),
        plan=lambda config: _desloc_plan(config, mt=True),
        eval_params=outer_lib.desloc_eval_params, section='desloc',
        library_kwargs=_section_kwargs(outer_lib.desloc, 'desloc',
                                       _DESLOC_FIELDS),
        shared_fields=_DESLOC_SHARED),
    'edit_diloco': Method(
        per_worker=True, build=_build_edit,
        plan=_fixed_plan(outer_lib.edit_plan),
        eval_params=outer_lib.edit_eval_params, section='edit_diloco',
        library_kwargs=_section_kwargs(outer_lib.edit_diloco, 'edit_diloco', (
            'ewma', 'warmup_syncs', 'z_threshold', 'temperature',
            'clip_norm')),
        # the norm statistics and the weight are each worker's own
        shared_fields=_DILOCO_SHARED + ('num_dropped', 'total_dropped')),
    'co2': Method(
        per_worker=True, build=_build_co2,
        plan=_fixed_plan(outer_lib.co2_plan),
        eval_params=outer_lib.co2_eval_params,
        # the stale average may arrive any time in the next round
        overlap_steps=_h, section='co2', library_kwargs=_co2_kwargs,
        shared_fields=('anchor', 'outer_momentum', 'stale_mean') + _COUNTERS),
    # Groups of workers sync every H1 steps, the groups every H2.
    'hierarchical_diloco': Method(
        per_worker=True, build=hierarchy.build, plan=hierarchy.plan,
        eval_params=outer_lib.hierarchical_eval_params,
        section=hierarchy.SECTION, library_kwargs=hierarchy.library_kwargs,
        # the group anchor and outer state are each group's own
        shared_fields=('anchor', 'outer_state', 'num_global_syncs')
        + _COUNTERS),
    'group_diloco': group_sync.METHOD,  # a MoE LM's routers on their own H
    'async_local_sgd': Method(
        per_worker=True, build=_build_async, plan=_async_plan,
        eval_params=outer_lib.async_eval_params, waits_for_stragglers=False,
        section='async_local_sgd', library_kwargs=_async_kwargs,
        # every worker replays every push; start_params and version are its
        # own
        shared_fields=('server_params', 'server_state', 'count', 'progress',
                       'round_steps', 'num_pushes')),
}


def _optional(check):
  return lambda value, field: None if value is None else check(value, field)


# The rates and momenta of the methods' own sections, checked before a run
# (the other fields are checked by the library functions they go to).
_SECTION_CHECKS: Mapping[str, Mapping[str, Callable[[Any, str], Any]]] = {
    'noloco': {'momentum': cfg_lib.momentum,
               'consensus': _optional(cfg_lib.learning_rate)},
    'demo': {'beta': cfg_lib.momentum, 'lr_scale': cfg_lib.learning_rate},
    'sparseloco': {'learning_rate': cfg_lib.learning_rate,
                   'ef_decay': lambda value, field: _checks.in_interval(
                       value, field, 0.0, 1.0)},
    'eager_diloco': {'learning_rate': _optional(cfg_lib.learning_rate),
                     'momentum': _optional(cfg_lib.momentum)},
    'co2': {'learning_rate': cfg_lib.learning_rate,
            'momentum': cfg_lib.momentum},
    'hierarchical_diloco': {'global_learning_rate': cfg_lib.learning_rate,
                            'global_momentum': cfg_lib.momentum},
}


def check_section(config) -> None:
  """Validates the learning rates and momenta of the section of the method
  ``outer.method`` names (``outer.co2.learning_rate``, ``outer.demo.lr_scale``,
  ...): rates finite and ``>= 0``, momenta in ``[0, 1)``."""
  name = get_method(config.outer.method).section
  s = _section(config, name) if name else {}
  for field, check in _SECTION_CHECKS.get(name, {}).items():
    if field in s:
      check(s[field], f'outer.{name}.{field}')


def get_method(name: str) -> Method:
  """The method ``outer.method`` names."""
  if name not in METHODS:
    raise ValueError(f'unknown method {name!r} (field outer.method); choose '
                     f'one of {sorted(METHODS)}')
  return METHODS[name]
