"""A wall-clock model: what a method's measured bytes cost on a given link.

The programs of a run are compiled and their cross-worker collectives read
from the HLO (:func:`loc_opt.parallel.collective_bytes`). This module turns
those collectives into seconds on a link between workers of a given
bandwidth and latency, and plays a run's sequence of steps against a
per-step compute time, so one can see what a method buys on a slow link:
simulated time, exposed communication and compute utilization.

The model, stated so its limits are plain:

* **Collectives.** Each worker sits behind one full-duplex link of
  ``bandwidth`` bits/s; a message costs ``latency`` seconds to start. With
  ``M`` workers and a payload of ``n`` bytes per worker (what the HLO says a
  worker contributes), the standard bandwidth-optimal algorithms cost

  ===================  =====================================  ==========
  collective           bytes through a worker's link          messages
  ===================  =====================================  ==========
  all-reduce (ring)    ``2 (M - 1) / M * n``                  ``2 (M - 1)``
  all-gather (ring)    ``(M - 1) * n`` (everyone's payload)   ``M - 1``
  reduce-scatter       ``(M - 1) / M * n``                    ``M - 1``
  all-to-all           ``(M - 1) / M * n``                    ``M - 1``
  collective-permute   ``n``                                  ``1``
  ===================  =====================================  ==========

  and a step's collectives run one after another.
* **Steps.** Workers compute in lock step (synchronous methods wait for the
  slowest worker: a step takes ``step_time / min(speed)``); a method that
  does not wait for stragglers (asynchronous local SGD) runs at the fastest
  worker's pace. Compute and communication of one step do not overlap
  unless the method allows it: a collective issued at step ``s`` with an
  overlap of ``k`` steps must have finished by the end of step ``s + k``'s
  compute (Streaming DiLoCo: ``k = tau``; Eager updates: ``k = H``). One
  link per worker: collectives queue behind each other.
* **Not modelled:** congestion between concurrent flows, the parameter
  server's own link (asynchronous pushes are charged to the pushing worker),
  and within-worker collectives (fast intra-pod links).

References:
  Douillard et al., *Streaming DiLoCo with overlapping communication:
  Towards a Distributed Free Lunch*, 2025 (compute utilization against
  bandwidth, their Figure 6 simulator). Charles et al., *Communication-
  Efficient Language Model Training Scales Reliably and Robustly: Scaling
  Laws for DiLoCo*, 2025.
"""

from collections.abc import Iterable, Sequence
import dataclasses
import math

from loc_opt import _checks
from loc_opt.parallel import hlo


@dataclasses.dataclass(frozen=True)
class Link:
  """The link between workers.

  Attributes:
    bandwidth_gbps: bandwidth of each worker's link, Gbit/s (10^9 bits/s).
    latency_s: seconds to start one message.
  """

  bandwidth_gbps: float
  latency_s: float = 0.0

  def __post_init__(self):
    _checks.positive_float(self.bandwidth_gbps, 'bandwidth_gbps')
    _checks.nonnegative_float(self.latency_s, 'latency_s')


# kind -> (bytes through the link per payload byte, messages), per M.
_COSTS = {
    'all-reduce': lambda m: (2 * (m - 1) / m, 2 * (m - 1)),
    'all-gather': lambda m: (m - 1, m - 1),
    'reduce-scatter': lambda m: ((m - 1) / m, m - 1),
    'all-to-all': lambda m: ((m - 1) / m, m - 1),
    'ragged-all-to-all': lambda m: ((m - 1) / m, m - 1),
    'collective-permute': lambda m: (1, 1),
    'collective-broadcast': lambda m: (1, m - 1),
}


def collective_seconds(kind: str, payload_bytes: float, num_workers: int,
                       link: Link) -> float:
  """Seconds one cross-worker collective takes on ``link``.

  Args:
    kind: the HLO collective kind (``'all-reduce'``, ``'all-gather'``, ...).
    payload_bytes: the bytes one worker contributes (its operand).
    num_workers: workers taking part.
    link: the link.
  """
  _checks.one_of(kind, 'collective kind', _COSTS)
  if num_workers <= 1 or payload_bytes <= 0:
    return 0.0
  factor, messages = _COSTS[kind](num_workers)
  return (factor * payload_bytes * 8 / (link.bandwidth_gbps * 1e9)
          + messages * link.latency_s)


# One cross-worker collective of a program: (kind, bytes per worker).
Transfer = tuple[str, float]


def cross_worker_transfers(report: hlo.CollectiveReport) -> tuple[Transfer,
                                                                  ...]:
  """The unconditional cross-worker collectives of a compiled program, as
  ``(kind, bytes one worker contributes)``."""
  return tuple(
      (c.kind, c.total_bytes / report.num_workers)
      for c in report.collectives
      if c.cross_worker and c.branch is None)


def transfers_seconds(transfers: Iterable[Transfer], num_workers: int,
                      link: Link) -> float:
  """Seconds a step's collectives take, one after another."""
  return sum(collective_seconds(kind, n, num_workers, link)
             for kind, n in transfers)


@dataclasses.dataclass(frozen=True)
class WallClock:
  """A simulated run.

  Attributes:
    total_s: simulated wall-clock seconds.
    ideal_s: seconds of the same steps with free communication and no
      stragglers (steps x the fastest worker's step time).
    compute_s: seconds of compute on the critical path (steps x step time,
      at the pace of the slowest worker for synchronous methods).
    comm_s: seconds the link was busy.
    exposed_comm_s: seconds compute waited for communication.
  """

  total_s: float
  ideal_s: float
  compute_s: float
  comm_s: float
  exposed_comm_s: float

  @property
  def utilization(self) -> float:
    """Compute utilization: ``ideal_s / total_s``, the fraction of the time
    the fastest worker spends computing."""
    return self.ideal_s / self.total_s if self.total_s else 1.0


class StepClock:
  """The simulated clock of :func:`simulate`, advanced one step at a time.

  ``advance(seconds)`` plays one step whose cross-worker collectives take
  ``seconds`` and returns the clock when that step's compute (and any
  collective it had to wait for) is done; :func:`simulate` is this clock
  over a whole run plus the collectives still in flight at its end. The
  trainer logs it per step (``wallclock/<bandwidth>_seconds``).

  Args:
    step_time_s: compute seconds of one step of the fastest worker.
    overlap_steps: as in :func:`simulate`.
    slowdown: as in :func:`simulate`.
  """

  def __init__(self, *, step_time_s: float, overlap_steps: int = 0,
               slowdown: float = 1.0):
    _checks.nonnegative_float(step_time_s, 'step_time_s')
    _checks.nonnegative_int(overlap_steps, 'overlap_steps')
    _checks.in_interval(slowdown, 'slowdown', 1, math.inf)
    self.step_time_s, self.overlap_steps = step_time_s, overlap_steps
    self.step_s = step_time_s * slowdown
    self.now = self.link_free = self.busy = self.waited = 0.0
    self.steps = 0
    self._due: dict[int, float] = {}  # step -> its awaited collectives' end

  def advance(self, seconds: float) -> float:
    """Plays the next step (its collectives take ``seconds``)."""
    s = self.steps
    self.now += self.step_s
    if seconds > 0:
      start = max(self.now, self.link_free)
      self.link_free = start + seconds
      self.busy += seconds
      end = s + self.overlap_steps
      self._due[end] = max(self._due.get(end, 0.0), self.link_free)
    done = self._due.pop(s, 0.0)
    if done > self.now:
      self.waited += done - self.now
      self.now = done
    self.steps += 1
    return self.now

  def finish(self) -> WallClock:
    """The run so far as a :class:`WallClock`, waiting for the collectives
    still in flight (the clock itself is left as it was)."""
    now, waited = self.now, self.waited
    for done in self._due.values():
      if done > now:
        waited += done - now
        now = done
    return WallClock(total_s=now, ideal_s=self.step_time_s * self.steps,
                     compute_s=self.step_s * self.steps,
                     comm_s=self.busy, exposed_comm_s=waited)


def simulate(comm_seconds: Sequence[float], *, step_time_s: float,
             overlap_steps: int = 0, slowdown: float = 1.0) -> WallClock:
  """Plays a run's steps against one link.

  Args:
    comm_seconds: per step, the seconds its cross-worker collectives take
      (0 for a step with none; see :func:`transfers_seconds`).
    step_time_s: compute seconds of one step of the fastest worker.
    overlap_steps: steps of compute a collective may hide behind: the
      collective of step ``s`` must be done by the end of step
      ``s + overlap_steps``.
    slowdown: compute-time factor of the pace the workers run at (``1 /
      min(speed)`` for a synchronous method with stragglers, 1 otherwise).

  Returns:
    The simulated :class:`WallClock`.
  """
  clock = StepClock(step_time_s=step_time_s, overlap_steps=overlap_steps,
                    slowdown=slowdown)
  for seconds in comm_seconds:
    clock.advance(seconds)
  return clock.finish()
