"""What the trainer needs to know about a training method.

A :class:`Method` is a registry entry (``loc_opt.train.registry``): how to
build the transform from the config, the host-side plan of its phases, which
weights to evaluate, and what the wall-clock model needs. The trainer reads
these fields and nothing else, so it has no per-method code.

Evaluation weights: a method may fix them (DiLoCo evaluates the anchor);
otherwise they are the inner optimizer's (the schedule-free average ``x`` for
a schedule-free optimizer, the parameters for any other), see
:func:`eval_params_fn`.
"""

from collections.abc import Callable, Mapping
import dataclasses
import inspect
from typing import Any

import jax
import ml_collections
import optax

from loc_opt import outer as outer_lib
from loc_opt import schedules

Config = ml_collections.ConfigDict


@dataclasses.dataclass(frozen=True)
class Method:
  """A training method the trainer can run.

  Attributes:
    per_worker: whether parameters and optimizer state carry a leading worker
      axis (local-update methods) or are one replicated copy (data parallel).
    build: ``(config, inner_tx, axis_name) -> GradientTransformation`` from
      the whole experiment config.
    plan: ``config -> loc_opt.outer.Plan``, the phase of every step: the
      trainer compiles one program per phase and picks it on the host.
    eval_params: ``(opt_state, params) -> params`` to evaluate; None means
      the inner optimizer's evaluation weights (:func:`eval_params_fn`).
    counters: ``opt_state -> (num_syncs, steps_since_sync)`` of one worker's
      state, for methods that keep them: a resumed or branched run then
      continues its sync bookkeeping from the restored state (a branch may
      come from a run with another sync schedule). Without it the plan is
      replayed from step 0.
    follows_sync_schedule: whether the method's period may follow
      ``outer.sync_schedule`` (the others need ``'constant'``).
    overlap_steps: ``config -> int``, the inner steps a collective may
      overlap before its result is needed (the wall-clock model).
    waits_for_stragglers: whether every worker waits for the slowest one
      (synchronous methods; the wall-clock model).
    local_inner_steps: whether the inner phase talks to no other worker, so
      a worker can skip a non-finite inner step on its own
      (``loc_opt.train.faults``); false for compressed data parallel.
    left_out: ``opt_state -> int`` of one worker's state, the syncs it was
      left out of (absent, or a non-finite pseudo-gradient), for the
      methods whose mean leaves such workers out; only those accept the
      ``faults`` section's worker dropout. None: not supported.
    section: the method's own config section, ``outer.<section>`` (None if
      it has none).
    library_kwargs: ``config -> {library function: keyword arguments}``, the
      arguments the builder passes from the method's section; a test checks
      that the config file's values equal the functions' defaults.
    shared_fields: the fields of the method's optimizer state (the
      NamedTuple its ``init`` returns) that are bit-identical on every worker
      after every step (anchor, outer optimizer state, counters): a skipped
      non-finite step still advances them (``loc_opt.train.faults``), and a
      checkpoint stores them once (``loc_opt.train.layout``).
      ``tests/train/test_layout.py`` checks each method's set.
    step_inputs: ``config -> (step, worker) -> {name: value}``: per-worker
      arguments of every step's ``update``, read on device from tables the
      method computes before the run (Decoupled DiLoCo's timeline: which
      learners take a step, are merged, receive a fragment, rejoin); None:
      none.
    elastic: whether a run may resume from its checkpoint with another
      ``mesh.workers`` (``loc_opt.train.elastic``): the shared fields carry
      over and new workers start from the shared ``anchor``, which must be
      one of them.
    state_layouts: the values of ``outer.state_layout`` the method supports
      (``loc_opt.train.outer_layout``): ``'replicated'`` always;
      ``'sharded'`` where its builder passes the layout to the library
      (``loc_opt.diloco(outer_state_layout='sharded')``); ``'offloaded'``
      where only its sync phases read ``outer_fields``.
    outer_fields: the fields of the method's state that hold the outer state
      (anchor and outer optimizer state), which ``outer.state_layout``
      places: one shard per worker (``'sharded'``) or pinned host memory
      between syncs (``'offloaded'``).
  """

  per_worker: bool
  build: Callable[[Config, optax.GradientTransformation, str],
                  optax.GradientTransformation]
  plan: Callable[[Config], outer_lib.Plan]
  eval_params: Callable[[Any, Any], Any] | None = None
  counters: Callable[[Any], tuple[Any, Any]] | None = None
  follows_sync_schedule: bool = False
  overlap_steps: Callable[[Config], int] = lambda config: 0
  waits_for_stragglers: bool = True
  local_inner_steps: bool = True
  left_out: Callable[[Any], Any] | None = None
  section: str | None = None
  library_kwargs: Callable[[Config], Mapping[Callable[..., Any],
                                             dict[str, Any]]] | None = None
  shared_fields: tuple[str, ...] = ()
  step_inputs: Callable[[Config], Callable[[Any, Any], dict[str, Any]]] \
      | None = None
  elastic: bool = False
  state_layouts: tuple[str, ...] = ('replicated',)
  outer_fields: tuple[str, ...] = ()

  def __post_init__(self):
    if self.shared_fields and not self.per_worker:
      raise ValueError('shared_fields need a per-worker method')
    if self.elastic and 'anchor' not in self.shared_fields:
      raise ValueError("an elastic method needs 'anchor' in shared_fields "
                       '(new workers start from it)')
    if set(self.state_layouts) - {'replicated'} and not self.outer_fields:
      raise ValueError(f'state_layouts {self.state_layouts} need the '
                       'outer_fields they place')


def library_default(fn: Callable[..., Any], arg: str) -> Any:
  """The default of ``fn``'s keyword argument ``arg``."""
  return inspect.signature(fn).parameters[arg].default


def state_fields(method: Method, opt_state: Any) -> tuple[str, ...]:
  """The top-level fields of ``opt_state``, the NamedTuple the method's
  ``init`` returns; checks that ``method.shared_fields`` are among them."""
  fields = getattr(type(opt_state), '_fields', None)
  if fields is None:
    if method.shared_fields:
      raise ValueError(
          f'shared_fields {method.shared_fields} need a NamedTuple optimizer '
          f'state, got {type(opt_state).__name__}')
    return ()
  missing = sorted(set(method.shared_fields) - set(fields))
  if missing:
    raise ValueError(f'shared_fields {missing} are not fields of '
                     f'{type(opt_state).__name__} {fields}')
  return tuple(fields)


def shared_mask(method: Method, opt_state: Any) -> Any:
  """A tree of bools like ``opt_state``: whether each leaf is shared.

  A leaf is shared when the first key of its path, an attribute of the
  method's state NamedTuple, is one of ``method.shared_fields``. Works on
  one worker's state, the stacked per-worker state or abstract shapes.

  Args:
    method: the training method.
    opt_state: its optimizer state (arrays, tracers or shapes).

  Returns:
    ``opt_state``'s structure with a Python bool at every leaf.
  """
  state_fields(method, opt_state)
  shared = set(method.shared_fields)

  def leaf(path, _):
    head = path[0] if path else None
    return (isinstance(head, jax.tree_util.GetAttrKey)
            and head.name in shared)

  return jax.tree_util.tree_map_with_path(leaf, opt_state)


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
