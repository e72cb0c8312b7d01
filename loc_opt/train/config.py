"""Config fields to library objects: the pieces every method shares.

The experiment config (``configs/diloco_lm.py`` documents every field) names
things; this module turns the shared names into the library's objects: the
inner learning-rate schedule and optimizer, the outer optimizer, the codec of
the cross-worker payload and the sync-period schedule. Every function raises
a ``ValueError`` that names the bad field. Per-method sections
(``outer.<method>``) are read by ``loc_opt.train.registry``.
"""

from collections.abc import Callable, Mapping
import copy
import json
import types
import typing
from typing import Any

import ml_collections
import optax

from loc_opt import _checks
from loc_opt import compression
from loc_opt import inner as inner_lib
from loc_opt import outer as outer_lib
from loc_opt import schedules
from loc_opt.train import spikes as spikes_lib


def config_to_json(config: ml_collections.ConfigDict) -> str:
  """The config as canonical JSON (what a checkpoint records)."""
  return json.dumps(config.to_dict(), sort_keys=True, default=str)


def plain(value: Any) -> Any:
  """A ConfigDict (or anything else) as plain Python containers.

  A config turns ``{'0': 4, '100': 8}`` into a ConfigDict, which is not a
  Mapping; library functions get dicts.
  """
  if isinstance(value, ml_collections.ConfigDict):
    return value.to_dict()
  return value


def with_overrides(config: ml_collections.ConfigDict,
                   overrides: Mapping[str, Any], *, sep: str = '.'
                   ) -> ml_collections.ConfigDict:
  """A copy of ``config`` with the fields ``overrides`` names replaced.

  Keys are dotted paths (``'outer.sync_every'``; ``sep`` sets the
  separator, e.g. ``'__'`` for keyword arguments).
  """
  out = copy.deepcopy(config)
  for key, value in overrides.items():
    *parents, leaf = key.split(sep)
    node = out
    for parent in parents:
      node = node[parent]
    node[leaf] = value
  return out


def section(config: ml_collections.ConfigDict, name: str
            ) -> ml_collections.ConfigDict:
  """``config.outer.<name>``, or an empty section when the config has none."""
  return config.outer.get(name) or ml_collections.ConfigDict()


def required(config: ml_collections.ConfigDict, name: str, field: str
             ) -> Any:
  """``config.outer.<name>.<field>``, a field only the config defines; a
  ``ValueError`` naming it when the config lacks it."""
  s = section(config, name)
  if field not in s:
    raise ValueError(f'outer.{name}.{field} is missing from the config')
  return s[field]


def checked(field: str, fn: Callable[..., Any], *args, **kwargs) -> Any:
  """Calls ``fn``; a ``ValueError`` / ``TypeError`` is re-raised as a
  ``ValueError`` that starts with the config ``field`` it came from."""
  try:
    return fn(*args, **kwargs)
  except (TypeError, ValueError) as e:
    raise ValueError(f'{field}: {e}') from e


def sync_every(config: ml_collections.ConfigDict) -> int:
  """``outer.sync_every`` (H), validated.

  It is the period of the ``'constant'`` sync schedule, the default base
  period of ``'qsr'``, and the period of every fixed-plan method.
  """
  return _checks.positive_int(config.outer.sync_every, 'outer.sync_every',
                              arrays=True)


def learning_rate(value: Any, field: str) -> float:
  """A learning rate (or a factor of one) of the config: a finite number
  ``>= 0`` (0 freezes what it drives: an ablation, not an error)."""
  return _checks.nonnegative_float(value, field)


def momentum(value: Any, field: str) -> float:
  """A momentum (decay) coefficient of the config, in ``[0, 1)``."""
  return _checks.in_interval(value, field, 0.0, 1.0, closed='left')


def check_rates(config: ml_collections.ConfigDict) -> None:
  """Validates the shared rates: ``optimizer.learning_rate``, the schedule's
  ``init_value`` / ``end_value`` (learning rates too), ``outer.learning_rate``
  and ``outer.momentum`` (``None`` = no momentum)."""
  learning_rate(config.optimizer.learning_rate, 'optimizer.learning_rate')
  kwargs = dict(plain(config.optimizer.get('schedule_kwargs') or {}))
  for key in ('init_value', 'end_value'):
    if key in kwargs:
      learning_rate(kwargs[key], f'optimizer.schedule_kwargs.{key}')
  outer = config.outer
  if 'learning_rate' in outer:
    learning_rate(outer.learning_rate, 'outer.learning_rate')
  if outer.get('momentum') is not None:
    momentum(outer.momentum, 'outer.momentum')


# Schedule arguments that are a step count (an int) or a fraction of the
# run (a float), and the largest fraction each takes: a warmup of the whole
# run (1.0) is refused, as 1.0 more likely meant one step (ml_collections
# turns --config...warmup_steps=1 into 1.0 when the config holds a float).
_STEP_FIELDS = {'warmup_steps': (1.0, 'left'), 'decay_steps': (1.0, 'both'),
                'first_period': (1.0, 'both'), 'decay_points': (1.0, 'both')}


def _check_step_field(value: Any, field: str, high: float,
                      closed: str) -> None:
  if not isinstance(value, float):
    return  # ints (step counts) are checked where they are read
  try:
    _checks.in_interval(value, field, 0.0, high, closed=closed)
  except ValueError as e:
    raise ValueError(
        f'{e}: a float is a fraction of num_steps; give a step count as an '
        f'int (ml_collections casts an int given on the command line to '
        f'float where the config holds a float: set the whole dict, e.g. '
        f'--config.optimizer.schedule_kwargs="{{...}}")') from None


def check_step_fields(config: ml_collections.ConfigDict) -> None:
  """Validates the schedule arguments that are steps or fractions
  (``warmup_steps``, ``decay_steps``, ``first_period``, ``decay_points``) in
  ``optimizer.schedule_kwargs`` and ``outer.sync_schedule_kwargs``: a float
  is a fraction of the run, in ``[0, 1)`` for ``warmup_steps`` and
  ``[0, 1]`` for the others; a float step count (``30.0``) is an error."""
  for section in ('optimizer.schedule_kwargs', 'outer.sync_schedule_kwargs'):
    parent, name = section.split('.')
    kwargs = dict(plain(config[parent].get(name) or {}))
    for key, (high, closed) in _STEP_FIELDS.items():
      values = kwargs.get(key)
      if key == 'decay_points':
        for value in values or ():
          _check_step_field(value, f'{section}.{key}[]', high, closed)
      elif values is not None:
        _check_step_field(values, f'{section}.{key}', high, closed)


def lr_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """The inner learning-rate schedule (``optimizer.schedule``)."""
  opt = config.optimizer
  return schedules.make_schedule(
      opt.schedule, opt.learning_rate, config.num_steps,
      **dict(opt.get('schedule_kwargs', {})))


# MT-DAO on the shared default optimizer 'adamw' runs multi_timescale_adam
# with these of optimizer.kwargs (b1 has no counterpart: the slow momenta).
_MT_FROM_ADAMW = ('b2', 'eps', 'eps_root', 'weight_decay', 'mask', 'mu_dtype')


def mt_dao_optimizer(config: ml_collections.ConfigDict
                     ) -> tuple[str, dict[str, Any]]:
  """``(name, kwargs)`` of the inner optimizer under ``outer.method=
  'mt_dao'``: ``optimizer.name='multi_timescale_adam'`` as configured; for
  ``'adamw'`` (the default config's), ``multi_timescale_adam`` with its
  slow-momentum defaults and adamw's ``b2``, ``eps`` and ``weight_decay``."""
  opt = config.optimizer
  kwargs = dict(opt.get('kwargs', {}))
  if opt.name == 'multi_timescale_adam':
    return opt.name, kwargs
  if opt.name != 'adamw':
    raise ValueError(f"outer.method='mt_dao' needs optimizer.name="
                     f"'multi_timescale_adam' (or 'adamw', which it "
                     f"replaces), got {opt.name!r}")
  return 'multi_timescale_adam', {k: v for k, v in kwargs.items()
                                  if k in _MT_FROM_ADAMW}


# Streaming DiLoCo's num_fragments = 0: the first of these dividing H.
STREAMING_AUTO_FRAGMENTS = (3, 2, 1)


def streaming_fragments(num_fragments: int, sync_every: int) -> int:
  """``outer.streaming_diloco.num_fragments``, with 0 resolved to the
  first of :data:`STREAMING_AUTO_FRAGMENTS` that divides ``sync_every``."""
  if num_fragments == 0:
    return next(p for p in STREAMING_AUTO_FRAGMENTS if sync_every % p == 0)
  return num_fragments


def make_inner(config: ml_collections.ConfigDict,
               schedule: optax.Schedule | None = None
               ) -> optax.GradientTransformation:
  """The inner optimizer: spike injection (if on), clip, optimizer (under
  MT-DAO: :func:`mt_dao_optimizer`)."""
  opt = config.optimizer
  schedule = lr_schedule(config) if schedule is None else schedule
  name, kwargs = opt.name, dict(opt.get('kwargs', {}))
  if (config.get('outer') or {}).get('method') == 'mt_dao':
    name, kwargs = mt_dao_optimizer(config)
  tx = inner_lib.make_optimizer(
      name, schedule, grad_clip_norm=opt.get('grad_clip_norm'), **kwargs)
  spike, _ = spikes_lib.spikes_from_config(opt, config.num_steps)
  return tx if spike is None else optax.chain(spike, tx)


def outer_step(config: ml_collections.ConfigDict,
               section: str | None = None) -> tuple[float, float]:
  """``(learning_rate, momentum)`` of the outer step: ``outer.*``, replaced
  by the method's own ``outer.<section>.learning_rate`` / ``momentum`` where
  those are set (not None), e.g. Eager updates' lower outer momentum."""
  cfg = config.outer
  own = (cfg.get(section) if section else None) or {}
  lr, momentum = own.get('learning_rate'), own.get('momentum')
  return (cfg.learning_rate if lr is None else lr,
          cfg.momentum if momentum is None else momentum)


def outer_optimizer(config: ml_collections.ConfigDict,
                    section: str | None = None
                    ) -> optax.GradientTransformation:
  """The outer step of :func:`outer_step` (``section`` as there) as an
  optimizer: Nesterov SGD (DiLoCo's outer step, ``outer.nesterov``) or
  heavy-ball SGD."""
  cfg = config.outer
  lr, momentum = outer_step(config, section)
  if not cfg.nesterov:
    return optax.sgd(lr, momentum=momentum or None)
  return outer_lib.nesterov_outer(lr, momentum)


# Where the outer state (anchor, outer optimizer state) lives between
# steps: ``outer.state_layout`` (docs/sharding.md).
STATE_LAYOUTS = ('replicated', 'sharded', 'offloaded')


def simulates_workers(config: ml_collections.ConfigDict) -> bool:
  """Whether ``config`` stacks its ``mesh.workers`` workers on shared
  devices (``mesh.simulate_workers``) instead of giving each its own."""
  value = config.mesh.get('simulate_workers', False)
  if not isinstance(value, bool):
    raise ValueError(f'mesh.simulate_workers must be True or False, got '
                     f'{value!r}')
  return value


def state_layout(config: ml_collections.ConfigDict) -> str:
  """``outer.state_layout``, validated: ``'replicated'`` (every worker holds
  the whole outer state; the default, and the value of a config without the
  field), ``'sharded'`` (each worker holds its 1/M, ZeRO stage 1) or
  ``'offloaded'`` (replicated, in pinned host memory between syncs)."""
  return _checks.one_of(config.outer.get('state_layout', 'replicated'),
                        'outer.state_layout', STATE_LAYOUTS)


def library_state_layout(config: ml_collections.ConfigDict) -> str:
  """The ``outer_state_layout`` argument of ``loc_opt.diloco`` for the
  config: ``'sharded'`` or ``'replicated'`` (offloading is the trainer's
  placement, not the transform's)."""
  return 'sharded' if state_layout(config) == 'sharded' else 'replicated'


# outer.<field> -> the argument of loc_opt.diloco (and local_sgd,
# streaming_diloco) it sets.
AGGREGATE_FIELDS = {'aggregate': 'aggregate', 'aggregate_trim': 'trim',
                    'aggregate_clip': 'clip_multiple'}


def aggregate_kwargs(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The robust-aggregation arguments (``aggregate``, ``trim``,
  ``clip_multiple``) that ``outer.aggregate``, ``outer.aggregate_trim`` and
  ``outer.aggregate_clip`` set, validated; absent fields take the library's
  defaults."""
  cfg = config.outer
  kwargs = {arg: plain(cfg[f]) for f, arg in AGGREGATE_FIELDS.items()
            if f in cfg}
  if 'aggregate' in kwargs:
    _checks.one_of(kwargs['aggregate'], 'outer.aggregate',
                   outer_lib.AGGREGATES)
  if 'trim' in kwargs:
    _checks.nonnegative_int(kwargs['trim'], 'outer.aggregate_trim')
  if 'clip_multiple' in kwargs:
    _checks.positive_float(kwargs['clip_multiple'], 'outer.aggregate_clip')
  return kwargs


# The methods whose average takes outer.aggregate (a robust rule).
ROBUST_METHODS = ('diloco', 'local_sgd', 'streaming_diloco')


def gather_codec(config) -> tuple[str, dict[str, Any]] | None:
  """``(outer.codec, outer.codec_kwargs)`` for a gathering rule (median,
  trimmed mean), or None for ``'none'`` (fp32)."""
  name = config.outer.get('codec', 'none')
  if name == 'none':
    return None
  return name, dict(plain(config.outer.get('codec_kwargs', {})) or {})


def check_aggregate(config) -> None:
  """Validates ``outer.aggregate`` and its parameters against the method,
  the codec and the worker count."""
  kwargs = aggregate_kwargs(config)
  rule = kwargs.get('aggregate', 'mean')
  method = config.outer.method
  if rule != 'mean' and method not in ROBUST_METHODS:
    raise ValueError(f'outer.aggregate={rule!r}: outer.method={method!r} '
                     f'averages with a mean only (robust rules: '
                     f'{", ".join(ROBUST_METHODS)})')
  codec = gather_codec(config) if rule in outer_lib.robust.GATHERED else None
  if codec is not None and config.outer.get('error_feedback',
                                            'none') != 'none':
    raise ValueError(
        f'outer.error_feedback={config.outer.error_feedback!r}: '
        f'outer.aggregate={rule!r} gathers every worker\'s codec payload '
        'and decodes it, without error feedback; set it to \'none\'')
  checked('outer.codec', outer_lib.robust.check, rule, codec=codec)
  trim = kwargs.get('trim', 1)
  if rule == 'trimmed_mean' and 2 * trim >= config.mesh.workers:
    raise ValueError(f'outer.aggregate_trim={trim} drops every one of the '
                     f'{config.mesh.workers} workers (mesh.workers); use '
                     'aggregate_trim < mesh.workers / 2')


def compressor_kwargs(config: ml_collections.ConfigDict
                      ) -> dict[str, Any]:
  """The arguments of ``compression.build_compressor`` that the ``outer``
  section sets (``error_feedback``, ``econtrol_eta``, ``ef_decay``); absent
  fields take its defaults."""
  cfg = config.outer
  kwargs = {f: cfg[f] for f in ('error_feedback', 'econtrol_eta', 'ef_decay')
            if f in cfg}
  if 'error_feedback' in kwargs:
    _checks.one_of(kwargs['error_feedback'], 'outer.error_feedback',
                   compression.FEEDBACK)
  return kwargs


# Argument annotations whose values a config can be checked against (int
# fits a float argument; a bool fits only a bool one).
_SIMPLE_TYPES = {int: (int,), float: (int, float), bool: (bool,),
                 str: (str,), type(None): (type(None),)}


def _fits(value: Any, hint: Any) -> bool:
  """Whether ``value`` fits annotation ``hint`` (True where it cannot tell:
  annotations other than ints, floats, bools, strings and their unions with
  None)."""
  union = typing.get_origin(hint) in (typing.Union, types.UnionType)
  options = typing.get_args(hint) if union else (hint,)
  if any(option not in _SIMPLE_TYPES for option in options):
    return True
  return any(
      isinstance(value, _SIMPLE_TYPES[option])
      and (option is bool or not isinstance(value, bool))
      for option in options)


def _check_codec_kwargs(name: str, kwargs: Mapping[str, Any]) -> None:
  """Checks the types of ``outer.codec_kwargs`` against the signature of
  the factory ``outer.codec`` names (unknown names are left to the call)."""
  factory = {**compression.CODECS, **compression.COMPRESSORS}[name]
  try:
    hints = typing.get_type_hints(factory)
  except (NameError, TypeError):
    return
  for key, value in kwargs.items():
    hint = hints.get(key)
    if hint is not None and not _fits(value, hint):
      shown = hint.__name__ if isinstance(hint, type) else hint
      raise ValueError(
          f"outer.codec_kwargs['{key}']={value!r} does not fit codec "
          f'{name!r}: it takes {key}: {shown}')


def make_compressor(config: ml_collections.ConfigDict
                    ) -> compression.Compressor:
  """The compressor the ``outer`` section names.

  Fields: ``codec`` (a name of ``loc_opt.compression.make_compressor``),
  ``codec_kwargs`` (its arguments), ``error_feedback`` (``'none'``, ``'ef'``,
  ``'ef21'``, ``'econtrol'``), ``econtrol_eta``, ``ef_decay``, and the
  leaves sent in fp32 without an error buffer: ``compress_min_size``
  (smaller ones) and ``compress_skip`` (paths containing one of these
  names).
  """
  cfg = config.outer
  codec_kwargs = plain(cfg.get('codec_kwargs') or {})
  if not isinstance(codec_kwargs, Mapping):
    raise ValueError(f'outer.codec_kwargs must be a dict of the codec\'s '
                     f'arguments, got {codec_kwargs!r}')
  if cfg.codec not in {**compression.CODECS, **compression.COMPRESSORS}:
    compression.make_compressor(cfg.codec, field='outer.codec')  # raises
  _check_codec_kwargs(cfg.codec, codec_kwargs)
  try:
    scheme = compression.make_compressor(
        cfg.codec, field='outer.codec', **dict(codec_kwargs))
  except (TypeError, ValueError) as e:
    raise ValueError(f'outer.codec_kwargs do not fit codec {cfg.codec!r}: '
                     f'{e}') from e
  kwargs = compressor_kwargs(config)
  min_size = _checks.nonnegative_int(cfg.compress_min_size,
                                     'outer.compress_min_size')
  skip = cfg.get('compress_skip') or ()
  if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
    raise ValueError('outer.compress_skip must be a tuple of names, got '
                     f'{skip!r}')
  eligible = compression.all_of(
      compression.min_size(min_size) if min_size else None,
      compression.skip_paths(*skip) if skip else None)
  return compression.build_compressor(scheme, eligible=eligible, **kwargs)


def _lr_warmup_steps(config: ml_collections.ConfigDict) -> int:
  """The inner learning-rate warmup of a config, in steps (0 if none)."""
  warmup = dict(config.optimizer.get('schedule_kwargs', {})).get(
      'warmup_steps', 0)
  return schedules.steps_from_fraction(
      warmup, config.num_steps, field='optimizer.schedule_kwargs.warmup_steps')


def _constant_defaults(config, schedule):
  del schedule
  return {'period': sync_every(config)}


def _qsr_defaults(config, schedule):
  # H_base = outer.sync_every; the rate is the inner optimizer's schedule;
  # H_base during the rate's warmup; rounds laid out over the run as in the
  # reference code (H frozen per round, capped at the steps left).
  return {'base_period': sync_every(config),
          'lr_schedule': schedule,
          'warmup_steps': _lr_warmup_steps(config),
          'total_steps': config.num_steps}


def _qsr_fix(kwargs, config):
  if 'warmup_steps' in kwargs:
    kwargs['warmup_steps'] = schedules.steps_from_fraction(
        kwargs['warmup_steps'], config.num_steps,
        field='outer.sync_schedule_kwargs.warmup_steps')
  return kwargs


# Per sync-schedule name (loc_opt.schedules.SYNC_SCHEDULES): the arguments
# the trainer supplies from the rest of the config, and a fix-up of the
# user's outer.sync_schedule_kwargs. Names without an entry get the user's
# kwargs as they are.
_SYNC_DEFAULTS: Mapping[str, Callable[..., dict[str, Any]]] = {
    'constant': _constant_defaults,
    'qsr': _qsr_defaults,
}
_SYNC_FIXES: Mapping[str, Callable[..., dict[str, Any]]] = {
    'qsr': _qsr_fix,
}


def make_sync_every(
    config: ml_collections.ConfigDict,
    schedule: optax.Schedule | None = None,
) -> outer_lib.plan.SyncEvery:
  """The sync-period schedule ``count -> H`` a config asks for.

  Fields: ``outer.sync_schedule`` (a name of
  ``loc_opt.schedules.SYNC_SCHEDULES``; default ``'constant'``) and
  ``outer.sync_schedule_kwargs`` (its arguments). The trainer supplies:

  * ``'constant'``: ``period = outer.sync_every``.
  * ``'qsr'``: ``base_period = outer.sync_every``, ``lr_schedule`` = the
    inner optimizer's learning-rate schedule, ``warmup_steps`` = its warmup
    (``optimizer.schedule_kwargs.warmup_steps``), ``total_steps =
    num_steps`` (the reference's per-round layout; pass ``total_steps:
    None`` to read the rule at every count). ``alpha`` must be given;
    ``max_period`` is optional.
  * ``'step'``: ``boundaries_and_periods`` must be given.

  Args:
    config: the whole experiment config.
    schedule: the inner learning-rate schedule (default: the config's).

  Returns:
    A jittable ``count -> H`` (int32).

  Raises:
    ValueError: naming ``outer.sync_schedule`` or
      ``outer.sync_schedule_kwargs``.
  """
  outer = config.outer
  name = outer.get('sync_schedule', 'constant')
  if name not in schedules.SYNC_SCHEDULES:
    raise ValueError(f'unknown outer.sync_schedule {name!r}; choose one of '
                     f'{sorted(schedules.SYNC_SCHEDULES)}')
  user = dict(plain(outer.get('sync_schedule_kwargs', {}) or {}))
  if 'lr_schedule' in user:
    raise ValueError('outer.sync_schedule_kwargs must not set lr_schedule: '
                     'the trainer passes the inner learning-rate schedule')
  schedule = lr_schedule(config) if schedule is None else schedule
  kwargs = dict(_SYNC_DEFAULTS.get(name, lambda c, s: {})(config, schedule))
  kwargs.update(user)
  kwargs = _SYNC_FIXES.get(name, lambda k, c: k)(kwargs, config)
  try:
    return schedules.SYNC_SCHEDULES[name](**kwargs)
  except (TypeError, ValueError) as e:
    raise ValueError(f'outer.sync_schedule_kwargs do not fit '
                     f'outer.sync_schedule={name!r}: {e}') from e
