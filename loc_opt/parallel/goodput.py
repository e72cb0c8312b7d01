r"""Goodput under chip failures: a discrete-event Monte Carlo, virtual clock.

A cluster of ``N`` chips is split into ``M`` learners of ``N / M`` chips.
Each chip is interrupted on average once per ``mtbi_s`` (default one year),
so interruptions arrive as a Poisson process of rate ``N / mtbi_s`` for the
whole cluster. An interruption lands on a learner drawn uniformly (learners
are equal in size) and takes out one slice of ``slice_size`` chips, which
comes back ``recovery_s`` seconds later. The same failure trace (times and
learners, from the seed) is played against four policies:

* ``'dp'``, data parallel without elasticity: any failure stops the whole
  job. It restarts ``restart_s`` later (reschedule on spare chips, reload the
  last checkpoint) at full size, and loses the progress made since its last
  checkpoint. Checkpoints are written every ``checkpoint_every_s`` seconds of
  running time since the restart (0: every step, nothing lost), so a run of
  ``x`` seconds between restart and failure keeps ``x - (x mod C)`` of them;
  this is simulated, not an expected half-interval.
* ``'elastic_dp'``: a failure pauses the job for ``downscale_s``; it then runs
  on the chips still alive (useful work proportional to live chips, step
  time unchanged: the batch shrinks). When the slice comes back the job
  pauses for ``upscale_s`` and runs on it again.
* ``'diloco'``, synchronous DiLoCo with ``M`` learners: each learner is an
  elastic job as above, driven only by its own failures; every
  ``sync_every`` (``H``) steps of ``step_s`` seconds all learners meet at a
  barrier (plus ``sync_s`` seconds of blocking communication), so a learner
  that was paused makes every other one wait for it. Chips waiting at the
  barrier do no useful work.
* ``'decoupled'``, Decoupled DiLoCo with ``M`` learners: each learner is an
  elastic job and nobody waits for anyone; a paused learner contributes
  nothing while paused. With ``M = 1`` this is ``'elastic_dp'``. This is a
  renewal model, elastic data parallel on ``N / M`` chips by construction:
  every step of a live learner counts, so it is an upper bound of what the
  implementation achieves. :func:`loc_opt.outer.simulate_timeline` measures
  that instead, on the timeline :func:`loc_opt.outer.decoupled_diloco`
  trains on (quorum waits, skipped rounds, work overwritten on learners not
  admitted to a merge, unmerged work lost at a rejoin).

A failure that arrives while a job (or learner) is already paused is folded
into that pause, which is not extended (``overlap='fold'``: the restart or
reconfiguration picks up the chips that are alive when it finishes); with
``overlap='extend'`` each event's pause runs its full length from its own
arrival and pauses are their union. For ``'dp'`` with folding and no
checkpoint loss the goodput is exactly renewal-theory's
:math:`1 / (1 + \lambda R)`, :math:`\lambda = N / \mathrm{MTBI}`.

Measures, over a horizon of ``horizon_s`` seconds of allocated time:

* **goodput** = useful chip-seconds / allocated chip-seconds, allocated being
  ``N * horizon_s`` (spares that a restart draws on are not counted) and
  useful being the chip-seconds of live, running chips whose progress is kept
  (work rolled back to a checkpoint, paused chips, dead chips and chips idle
  at a barrier do not count);
* **uptime** = the fraction of the horizon during which at least one learner
  advances training (runs steps; for ``'dp'`` steps later rolled back count,
  for ``'diloco'`` a learner waiting at the barrier does not).

Every time is an assumption (the paper gives none, per the 2nd-hand sources
that were read); :class:`Assumptions` lists them with their defaults.
Pauses, restarts and checkpoint writes have no other cost; chips run at one
speed; the syncer of Decoupled DiLoCo never fails and its merges never block
a learner; failures of chips already down are not drawn separately (the
cluster rate stays ``N / mtbi_s``; a learner's live chips are clipped at 0).

Reference:
  Douillard et al., *Decoupled DiLoCo for Resilient Distributed
  Pre-training*, arXiv 2604.21428, 2026 (chaos simulation at 150k-2.4M chips
  with a one-year per-chip MTBI; its Table 1 of goodput, known to us only
  second-hand, is reproduced in shape by ``experiments/goodput.py``).

Example::

  from loc_opt.parallel import goodput
  r = goodput.simulate('decoupled', 1_200_000, num_learners=8)
  r.goodput, r.uptime
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from loc_opt import _checks

YEAR_S = 365.25 * 24 * 3600.0
DAY_S = 24 * 3600.0


@dataclasses.dataclass(frozen=True)
class Assumptions:
  """The failure model and the times it costs; every default is ours.

  Attributes:
    mtbi_s: mean time between interruptions of one chip (the paper's
      "aggressive" 1 year).
    slice_size: chips that one interruption takes out (a 4x4x4 cube, 64).
    recovery_s: seconds until a failed slice is back (30 minutes).
    restart_s: non-elastic DP: seconds from a failure to running again,
      rescheduling and reloading the checkpoint included (90 s).
    checkpoint_every_s: non-elastic DP: running seconds between checkpoints
      (0: every step, nothing is lost on a failure).
    downscale_s: elastic jobs: pause after a failure before running on the
      survivors (15 s).
    upscale_s: elastic jobs: pause when a slice comes back (15 s).
    step_s: seconds per training step (1 s).
    sync_every: synchronous DiLoCo: inner steps between barriers, ``H`` (24,
      the paper's main-run ``H``, 2nd-hand).
    sync_s: synchronous DiLoCo: seconds of blocking communication at each
      barrier (0: fully overlapped).
    overlap: ``'fold'`` (an event during a pause joins it) or ``'extend'``
      (each event pauses for its full length; pauses are their union).
  """

  mtbi_s: float = YEAR_S
  slice_size: int = 64
  recovery_s: float = 1800.0
  restart_s: float = 90.0
  checkpoint_every_s: float = 0.0
  downscale_s: float = 15.0
  upscale_s: float = 15.0
  step_s: float = 1.0
  sync_every: int = 24
  sync_s: float = 0.0
  overlap: str = 'fold'

  def __post_init__(self):
    _checks.positive_float(self.mtbi_s, 'mtbi_s')
    _checks.positive_int(self.slice_size, 'slice_size')
    for name in ('recovery_s', 'restart_s', 'checkpoint_every_s',
                 'downscale_s', 'upscale_s', 'sync_s'):
      _checks.nonnegative_float(getattr(self, name), name)
    _checks.positive_float(self.step_s, 'step_s')
    _checks.positive_int(self.sync_every, 'sync_every')
    _checks.one_of(self.overlap, 'overlap', ('fold', 'extend'))


class Result(NamedTuple):
  """What one simulation measured.

  Attributes:
    goodput: useful chip-seconds / allocated chip-seconds.
    uptime: fraction of the horizon with at least one learner advancing.
    useful_chip_s: useful chip-seconds.
    allocated_chip_s: ``num_chips * horizon_s``.
    failures: interruptions drawn over the horizon.
  """

  goodput: float
  uptime: float
  useful_chip_s: float
  allocated_chip_s: float
  failures: int


class _Timeline(NamedTuple):
  """One elastic learner's piecewise-constant state over ``[0, horizon]``.

  ``edges`` (K + 1,) are the segment boundaries; ``run`` (K,) is 1 where the
  learner runs steps; ``ran`` and ``work`` (K + 1,) are the running seconds
  and the useful chip-seconds accumulated up to each edge.
  """

  edges: np.ndarray
  run: np.ndarray
  ran: np.ndarray
  work: np.ndarray


def failure_trace(num_chips: int, num_learners: int,
                  assumptions: Assumptions, horizon_s: float,
                  seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Interruption times (sorted, seconds) and the learner each one hits.

  The count is Poisson with mean ``num_chips * horizon_s / mtbi_s`` and the
  times are uniform over the horizon, so the times depend on the seed and
  the cluster only, not on ``num_learners``.
  """
  rng = np.random.default_rng(seed)
  mean = num_chips * horizon_s / assumptions.mtbi_s
  times = np.sort(rng.uniform(0.0, horizon_s, rng.poisson(mean)))
  learners = rng.integers(0, num_learners, times.size)
  return times, learners


def _pauses(times: np.ndarray, lengths: np.ndarray,
            overlap: str) -> tuple[np.ndarray, np.ndarray]:
  """Disjoint pause intervals ``(starts, ends)`` caused by events at sorted
  ``times`` that each pause for ``lengths`` (see ``overlap``)."""
  keep = lengths > 0
  times, lengths = times[keep], lengths[keep]
  if overlap == 'extend':
    return _union(times, times + lengths)
  starts, ends = [], []
  until = -np.inf
  for t, length in zip(times.tolist(), lengths.tolist()):
    if t >= until:
      until = t + length
      starts.append(t)
      ends.append(until)
  return np.asarray(starts, float), np.asarray(ends, float)


def _union(starts: np.ndarray, ends: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
  """The union of intervals ``[starts, ends)`` as sorted disjoint ones."""
  if starts.size == 0:
    return starts.astype(float), ends.astype(float)
  order = np.argsort(starts, kind='stable')
  starts, ends = starts[order], np.maximum.accumulate(ends[order])
  new = np.ones(starts.size, bool)
  new[1:] = starts[1:] > ends[:-1]
  last = np.r_[np.flatnonzero(new)[1:] - 1, starts.size - 1]
  return starts[new], ends[last]


def _inside(t: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
  """Whether each of ``t`` lies in one of the disjoint sorted intervals."""
  if starts.size == 0:
    return np.zeros(np.shape(t), bool)
  i = np.searchsorted(starts, t, side='right') - 1
  return (i >= 0) & (t < ends[np.maximum(i, 0)])


def _timeline(fails: np.ndarray, chips: int, a: Assumptions,
              horizon: float) -> _Timeline:
  """An elastic learner of ``chips`` chips hit at sorted times ``fails``."""
  backs = fails + a.recovery_s
  times = np.r_[fails, backs]
  order = np.argsort(times, kind='stable')
  lengths = np.r_[np.full(fails.size, a.downscale_s),
                  np.full(backs.size, a.upscale_s)]
  starts, ends = _pauses(times[order], lengths[order], a.overlap)
  deltas = np.r_[np.full(fails.size, -a.slice_size),
                 np.full(backs.size, a.slice_size)][order]
  times = times[order]
  edges = np.unique(np.clip(np.r_[0.0, horizon, times, starts, ends],
                            0.0, horizon))
  mid = 0.5 * (edges[1:] + edges[:-1])
  down = np.r_[0, np.cumsum(deltas)][np.searchsorted(times, mid, 'right')]
  live = np.clip(chips + down, 0, chips)
  run = (~_inside(mid, starts, ends) & (live > 0)).astype(float)
  length = np.diff(edges)
  return _Timeline(edges, run, np.r_[0.0, np.cumsum(run * length)],
                   np.r_[0.0, np.cumsum(run * live * length)])


def _stopped(edges: np.ndarray, run: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
  """The intervals where a timeline does not run."""
  idle = run == 0
  return _union(edges[:-1][idle], edges[1:][idle])


def _all_stopped(stops: list[tuple[np.ndarray, np.ndarray]]) -> float:
  """Seconds during which every learner is inside one of its ``stops``
  (each learner's intervals disjoint)."""
  starts = np.concatenate([s for s, _ in stops])
  ends = np.concatenate([e for _, e in stops])
  times = np.r_[starts, ends]
  order = np.argsort(times, kind='stable')
  count = np.cumsum(np.r_[np.ones(starts.size), -np.ones(ends.size)][order])
  gaps = np.diff(times[order])
  return float(np.sum(gaps[count[:-1] >= len(stops)]))


def _learners(times, learners, num_chips, num_learners, a, horizon):
  chips = num_chips // num_learners
  return [_timeline(times[learners == m], chips, a, horizon)
          for m in range(num_learners)]


def _kept_runs(starts, ends, horizon, checkpoint_every_s):
  """(kept, ran) running seconds of a job stopped over the disjoint sorted
  pauses ``[starts, ends)`` that loses what it ran since its last
  checkpoint at each stop."""
  ends = np.minimum(ends, horizon)
  run_starts = np.r_[0.0, ends]
  run_ends = np.r_[starts, horizon]
  runs = np.maximum(run_ends - run_starts, 0.0)
  kept = runs.copy()
  # the last run ends at the horizon, not a failure
  if checkpoint_every_s > 0:
    kept[:-1] -= np.mod(runs[:-1], checkpoint_every_s)
  return float(np.sum(kept)), float(np.sum(runs))


def _dp(times, learners, num_chips, num_learners, a, horizon):
  """Non-elastic DP: one job, stopped by every failure."""
  del learners, num_learners
  starts, ends = _pauses(times, np.full(times.size, a.restart_s), a.overlap)
  kept, ran = _kept_runs(starts, ends, horizon, a.checkpoint_every_s)
  return num_chips * kept, ran


def restarts_on_trace(stops: np.ndarray, backs: np.ndarray,
                      horizon_s: float, *, restart_s: float,
                      checkpoint_every_s: float) -> tuple[float, float]:
  """A non-elastic job (``'dp'``) on a given trace instead of a drawn one:
  the job stops at each of ``stops`` (seconds), may run again once the
  failed part is back at the matching ``backs`` and runs ``restart_s``
  later (pauses that overlap are their union), losing what it ran since
  its last checkpoint (one every ``checkpoint_every_s`` running seconds
  since a restart; 0: nothing lost).

  Returns:
    ``(kept, ran)``: running seconds whose progress is kept, and all
    running seconds, over ``[0, horizon_s]``.

  Raises:
    ValueError: ``stops`` and ``backs`` differ in size, a back precedes
      its stop, or a time or length is negative.
  """
  stops, backs = np.asarray(stops, float), np.asarray(backs, float)
  if stops.shape != backs.shape or stops.ndim != 1:
    raise ValueError(f'stops and backs must be 1-d of one size, got '
                     f'{stops.shape} and {backs.shape}')
  if np.any(stops < 0) or np.any(backs < stops):
    raise ValueError('each stop must be >= 0 and its back >= it, got '
                     f'{list(zip(stops.tolist(), backs.tolist()))}')
  horizon_s = _checks.positive_float(horizon_s, 'horizon_s')
  restart_s = _checks.nonnegative_float(restart_s, 'restart_s')
  checkpoint_every_s = _checks.nonnegative_float(checkpoint_every_s,
                                                 'checkpoint_every_s')
  starts, ends = _union(stops, backs + restart_s)
  return _kept_runs(starts, ends, horizon_s, checkpoint_every_s)


def _decoupled(times, learners, num_chips, num_learners, a, horizon):
  """Independent elastic learners; M = 1 is elastic DP."""
  lines = _learners(times, learners, num_chips, num_learners, a, horizon)
  useful = float(sum(line.work[-1] for line in lines))
  return useful, horizon - _all_stopped([_stopped(x.edges, x.run)
                                         for x in lines])


def _concat(lines: list[_Timeline], offset: float):
  """Timelines laid end to end (learner ``m`` shifted by ``m * offset``)."""
  shift = [m * offset for m in range(len(lines))]
  return (np.concatenate([x.edges + s for x, s in zip(lines, shift)]),
          np.concatenate([x.ran + s for x, s in zip(lines, shift)]),
          np.concatenate([x.work for x in lines]),
          np.asarray(shift), np.asarray([x.ran[-1] for x in lines]))


def _diloco(times, learners, num_chips, num_learners, a, horizon):
  """Elastic learners that meet at a barrier every ``sync_every`` steps."""
  lines = _learners(times, learners, num_chips, num_learners, a, horizon)
  offset = 2.0 * horizon + 1.0
  edges, ran, work, shift, total = _concat(lines, offset)
  # work is not offset: interpolate it per learner from the shifted edges.
  span = a.sync_every * a.step_s
  t0, useful = 0.0, 0.0
  waits_s, waits_e = [], []
  while t0 < horizon:
    start = t0 + shift
    target = np.interp(start, edges, ran) + span
    k = np.clip(np.searchsorted(ran, target, 'left'), 1, ran.size - 1)
    finish = edges[k - 1] + (target - ran[k - 1]) - shift
    finish = np.where(target > total + shift, horizon,
                      np.minimum(finish, horizon))
    useful += float(np.sum(np.interp(finish + shift, edges, work)
                           - np.interp(start, edges, work)))
    t1 = min(float(finish.max()) + a.sync_s, horizon)
    waits_s.append(finish)
    waits_e.append(np.full(finish.size, t1))
    t0 = t1 if t1 > t0 else horizon
  waits_s, waits_e = np.stack(waits_s), np.stack(waits_e)
  stops = []
  for m, x in enumerate(lines):
    s, e = _stopped(x.edges, x.run)
    w = waits_e[:, m] > waits_s[:, m]
    stops.append(_union(np.r_[s, waits_s[w, m]], np.r_[e, waits_e[w, m]]))
  return useful, horizon - _all_stopped(stops)


# policy -> (times, learners, N, M, assumptions, horizon) -> (useful chip-s,
# advancing seconds).
POLICIES: dict[str, Callable[..., tuple[float, float]]] = {
    'dp': _dp,
    'elastic_dp': _decoupled,
    'diloco': _diloco,
    'decoupled': _decoupled,
}
# Policies that run as one job whatever num_learners says.
_SINGLE_JOB = ('dp', 'elastic_dp')


def simulate(policy: str, num_chips: int, num_learners: int = 1,
             assumptions: Assumptions = Assumptions(), *,
             horizon_s: float = 7 * DAY_S, seed: int = 0) -> Result:
  r"""Goodput and uptime of ``policy`` on ``num_chips`` chips.

  Args:
    policy: one of :data:`POLICIES`: ``'dp'``, ``'elastic_dp'``,
      ``'diloco'`` (synchronous), ``'decoupled'``.
    num_chips: ``N``, chips allocated to the run.
    num_learners: ``M``, learners of ``N / M`` chips each (ignored by the
      single-job ``'dp'`` and ``'elastic_dp'``, which count as ``M = 1``);
      ``N`` must be a multiple of ``M`` and ``N / M >= slice_size``.
    assumptions: the failure model and its times.
    horizon_s: allocated seconds simulated (default 7 days).
    seed: seeds the failure trace; the same seed gives the same trace (and
      result) for every policy on the same ``N`` and ``M``.

  Returns:
    A :class:`Result`.

  Raises:
    ValueError: an argument is out of range; the message names it.
    TypeError: ``assumptions`` is not an :class:`Assumptions`.
  """
  _checks.one_of(policy, 'policy', POLICIES)
  num_chips = _checks.positive_int(num_chips, 'num_chips')
  num_learners = _checks.positive_int(num_learners, 'num_learners')
  horizon_s = _checks.positive_float(horizon_s, 'horizon_s')
  _checks.nonnegative_int(seed, 'seed')
  if not isinstance(assumptions, Assumptions):
    raise TypeError(f'assumptions must be an Assumptions, got '
                     f'{type(assumptions).__name__}')
  if policy in _SINGLE_JOB:
    num_learners = 1
  if num_learners > num_chips:
    raise ValueError(f'num_learners ({num_learners}) must be <= num_chips '
                     f'({num_chips})')
  if num_chips % num_learners:
    raise ValueError(f'num_chips ({num_chips}) must be a multiple of '
                     f'num_learners ({num_learners})')
  if assumptions.slice_size > num_chips // num_learners:
    raise ValueError(f'slice_size ({assumptions.slice_size}) must be <= the '
                     f'chips per learner ({num_chips // num_learners})')
  times, learners = failure_trace(num_chips, num_learners, assumptions,
                                  horizon_s, seed)
  useful, advancing = POLICIES[policy](times, learners, num_chips,
                                       num_learners, assumptions, horizon_s)
  allocated = num_chips * horizon_s
  return Result(goodput=useful / allocated, uptime=advancing / horizon_s,
                useful_chip_s=useful, allocated_chip_s=allocated,
                failures=int(times.size))
