"""Training methods by name: how the optimizer wraps the inner optimizer.

A method says whether each worker keeps its own state (a leading worker axis
on every array), how to build the transform from the config, which weights
to evaluate, and whether it has a sync step. Local-update methods read their
sync period from a sync-period schedule (``outer.sync_schedule``, see
:func:`make_sync_every`); :class:`SyncPlan` decides on the host which of the
two compiled programs (inner step or sync step) runs next, so a changing
period never recompiles anything.

Evaluation weights: a method may fix them (DiLoCo and local SGD evaluate the
anchor); otherwise they are the inner optimizer's (the schedule-free average
``x`` for a schedule-free optimizer, the parameters for any other), see
:func:`eval_params_fn`.
"""

from collections.abc import Callable, Mapping
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from loc_opt import compression
from loc_opt import outer as outer_lib
from loc_opt import schedules

# A sync period: an int, or a schedule ``count -> H`` (int32).
SyncEvery = int | Callable[[jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Method:
  """A training method the trainer can run.

  Attributes:
    per_worker: whether parameters and optimizer state carry a leading worker
      axis (local-update methods) or are one replicated copy (data parallel).
    build: ``(config, inner_tx, axis_name, sync_every) ->
      GradientTransformation`` from the whole experiment config;
      ``sync_every`` is the resolved sync-period schedule of methods with
      ``has_sync`` (None for the others).
    eval_params: ``(opt_state, params) -> params`` to evaluate; None means
      the inner optimizer's evaluation weights (:func:`eval_params_fn`).
    has_sync: whether the method has a sync step, compiled as a second
      program and chosen on the host by a :class:`SyncPlan`.
    counters: ``opt_state -> (num_syncs, steps_since_sync)`` of one worker's
      state (for methods with a sync step), so a resumed or branched run
      continues its sync bookkeeping from the restored state.
    plan: ``config -> loc_opt.outer.Plan`` for methods whose steps send
      different things (fragments, peer groups, optimizer states): the
      trainer compiles one program per phase and picks it on the host.
      Such methods use a constant period (``outer.sync_schedule`` must be
      ``'constant'``).
    overlap_steps: ``outer_config -> int``, the inner steps a collective may
      overlap before its result is needed (the wall-clock model).
    waits_for_stragglers: whether every worker waits for the slowest one
      (synchronous methods; the wall-clock model).
  """

  per_worker: bool
  build: Callable[..., optax.GradientTransformation]
  eval_params: Callable[[Any, Any], Any] | None = None
  has_sync: bool = False
  counters: Callable[[Any], tuple[Any, Any]] | None = None
  plan: Callable[[ml_collections.ConfigDict], Any] | None = None
  overlap_steps: Callable[[ml_collections.ConfigDict], int] = \
      lambda cfg: 0
  waits_for_stragglers: bool = True


def check_sync_every(cfg: ml_collections.ConfigDict) -> int:
  """Validates and returns `outer.sync_every` of a config.

  It is the period of the ``'constant'`` sync schedule and the default base
  period of ``'qsr'``.
  """
  h = cfg.sync_every
  if isinstance(h, bool) or not isinstance(h, (int, np.integer)) or h <= 0:
    raise ValueError(f'outer.sync_every must be a positive int, got {h!r}')
  return int(h)


def _lr_warmup_steps(config: ml_collections.ConfigDict) -> int:
  """The inner learning-rate warmup of a config, in steps (0 if none)."""
  warmup = dict(config.optimizer.get('schedule_kwargs', {})).get(
      'warmup_steps', 0)
  return schedules.steps_from_fraction(
      warmup, config.num_steps, field='optimizer.schedule_kwargs.warmup_steps')


def _constant_defaults(config, lr_schedule):
  del lr_schedule
  return {'period': check_sync_every(config.outer)}


def _qsr_defaults(config, lr_schedule):
  # H_base = outer.sync_every; the rate is the inner optimizer's schedule;
  # H_base during the rate's warmup; rounds laid out over the run as in the
  # reference code (H frozen per round, capped at the steps left).
  return {'base_period': check_sync_every(config.outer),
          'lr_schedule': lr_schedule,
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
    config: ml_collections.ConfigDict, lr_schedule: optax.Schedule,
) -> SyncEvery:
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
    lr_schedule: the inner learning-rate schedule the trainer built.

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
  user = outer.get('sync_schedule_kwargs', {}) or {}
  # Plain dicts all the way down (a config turns {'0': 4, '100': 8} into a
  # ConfigDict, which is not a Mapping).
  user = dict(user.to_dict() if isinstance(user, ml_collections.ConfigDict)
              else user)
  if 'lr_schedule' in user:
    raise ValueError('outer.sync_schedule_kwargs must not set lr_schedule: '
                     'the trainer passes the inner learning-rate schedule')
  kwargs = dict(_SYNC_DEFAULTS.get(name, lambda c, s: {})(config,
                                                          lr_schedule))
  kwargs.update(user)
  kwargs = _SYNC_FIXES.get(name, lambda k, c: k)(kwargs, config)
  try:
    return schedules.SYNC_SCHEDULES[name](**kwargs)
  except (TypeError, ValueError) as e:
    raise ValueError(f'outer.sync_schedule_kwargs do not fit '
                     f'outer.sync_schedule={name!r}: {e}') from e


class SyncPlan:
  """Host-side: which steps of a run take the sync program.

  The periods ``H(count)`` of the run's counts are read once from the
  schedule (one jitted call over all counts); the step after ``count``
  updates syncs when ``steps_since_sync + 1 >= H(count)``, exactly as
  ``loc_opt.outer.next_step_syncs`` decides (and ``diloco`` does on device),
  without a device call per step.
  """

  def __init__(self, sync_every: SyncEvery, num_steps: int):
    self.sync_every = sync_every
    counts = jnp.arange(num_steps, dtype=jnp.int32)
    periods = jax.jit(lambda c: outer_lib.sync_period(sync_every, c))(counts)
    self.periods = np.broadcast_to(np.asarray(periods), (num_steps,))

  def period(self, count: int) -> int:
    """``H`` in force at ``count``."""
    if count < len(self.periods):
      return int(self.periods[count])
    return int(outer_lib.sync_period(self.sync_every, jnp.int32(count)))

  def syncs(self, count: int, steps_since_sync: int) -> bool:
    """Whether the step after ``count`` updates is a sync step."""
    return steps_since_sync + 1 >= self.period(count)


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


def outer_optimizer(cfg) -> optax.GradientTransformation:
  """``outer.learning_rate`` / ``momentum`` / ``nesterov`` as an optimizer."""
  if not cfg.get('nesterov', True):
    return optax.sgd(cfg.learning_rate, momentum=cfg.momentum or None)
  return outer_lib.nesterov_outer(cfg.learning_rate, cfg.momentum)


def _build_diloco(config, inner, axis_name, sync_every):
  cfg = config.outer
  return outer_lib.diloco(inner, sync_every=sync_every,
                          outer=outer_optimizer(cfg), axis_name=axis_name,
                          codec=make_compressor(cfg))


def _build_local_sgd(config, inner, axis_name, sync_every):
  cfg = config.outer
  return outer_lib.local_sgd(inner, sync_every=sync_every,
                             axis_name=axis_name,
                             codec=make_compressor(cfg))


def _build_compressed_dp(config, inner, axis_name, sync_every):
  del sync_every
  cfg = config.outer
  start = cfg.get('compress_start_step', 0)
  if start < 0:
    raise ValueError(f'outer.compress_start_step must be >= 0, got {start}')
  reduce = compression.compressed_all_reduce(
      make_compressor(cfg), axis_name, start_step=start)
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


# The DiLoCo family's entries use Method and make_compressor above.
from loc_opt.train import family  # noqa: E402

METHODS: Mapping[str, Method] = {
    'data_parallel': Method(
        per_worker=False,
        build=lambda config, inner, axis_name, sync_every: inner),
    'diloco': Method(per_worker=True, build=_build_diloco,
                     eval_params=_diloco_eval, has_sync=True,
                     counters=_diloco_counters),
    'local_sgd': Method(per_worker=True, build=_build_local_sgd,
                        eval_params=_diloco_eval, has_sync=True,
                        counters=_diloco_counters),
    # Data parallel where each worker computes its own gradient and only the
    # compressed payloads (outer.codec) cross workers, every step.
    'compressed_data_parallel': Method(per_worker=True,
                                       build=_build_compressed_dp),
    **family.METHODS,
}


def get_method(name: str) -> Method:
  if name not in METHODS:
    raise ValueError(f'unknown method {name!r} (field outer.method); choose '
                     f'one of {sorted(METHODS)}')
  return METHODS[name]


def _is_schedule_free_state(x) -> bool:
  return isinstance(x, optax.contrib.ScheduleFreeState)


def has_schedule_free_state(opt_state: Any) -> bool:
  """Whether an optimizer state (or its abstract shapes) is schedule-free."""
  return any(_is_schedule_free_state(x) for x in jax.tree.leaves(
      opt_state, is_leaf=_is_schedule_free_state))


def _sf_eval(opt_state, params):
  return schedules.schedule_free_eval_params(opt_state, params)


def _identity_eval(opt_state, params):
  del opt_state
  return params


def eval_params_fn(method: Method,
                   abstract_opt_state: Any) -> Callable[[Any, Any], Any]:
  """``(opt_state, params) -> params`` to evaluate for ``method``.

  The method's own choice if it has one (DiLoCo, local SGD: the anchor);
  otherwise the schedule-free average ``x`` when the optimizer state holds
  a ``ScheduleFreeState``, and the parameters themselves for any other
  optimizer.
  """
  if method.eval_params is not None:
    return method.eval_params
  if has_schedule_free_state(abstract_opt_state):
    return _sf_eval
  return _identity_eval
