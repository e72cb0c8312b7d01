"""Decoupled DiLoCo's timeline: learners, failures, quorum and grace on a
virtual clock.

An event-driven simulation, on the host and before training, of who does
what at every tick of a run of :func:`loc_opt.outer.decoupled_diloco`. Time
is measured in *ticks*, the inner-step time of the fastest learner; one
tick is one program step of the training loop, in which every learner that
finished an inner step during that tick takes it (the numerics of the step
run on the worker mesh like every other method, with the decisions below as
per-learner masks). The decisions depend on timings only (speeds, failures,
transfer times), never on the numbers, so they can be made in advance; a run
is therefore deterministic given its seed and fault trace, and resumes
bit-exactly (the timeline is rebuilt from the config).

Rules (:func:`decoupled_timeline`):

* **Learners** ``m`` take inner steps of ``1 / speeds[m]`` ticks (times a
  log-normal jitter), never waiting for anyone. A learner finishes at most
  one step per tick; its step counters ``c_steps[m, p]`` grow by one per
  step and restart when it receives fragment ``p`` or rejoins.
* **Failures** (a given trace, or a chaos model: per-learner exponential
  clocks with mean ``mtbf`` ticks, each failure lasting ``downtime`` ticks)
  stop a learner; the step in progress is lost. When it comes back it
  *rejoins* (takes the global fragments; see ``rejoin_state``) on the tick
  holding the end of its failure, unless a failure starting later in that
  tick takes it down again (then it rejoins when that one ends); failures
  that overlap end at the later end.
* **Fragments come due** on Streaming DiLoCo's schedule: fragment ``p``'s
  window opens at the start of tick ``k`` with ``k + 1 = p S + j H``
  (``S = H / P``). A live learner *reports* for it at its first step
  finished in the window with ``c_steps[m, p] > 0`` (the syncer pulls
  fragments a learner pushes after each step).
* **Quorum and grace.** Once ``quorum`` (``K``) learners reported (or
  every live learner, when fewer than ``K`` are alive), at time
  ``q``, the syncer waits a grace window ``g = clip(gamma * slack, 0,
  grace_cap)``, ``slack = tau * xi_step - (q - open) - sync_steps``, where
  ``xi_step`` is the slowest live learner's step time (an EMA of its
  measured steps, so the window adapts) and ``tau`` the overlap in steps.
  The learners that reported by ``q + g`` are *admitted*; the merge runs
  on the tick holding ``q + g`` (one merge per tick; a second waits a
  tick), and every live learner receives the new fragment on the tick
  holding ``q + g + sync_steps`` (a fragment is not merged again before its
  last merge arrived). A round still open when the fragment's next window
  opens is skipped (counted).

References:
  Douillard et al., *Decoupled DiLoCo for Resilient Distributed
  Pre-training*, 2026 (quorum, adaptive grace window: its Eq. 3 as quoted
  second-hand). https://arxiv.org/abs/2604.21428
"""

from collections.abc import Sequence
import dataclasses
import math
from typing import Any
import warnings

import numpy as np

from loc_opt import _checks
from loc_opt.outer import plan as plan_lib


@dataclasses.dataclass(frozen=True)
class Round:
  """One fragment sync round: when it opened, reached quorum and merged.

  Times are in ticks (floats); ``merge_tick`` and ``receive_tick`` are
  tick indices; ``reported`` maps learner -> report time; ``admitted``
  lists the learners merged.
  """

  fragment: int
  opened: float
  quorum_time: float
  deadline: float
  merge_tick: int
  receive_tick: int
  reported: dict[int, float]
  admitted: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Timeline:
  """Every tick's decisions for a run of ``num_steps`` ticks.

  Attributes:
    merge: int32 ``[T]``, the fragment merged on each tick (-1: none).
    source: int32 ``[T]``, the live learner a rejoining learner copies its
      inner state from (-1: none; only with ``peer_rejoin``).
    active: bool ``[T, M]``, learners that take an inner step.
    admitted: bool ``[T, M]``, learners merged on that tick's merge.
    receive: bool ``[T, M, P]``, fragments each learner receives.
    rejoin: bool ``[T, M]``, learners back from a failure.
    alive: bool ``[T, M]``, learners up during the tick.
    rounds: the merged rounds, in merge order.
    skipped: rounds dropped (no quorum before the next window).
    failures: the fault trace ``(learner, start, duration)`` in ticks.
  """

  merge: np.ndarray
  source: np.ndarray
  active: np.ndarray
  admitted: np.ndarray
  receive: np.ndarray
  rejoin: np.ndarray
  alive: np.ndarray
  rounds: tuple[Round, ...]
  skipped: int
  failures: tuple[tuple[int, float, float], ...]

  @property
  def num_steps(self) -> int:
    return int(self.merge.shape[0])

  def phase(self, count: int) -> Any:
    """The static phase of tick ``count``: ``False`` or ``(merge,
    source)`` (see :func:`loc_opt.outer.decoupled_diloco`)."""
    if count >= self.num_steps:
      return False
    m, s = int(self.merge[count]), int(self.source[count])
    if m < 0 and s < 0:
      return False
    return (m if m >= 0 else None, s if s >= 0 else None)

  def plan(self) -> plan_lib.Plan:
    """The host-side :class:`loc_opt.outer.Plan` (a merge counts as a
    sync; a peer copy alone does not)."""
    return plan_lib.Plan(
        self.phase,
        sync_fn=lambda phase: phase is not False and phase[0] is not None)

  def inputs(self, count: int) -> dict[str, np.ndarray]:
    """Tick ``count``'s per-learner decisions, stacked over learners, as
    ``decoupled_diloco``'s ``update`` takes them (``active``, ``admitted``,
    ``receive``, ``rejoin``)."""
    return {'active': self.active[count], 'admitted': self.admitted[count],
            'receive': self.receive[count], 'rejoin': self.rejoin[count]}

  def summary(self) -> dict[str, float]:
    """Fractions of learner-ticks active and alive, rounds merged and
    skipped, mean learners admitted per merge."""
    admitted = [len(r.admitted) for r in self.rounds]
    return {'active_fraction': float(self.active.mean()),
            'alive_fraction': float(self.alive.mean()),
            'merges': len(self.rounds), 'skipped': self.skipped,
            'mean_admitted': float(np.mean(admitted)) if admitted else 0.}


def check_phase(sync: Any, num_fragments: int
                ) -> tuple[int | None, int | None]:
  """``(merge, source)`` of a phase: ``False`` (neither), or a pair: the
  fragment merged on this step (or None) and the learner whose inner
  state a returning learner copies (``rejoin_state='peer'``; or None)."""
  if sync is False:
    return None, None
  ok = (isinstance(sync, tuple) and len(sync) == 2
        and all(v is None or (isinstance(v, int) and not isinstance(v, bool)
                              and v >= 0) for v in sync)
        and (sync[0] is None or sync[0] < num_fragments)
        and sync != (None, None))
  if not ok:
    raise ValueError(
        'sync must be False or (merge, source) with merge a fragment in '
        f'[0, {num_fragments}) or None and source a learner index or None '
        f'(not both None), got {sync!r}')
  return sync


def chaos_failures(num_learners: int, num_steps: int, *, mtbf: float,
                   downtime: float, chips: int = 1, seed: int = 0
                   ) -> tuple[tuple[int, float, float], ...]:
  """A fault trace from per-learner exponential failure clocks.

  A learner of ``chips`` chips, each failing after exponential times of
  mean ``mtbf``, fails at the rate ``chips / mtbf`` (the chaos setting of
  Douillard et al., 2026: a per-chip mean time between interruptions).

  Args:
    num_learners: ``M``.
    num_steps: ticks to cover.
    mtbf: mean ticks between failures of one chip.
    downtime: ticks a failed learner stays down.
    chips: chips per learner.
    seed: seed of the clocks.

  Returns:
    ``(learner, start, duration)`` triples, by start time.
  """
  _checks.positive_float(mtbf, 'mtbf')
  _checks.nonnegative_float(downtime, 'downtime')
  mtbf = mtbf / _checks.positive_int(chips, 'chips')
  rng = np.random.default_rng([seed, 0xC4A05])
  out = []
  for m in range(num_learners):
    t = 0.
    while True:
      t += rng.exponential(mtbf)
      if t >= num_steps:
        break
      out.append((m, float(t), float(downtime)))
      t += downtime
  return tuple(sorted(out, key=lambda f: (f[1], f[0])))


def _check_failures(failures, num_learners: int
                    ) -> tuple[tuple[int, float, float], ...]:
  out = []
  for f in failures:
    if len(f) != 3:
      raise ValueError(f'a failure is (learner, start, duration), got {f!r}')
    m, start, dur = int(f[0]), float(f[1]), float(f[2])
    if not 0 <= m < num_learners:
      raise ValueError(f'failure {tuple(f)} names learner {m}, but there are '
                       f'{num_learners} learners')
    if start < 0 or dur <= 0:
      raise ValueError(f'failure {tuple(f)} needs start >= 0 and duration '
                       '> 0 (ticks)')
    out.append((m, start, dur))
  return tuple(sorted(out, key=lambda f: (f[1], f[0])))


def _check_args(num_learners, sync_every, num_fragments, overlap, quorum,
                grace, grace_cap, sync_steps, speeds, jitter):
  _checks.positive_int(num_learners, 'num_learners')
  _checks.positive_int(sync_every, 'sync_every')
  _checks.positive_int(num_fragments, 'num_fragments')
  if sync_every % num_fragments:
    raise ValueError(f'sync_every={sync_every} must be a multiple of '
                     f'num_fragments={num_fragments}')
  _checks.nonnegative_float(overlap, 'overlap')
  _checks.positive_int(quorum, 'quorum')
  if quorum > num_learners:
    raise ValueError(f'quorum={quorum} is more than the {num_learners} '
                     'learners')
  _checks.in_interval(grace, 'grace', 0, 1)
  _checks.nonnegative_float(grace_cap, 'grace_cap')
  _checks.nonnegative_float(sync_steps, 'sync_steps')
  if sync_steps >= sync_every:
    raise ValueError(f'sync_steps={sync_steps} must be below sync_every='
                     f'{sync_every} (a fragment must arrive before it is due '
                     'again)')
  speeds = (1.,) * num_learners if not speeds else tuple(map(float, speeds))
  if len(speeds) != num_learners or any(not 0 < s <= 1 for s in speeds) \
      or max(speeds) != 1:
    raise ValueError(f'speeds must be {num_learners} values in (0, 1] with '
                     f'the fastest at 1, got {speeds}')
  _checks.nonnegative_float(jitter, 'jitter')
  return speeds


class _Learners:
  """The learners' clocks: step completions, failures, counters."""

  def __init__(self, speeds, jitter, failures, num_fragments, seed, ema):
    self.speeds, self.jitter, self.ema = speeds, jitter, ema
    self.rng = np.random.default_rng([seed, 0x5EED])
    m = len(speeds)
    self.pending = list(failures)  # (learner, start, duration), by start
    self.alive = np.ones(m, bool)
    self.down_until = np.zeros(m)
    self.done = np.array([self.duration(i) for i in range(m)])
    self.step_time = np.array([1. / s for s in speeds])  # EMA, ticks
    self.c_steps = np.zeros((m, num_fragments), np.int64)

  def duration(self, m: int) -> float:
    d = 1. / self.speeds[m]
    if self.jitter:
      d *= math.exp(self.jitter * self.rng.standard_normal())
    return d

  def tick(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Advances through tick ``k`` (time ``(k, k + 1]``): returns
    ``(active, finish time, rejoin)``."""
    m = len(self.speeds)
    active, finish = np.zeros(m, bool), np.full(m, np.inf)
    rejoin = np.zeros(m, bool)
    for i in range(m):
      if not self.alive[i] and self.down_until[i] <= k + 1:
        self.alive[i], rejoin[i] = True, True
        self.c_steps[i] = 0
        self.done[i] = k + 1 + self.duration(i)
    while self.pending and self.pending[0][1] < k + 1:
      i, start, dur = self.pending.pop(0)
      if self.alive[i] and not rejoin[i]:
        self.alive[i] = False
        self.down_until[i] = start + dur
      elif rejoin[i] and start >= self.down_until[i]:
        # back at down_until and down again later in this tick: the learner
        # never runs; it rejoins when this failure ends
        self.alive[i], rejoin[i] = False, False
        self.down_until[i] = start + dur
      else:  # overlapping failures: the later end wins
        self.down_until[i] = max(self.down_until[i], start + dur)
        if rejoin[i] and self.down_until[i] > k + 1:
          self.alive[i], rejoin[i] = False, False
    for i in range(m):
      if self.alive[i] and not rejoin[i] and self.done[i] <= k + 1:
        active[i], finish[i] = True, self.done[i]
        took = self.duration(i)
        self.step_time[i] = (self.ema * self.step_time[i]
                             + (1 - self.ema) * took)
        self.done[i] = max(self.done[i] + took, k + 1 + 1e-9)
        self.c_steps[i] += 1
    return active, finish, rejoin

  def slowest(self) -> float:
    live = self.step_time[self.alive]
    return float(live.max()) if live.size else float(self.step_time.max())


def _report(r: dict[str, Any], p: int, active: np.ndarray,
            finish: np.ndarray, learners: _Learners, *, quorum: int,
            overlap: float, grace: float, grace_cap: float,
            sync_steps: float) -> None:
  """Round ``r`` of fragment ``p`` takes this tick's reports; once it has
  ``quorum`` of them (or one from every live learner, when fewer than
  ``quorum`` are alive), its deadline is set (quorum time plus the grace
  window)."""
  for i in np.flatnonzero(active):
    if i not in r['reported'] and learners.c_steps[i, p] > 0:
      r['reported'][int(i)] = float(finish[i])
  # K learners, or every live learner when fewer are alive (a dead learner
  # is never waited for)
  quorum = max(1, min(quorum, int(learners.alive.sum())))
  if r['deadline'] is None and len(r['reported']) >= quorum:
    q = sorted(r['reported'].values())[quorum - 1]
    slack = overlap * learners.slowest() - (q - r['opened']) - sync_steps
    r['quorum'] = q
    r['deadline'] = q + min(grace_cap, max(0., grace * slack))


def decoupled_timeline(
    num_steps: int,
    *,
    num_learners: int,
    sync_every: int,
    num_fragments: int,
    overlap: float = 2,
    quorum: int = 1,
    grace: float = 0.2,
    grace_cap: float = 1.0,
    sync_steps: float = 1.0,
    speeds: Sequence[float] | None = None,
    jitter: float = 0.0,
    failures: Sequence[Sequence[float]] = (),
    peer_rejoin: bool = False,
    seed: int = 0,
    ema: float = 0.5,
) -> Timeline:
  """Simulates the learners and the syncer on a virtual clock (see the
  module docstring for the rules).

  Args:
    num_steps: ticks (program steps) to simulate.
    num_learners: ``M``.
    sync_every: ``H``: each fragment comes due every ``H`` ticks.
    num_fragments: ``P`` (``H`` a multiple of it).
    overlap: ``tau``, the inner steps a sync may overlap (the slack of the
      grace window); default 2, the description's main setting.
    quorum: ``K``, learners that must report before a merge (1: the
      default described), or every live learner when fewer than ``K`` are
      alive: a dead learner is never waited for, so ``K = M`` means every
      live learner. A fragment whose rounds are all skipped (a live learner
      that never reports in time) draws a ``RuntimeWarning``: its global
      copy would never move.
    grace: ``gamma`` in ``[0, 1]``, the fraction of the slack the syncer
      waits after quorum (0: no grace window; 0.2, the value a
      re-implementation uses, by default).
    grace_cap: the longest grace window, in ticks.
    sync_steps: ticks from a merge to its fragment's arrival at the
      learners (transfer plus merge time), below ``H``.
    speeds: each learner's speed relative to the fastest (in ``(0, 1]``,
      max 1); default all 1.
    jitter: standard deviation of the log of each step's duration.
    failures: the fault trace, ``(learner, start tick, duration ticks)``
      each (e.g. :func:`chaos_failures`).
    peer_rejoin: name a live learner on each rejoin tick (the phase's
      ``source``) for ``rejoin_state='peer'``.
    seed: seed of the jitter.
    ema: smoothing of each learner's measured step time.

  Returns:
    The :class:`Timeline`.
  """
  _checks.positive_int(num_steps, 'num_steps')
  speeds = _check_args(num_learners, sync_every, num_fragments, overlap,
                       quorum, grace, grace_cap, sync_steps, speeds, jitter)
  failures = _check_failures(failures, num_learners)
  m, p_count = num_learners, num_fragments
  stride = sync_every // p_count
  learners = _Learners(speeds, jitter, failures, p_count, seed,
                       _checks.in_interval(ema, 'ema', 0, 1))
  out = {'merge': np.full(num_steps, -1, np.int32),
         'source': np.full(num_steps, -1, np.int32),
         'active': np.zeros((num_steps, m), bool),
         'admitted': np.zeros((num_steps, m), bool),
         'receive': np.zeros((num_steps, m, p_count), bool),
         'rejoin': np.zeros((num_steps, m), bool),
         'alive': np.zeros((num_steps, m), bool)}
  open_rounds: dict[int, dict[str, Any]] = {}
  ready, arrivals, rounds, skipped = [], [], [], 0
  for k in range(num_steps):
    active, finish, rejoin = learners.tick(k)
    out['active'][k], out['rejoin'][k] = active, rejoin
    out['alive'][k] = learners.alive
    if rejoin.any() and peer_rejoin:
      donors = [i for i in range(m) if learners.alive[i] and not rejoin[i]]
      out['source'][k] = donors[0] if donors else -1
    if (k + 1) % stride == 0:
      p = ((k + 1) % sync_every) // stride
      if p in open_rounds:
        skipped += 1
      open_rounds[p] = {'opened': float(k), 'reported': {},
                        'deadline': None, 'quorum': None}
    for p, r in open_rounds.items():
      _report(r, p, active, finish, learners, quorum=quorum,
              overlap=overlap, grace=grace, grace_cap=grace_cap,
              sync_steps=sync_steps)
    for p in [p for p, r in open_rounds.items()
              if r['deadline'] is not None and r['deadline'] <= k + 1]:
      ready.append((p, open_rounds.pop(p)))
    # One merge per tick, first come first served; a fragment whose last
    # merge has not arrived yet waits for it (every live learner then has
    # the syncer's fragment as its base).
    waiting = {q for _, q in arrivals}
    due = [j for j, (q, _) in enumerate(ready) if q not in waiting]
    if due:
      p, r = ready.pop(due[0])
      admitted = tuple(sorted(i for i, t in r['reported'].items()
                              if t <= r['deadline']))
      arrive = max(k, math.ceil(r['deadline'] + sync_steps) - 1)
      out['merge'][k] = p
      out['admitted'][k, list(admitted)] = True
      rounds.append(Round(p, r['opened'], r['quorum'], r['deadline'], k,
                          arrive, dict(r['reported']), admitted))
      arrivals.append((arrive, p))
    for arrive, p in [a for a in arrivals if a[0] == k]:
      out['receive'][k, :, p] = learners.alive
      learners.c_steps[learners.alive, p] = 0
    arrivals = [a for a in arrivals if a[0] > k]
  _warn_if_stalled(rounds, out['alive'], num_steps, sync_every, stride,
                   p_count)
  return Timeline(rounds=tuple(rounds), skipped=skipped, failures=failures,
                  **out)


def _warn_if_stalled(rounds, alive, num_steps, sync_every, stride, p_count):
  """Warns when a fragment's global copy never moves although its windows
  opened (at least twice) and a learner was alive: its rounds were all
  skipped (e.g. a learner too slow to report within ``H``)."""
  if not alive.any():
    return
  merged = {r.fragment for r in rounds}
  # windows of fragment p open at the start of ticks k, k + 1 = p S + j H
  stalled = [p for p in range(p_count) if p not in merged and len(range(
      (p * stride - 1) % sync_every, num_steps, sync_every)) >= 2]
  if stalled:
    warnings.warn(
        f'decoupled_timeline: fragments {stalled} are never merged in '
        f'{num_steps} ticks (every round skipped): their global copies never '
        'move. Lower quorum, or check the learners\' speeds against '
        'sync_every.', RuntimeWarning, stacklevel=3)


@dataclasses.dataclass(frozen=True)
class TimelineGoodput:
  """Where a timeline's learner time went (fractions of ``M x T`` ticks).

  Learners are equal in size, so learner-ticks are chip-time. Every step of
  learner ``m`` costs ``1 / speeds[m]`` ticks and counts ``1 / P`` towards
  each fragment.

  Attributes:
    goodput: ``useful``: work that reached the global model (the steps a
      learner took on a fragment, up to the merge that admitted it).
    discarded: steps overwritten when a merged fragment arrived: a learner
      not admitted to that merge, or steps taken between a merge and its
      arrival.
    lost_rejoin: steps a failed learner had not had merged before it
      rejoined from the global fragments.
    in_flight: steps not yet merged when the timeline ends.
    down: time learners were down.
    idle: time live learners were not stepping (a rejoin tick, a step in
      progress lost to a failure).
    merges: rounds merged.
    skipped: rounds skipped.
    mean_admitted: learners per merge.
    mean_wait: ticks from a round's opening to its deadline (quorum wait
      plus grace), mean over merged rounds.
  """

  goodput: float
  discarded: float
  lost_rejoin: float
  in_flight: float
  down: float
  idle: float
  merges: int
  skipped: int
  mean_admitted: float
  mean_wait: float


def timeline_goodput(timeline: Timeline,
                     speeds: Sequence[float] | None = None
                     ) -> TimelineGoodput:
  """Goodput measured on a timeline, with the numerics of
  :func:`loc_opt.outer.decoupled_diloco` (``alpha = 0``: a received fragment
  overwrites the local copy).

  Per tick, as the transform runs it: a learner's step adds to its pending
  work on every fragment; a merge of fragment ``p`` makes the pending work
  on ``p`` of the admitted learners useful; a received fragment discards
  the work pending on it; a rejoin discards all of it.

  Args:
    timeline: from :func:`decoupled_timeline`.
    speeds: the learners' speeds given to it (default all 1).

  Returns:
    A :class:`TimelineGoodput`.
  """
  t_count, m = timeline.active.shape
  p_count = timeline.receive.shape[2]
  speeds = np.ones(m) if speeds is None else np.asarray(speeds, float)
  if speeds.shape != (m,) or not np.all(speeds > 0):
    raise ValueError(f'speeds must be {m} positive values, got '
                     f'{tuple(speeds)}')
  step = 1. / speeds
  pending = np.zeros((m, p_count))
  useful = discarded = lost = 0.
  merges_at = timeline.merge
  for k in range(t_count):
    act = timeline.active[k]
    if act.any():
      pending[act] += (step[act] / p_count)[:, None]
    p = int(merges_at[k])
    if p >= 0:
      adm = timeline.admitted[k]
      useful += pending[adm, p].sum()
      pending[adm, p] = 0.
    rec = timeline.receive[k]
    if rec.any():
      discarded += pending[rec].sum()
      pending[rec] = 0.
    rej = timeline.rejoin[k]
    if rej.any():
      lost += pending[rej].sum()
      pending[rej] = 0.
  total = float(t_count * m)
  busy = float((timeline.active * step).sum())
  alive = float(timeline.alive.sum())
  waits = [r.deadline - r.opened for r in timeline.rounds]
  admitted = [len(r.admitted) for r in timeline.rounds]
  return TimelineGoodput(
      goodput=float(useful) / total, discarded=float(discarded) / total,
      lost_rejoin=float(lost) / total, in_flight=float(pending.sum()) / total,
      down=1. - alive / total, idle=max(0., alive - busy) / total,
      merges=len(timeline.rounds), skipped=timeline.skipped,
      mean_admitted=float(np.mean(admitted)) if admitted else 0.,
      mean_wait=float(np.mean(waits)) if waits else 0.)
