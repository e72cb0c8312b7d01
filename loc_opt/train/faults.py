"""Non-finite steps: skipped where they happen, counted, and bounded.

A worker whose loss or gradients are NaN / Inf on an inner step (the plan's
inner phase, which talks to no other worker) skips that step: its parameters
and its own optimizer state stay as they were, while the fields of the
method's state that every worker shares (``Method.shared_fields``: counters,
an unchanged anchor) advance as on the other workers. On any other step (a
sync, a fragment's send or apply, compressed data parallel's every step) the
worker cannot skip on its own, so its non-finite gradients are replaced by
zeros for that step's inner update and it takes part with finite values.
Under data parallelism the whole step is skipped. Every bad step is counted
in the train state (``state['faults']``: ``bad_steps``, the total per worker, and
``bad_streak``, the current run of consecutive bad steps) and reported in
the metrics (``faults/bad_steps``).

The run stops with a :class:`NonFiniteError` (checked at every logging
step, :class:`Bound`) when, with ``K = faults.max_bad_steps`` (0: never):

- a worker has had ``K`` bad steps in a row; or
- a worker was bad on more than half of its steps over the last ``2 K``
  steps or more (from the newest logging step at least ``2 K`` steps back).

The second rule holds whatever the sync period: a sync resets a worker that
went bad to the (finite) anchor, so with frequent syncs its runs of bad
steps stay shorter than ``K`` while nearly all its steps are bad (a
learning rate of 1e30 with ``outer.sync_every=10``: 9 bad steps of 10). A
checkpoint is never written with a non-finite leaf anywhere in the state
(``loc_opt.train.checkpoint``).

At a sync, a worker whose pseudo-gradient is not finite is left out of the
average (the methods that support it, ``Method.left_out``: DiLoCo, local
SGD, Streaming DiLoCo; see ``loc_opt.diloco``), and counted
(``faults/left_out``).

The ``faults`` config section also injects faults for tests and research:
NaN gradients at given steps (``nan_grad_steps``) on given workers
(``nan_grad_workers``; empty: every worker), NaN parameters the same way
(``nan_param_steps``, ``nan_param_workers``: a worker whose memory went bad;
it skips its steps until a sync leaves it out and resets it to the anchor),
worker failures for the methods that run on a timeline (Decoupled DiLoCo):
``failures``, ``(worker, start step, steps down)`` triples, and a chaos
model, ``chaos_mtbf_steps`` (mean steps between failures of one chip, 0:
off), ``chaos_chips_per_learner`` and ``chaos_downtime_steps``; and worker
dropout: workers
``drop_workers`` miss the syncs numbered ``drop_syncs`` (0 = the run's first
sync), and at a fraction ``drop_fraction`` of all syncs (drawn from the
seed) one worker, drawn too, misses it. An absent worker contributes
nothing to that sync's mean, which is over the present workers, and
rejoins from the new anchor (:func:`absences`). And slow machines:
``step_sleep_s``, seconds a process sleeps after each training step, one
value for every process or one per process (``jax.process_index()``), so
a process of a ``--local_processes`` run can stand for a slower machine
(:func:`step_sleep`; the syncs make the others wait for it).
"""

from collections.abc import Sequence
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from loc_opt import _checks
from loc_opt.outer import _local
from loc_opt.train import hosts


class NonFiniteError(RuntimeError):
  """Training went non-finite (:class:`Bound`), or a state to save has a
  non-finite leaf."""


def _ints(value: Any, name: str) -> tuple[int, ...]:
  values = tuple(value or ())
  for v in values:
    _checks.nonnegative_int(v, name)
  return values


def settings(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The ``faults`` section, validated: ``nan_grad_steps``,
  ``nan_grad_workers`` (worker indices below ``mesh.workers``) and
  ``max_bad_steps`` (0: never stop). Without a section: no injection, and
  no limit."""
  section = config.get('faults') or ml_collections.ConfigDict()
  steps = _ints(section.get('nan_grad_steps'), 'faults.nan_grad_steps')
  workers = _ints(section.get('nan_grad_workers'), 'faults.nan_grad_workers')
  param_steps = _ints(section.get('nan_param_steps'),
                      'faults.nan_param_steps')
  param_workers = _ints(section.get('nan_param_workers'),
                        'faults.nan_param_workers')
  for field, values in (('nan_grad_workers', workers),
                        ('nan_param_workers', param_workers)):
    for w in values:
      if w >= config.mesh.workers:
        raise ValueError(f'faults.{field} has worker {w}, but there are '
                         f'mesh.workers={config.mesh.workers}')
  limit = _checks.nonnegative_int(section.get('max_bad_steps', 0),
                                  'faults.max_bad_steps')
  drop_syncs = _ints(section.get('drop_syncs'), 'faults.drop_syncs')
  drop_workers = _ints(section.get('drop_workers'), 'faults.drop_workers')
  for w in drop_workers:
    if w >= config.mesh.workers:
      raise ValueError(f'faults.drop_workers has worker {w}, but there are '
                       f'mesh.workers={config.mesh.workers}')
  if bool(drop_syncs) != bool(drop_workers):
    raise ValueError('faults.drop_syncs and faults.drop_workers go together '
                     f'(got drop_syncs={drop_syncs}, drop_workers='
                     f'{drop_workers})')
  fraction = section.get('drop_fraction', 0.0)
  if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
      or not 0 <= fraction < 1:
    raise ValueError(f'faults.drop_fraction must be in [0, 1), got '
                     f'{fraction!r}')
  failures = _failures(section.get('failures'), config.mesh.workers)
  chaos = {name: _checks.nonnegative_float(section.get(name, 0.0),
                                           f'faults.{name}')
           for name in ('chaos_mtbf_steps', 'chaos_downtime_steps')}
  chaos['chaos_chips_per_learner'] = _checks.positive_int(
      section.get('chaos_chips_per_learner', 1),
      'faults.chaos_chips_per_learner')
  if chaos['chaos_mtbf_steps'] and not chaos['chaos_downtime_steps']:
    raise ValueError('faults.chaos_mtbf_steps needs faults.'
                     'chaos_downtime_steps > 0 (how long a learner is down)')
  sleeps = tuple(_checks.nonnegative_float(v, 'faults.step_sleep_s')
                 for v in section.get('step_sleep_s', ()) or ())
  return {'failures': failures, **chaos,
          'nan_grad_steps': steps, 'nan_grad_workers': workers,
          'nan_param_steps': param_steps,
          'nan_param_workers': param_workers, 'max_bad_steps': limit,
          'drop_syncs': drop_syncs,
          'drop_workers': drop_workers, 'drop_fraction': float(fraction),
          'step_sleep_s': sleeps}


def step_sleep(config: ml_collections.ConfigDict, process_index: int,
               process_count: int) -> float:
  """Seconds process ``process_index`` of ``process_count`` sleeps after
  each training step (``faults.step_sleep_s``: empty, one value for every
  process, or one per process).

  Raises:
    ValueError: a value is negative, or there are neither 0, 1 nor
      ``process_count`` of them.
  """
  sleeps = settings(config)['step_sleep_s']
  if len(sleeps) not in (0, 1, process_count):
    raise ValueError(f'faults.step_sleep_s has {len(sleeps)} values for '
                     f'{process_count} processes: give one, or one per '
                     'process')
  if not sleeps:
    return 0.
  return sleeps[process_index] if len(sleeps) > 1 else sleeps[0]


def _failures(value: Any, workers: int
              ) -> tuple[tuple[int, float, float], ...]:
  """``faults.failures``: ``(worker, start step, steps down)`` triples."""
  out = []
  for f in value or ():
    f = tuple(f)
    if len(f) != 3 or not 0 <= int(f[0]) < workers or float(f[1]) < 0 \
        or float(f[2]) <= 0:
      raise ValueError(
          f'faults.failures entry {f!r} must be (worker, start step, steps '
          f'down) with 0 <= worker < mesh.workers={workers}, start >= 0 and '
          'steps down > 0')
    out.append((int(f[0]), float(f[1]), float(f[2])))
  return tuple(out)


def kills_workers(config: ml_collections.ConfigDict) -> bool:
  """Whether the ``faults`` section takes learners down for a while
  (``failures`` or the chaos model; Decoupled DiLoCo's timeline)."""
  s = settings(config)
  return bool(s['failures']) or s['chaos_mtbf_steps'] > 0


def drops_workers(config: ml_collections.ConfigDict) -> bool:
  """Whether the ``faults`` section drops workers from syncs."""
  s = settings(config)
  return bool(s['drop_syncs']) or s['drop_fraction'] > 0


def absences(config: ml_collections.ConfigDict, plan: Any
             ) -> tuple[np.ndarray, np.ndarray]:
  """The ``(step, worker)`` pairs of the run's absences, as two int32
  arrays: for each sync step of ``plan`` over ``config.num_steps`` (sync
  ``s`` = the ``s``-th step where ``plan.is_sync``), the ``drop_workers`` if
  ``s`` is in ``drop_syncs``, and the one worker drawn for it if it is among
  the ``drop_fraction`` of syncs drawn (``numpy`` generator seeded with
  ``config.seed``, so a resumed run draws the same)."""
  s = settings(config)
  sync_steps = [t for t, phase in enumerate(plan.walk(0, config.num_steps))
                if plan.is_sync(phase)]
  pairs = set()
  for index in s['drop_syncs']:
    if index < len(sync_steps):
      pairs.update((sync_steps[index], w) for w in s['drop_workers'])
  if s['drop_fraction'] > 0:
    rng = np.random.default_rng([config.seed, 0xD2097])
    count = math.ceil(s['drop_fraction'] * len(sync_steps))
    chosen = rng.choice(len(sync_steps), size=count, replace=False)
    workers = rng.integers(config.mesh.workers, size=count)
    pairs.update((sync_steps[i], int(w)) for i, w in zip(chosen, workers))
  pairs = sorted(pairs)
  return (np.asarray([p[0] for p in pairs], np.int32),
          np.asarray([p[1] for p in pairs], np.int32))


def present(step: jax.Array, worker: jax.Array,
            absent: tuple[np.ndarray, np.ndarray]) -> jax.Array:
  """Whether ``worker`` takes part in the sync at ``step`` (bool scalar)."""
  steps, workers = absent
  if not steps.size:
    return jnp.bool_(True)
  return jnp.logical_not(jnp.any((jnp.asarray(steps) == step)
                                 & (jnp.asarray(workers) == worker)))


def init(workers: int | None) -> dict[str, jax.Array]:
  """The counters: int32 ``[workers]`` (per worker) or scalars (None)."""
  shape = () if workers is None else (workers,)
  zeros = jnp.zeros(shape, jnp.int32)
  return {'bad_steps': zeros, 'bad_streak': zeros}


# Whether every element of every float leaf of a tree is finite (the check
# the DiLoCo family's mean uses too).
all_finite = _local.all_finite


def inject(grads: Any, step: jax.Array, worker: jax.Array | None,
           steps: Sequence[int], workers: Sequence[int]) -> Any:
  """``grads`` (or parameters) with NaN in their first leaf at the
  configured steps (and workers; ``worker`` None: every worker)."""
  if not steps:
    return grads
  hit = jnp.isin(step, jnp.asarray(steps, jnp.int32))
  if workers and worker is not None:
    hit &= jnp.isin(worker, jnp.asarray(workers, jnp.int32))
  leaves, treedef = jax.tree.flatten(grads)
  leaves[0] = jnp.where(hit, jnp.nan, leaves[0]).astype(leaves[0].dtype)
  return jax.tree.unflatten(treedef, leaves)


_keep = _local.select_leaf  # new where ok else old (PRNG keys too)


def keep_if(ok: jax.Array, new: Any, old: Any, take_new: Any = None) -> Any:
  """The tree ``new`` where ``ok``, else ``old`` (a skipped step).

  Args:
    ok: bool scalar, whether the step was finite.
    new: the tree after the step.
    old: the tree before it.
    take_new: optional tree of Python bools like ``new``: leaves marked
      True are taken from ``new`` whatever ``ok`` (the shared fields of a
      method's state, ``loc_opt.train.method.shared_mask``: on an inner step
      they advance the same way on every worker, so a skipping worker keeps
      its counters level with the others').
  """
  if take_new is None:
    return jax.tree.map(lambda n, o: _keep(ok, n, o), new, old)
  return jax.tree.map(lambda n, o, t: n if t else _keep(ok, n, o), new, old,
                      take_new)


def zero_if_not(ok: jax.Array, grads: Any) -> Any:
  """``grads``, or zeros when ``ok`` is false (NaN * 0 is NaN: select)."""
  return jax.tree.map(lambda g: jnp.where(ok, g, jnp.zeros_like(g)), grads)


def advance(counters: dict[str, jax.Array], ok: jax.Array
            ) -> dict[str, jax.Array]:
  """The counters after a step that was finite (``ok``) or not."""
  bad = jnp.logical_not(ok).astype(jnp.int32)
  return {'bad_steps': counters['bad_steps'] + bad,
          'bad_streak': jnp.where(ok, 0, counters['bad_streak'] + 1)}


def check(state: dict[str, Any], step: int, max_bad_steps: int) -> int:
  """The total of bad steps so far; raises :class:`NonFiniteError` when a
  worker has had ``max_bad_steps`` bad steps in a row (0: no limit)."""
  counters = {k: hosts.fetch(v) for k, v in state['faults'].items()}
  streak = int(np.max(counters['bad_streak']))
  if max_bad_steps and streak >= max_bad_steps:
    raise NonFiniteError(
        f'{streak} consecutive steps with non-finite loss or gradients '
        f'up to step {step} (faults.max_bad_steps={max_bad_steps}); the run '
        'stops, its last checkpoint holds finite parameters')
  return int(np.sum(counters['bad_steps']))


class Bound:
  """The rule that stops a run whose training went non-finite (see the
  module doc): ``K = max_bad_steps`` bad steps in a row on a worker, or
  more than half of a worker's steps bad over the last ``2 K`` steps or
  more. :meth:`check` reads the counters of the train state at a logging
  step; the first window starts at the run's (or resume's) first step.
  """

  def __init__(self, max_bad_steps: int, step: int, state: dict[str, Any]):
    self.limit = max_bad_steps
    self.window = 2 * max_bad_steps
    self._history = [(step, self._totals(state))]

  @staticmethod
  def _totals(state) -> np.ndarray:
    return np.asarray(hosts.fetch(state['faults']['bad_steps']),
                      np.int64).reshape(-1)

  def check(self, state: dict[str, Any], step: int) -> int:
    """The total of bad steps so far, after the run's ``step`` steps;
    raises :class:`NonFiniteError` when the rule is met."""
    total = check(state, step, self.limit)  # the consecutive rule
    if not self.limit:
      return total
    totals = self._totals(state)
    history = self._history
    # The newest entry at least `window` steps back starts the window.
    while len(history) > 1 and history[1][0] <= step - self.window:
      history.pop(0)
    start, before = history[0]
    if step - start >= self.window:
      bad = totals - before
      worst = int(np.argmax(bad))
      if 2 * int(bad[worst]) > step - start:
        raise NonFiniteError(
            f'worker {worst} had non-finite loss or gradients on '
            f'{int(bad[worst])} of the {step - start} steps up to step '
            f'{step} (more than half over at least 2 x faults.max_bad_steps'
            f' = {self.window} steps; {int(np.sum(bad))} bad worker-steps '
            'in all); the run stops, its last checkpoint is finite')
    history.append((step, totals))
    return total


def check_params(params: Any, step: int) -> None:
  """Raises :class:`NonFiniteError` if ``params`` are not all finite (so a
  checkpoint is never written with them)."""
  if not bool(hosts.fetch(jax.jit(all_finite)(params))):
    raise NonFiniteError(f'non-finite parameters at step {step}; not '
                         'saving a checkpoint, the previous one is finite')
