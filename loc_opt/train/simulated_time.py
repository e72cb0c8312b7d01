"""Simulated wall-clock time of a run from its compiled collectives.

The ``wallclock`` config section describes the machine a run is imagined
on: the compute time of one step, the bandwidth(s) and latency of the links
between workers, and the workers' relative speeds. The run's own programs
supply what crosses workers on every step (read from their HLO), and
:mod:`loc_opt.parallel.wallclock` turns both into seconds.
"""

from collections.abc import Sequence
from typing import Any

import ml_collections
import numpy as np

from loc_opt import _checks
from loc_opt import parallel


def worker_speeds(config: ml_collections.ConfigDict) -> tuple[float, ...]:
  """``wallclock.worker_speeds``, validated: one speed per worker relative
  to the fastest (steps per step of the fastest, in (0, 1], max 1); all 1
  when empty."""
  speeds = tuple(config.get('wallclock', {}).get('worker_speeds', ()) or ())
  workers = config.mesh.workers
  if not speeds:
    return (1.0,) * workers
  if len(speeds) != workers:
    raise ValueError(f'wallclock.worker_speeds has {len(speeds)} entries for '
                     f'mesh.workers={workers}; give one speed per worker')
  if any(not 0 < float(s) <= 1 for s in speeds) or max(speeds) != 1:
    raise ValueError(f'wallclock.worker_speeds must lie in (0, 1] with the '
                     f'fastest at 1, got {speeds}')
  return tuple(float(s) for s in speeds)


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ``ValueError`` naming a bad ``wallclock`` field."""
  wc = config.get('wallclock')
  if wc is None:
    return
  _checks.positive_float(wc.step_time_s, 'wallclock.step_time_s')
  for gbps in tuple(wc.bandwidths_gbps or ()):
    _checks.positive_float(gbps, 'wallclock.bandwidths_gbps')
  _checks.nonnegative_float(wc.latency_s, 'wallclock.latency_s')
  _checks.nonnegative_int(wc.model_params, 'wallclock.model_params')
  worker_speeds(config)


def run_phases(exp: Any, num_steps: int | None = None) -> list[Any]:
  """The phase of every step of a run of ``exp`` from step 0."""
  num_steps = exp.config.num_steps if num_steps is None else num_steps
  return list(exp.plan.walk(0, num_steps))


def _phase_seconds(exp: Any, link: parallel.Link, model_params: int = 0):
  """``phase -> seconds`` of that phase's cross-worker collectives on
  ``link`` (compiling the phase's program if this run has not yet), cached
  per phase."""
  config = exp.config
  scale = model_params / exp.model.num_params if model_params else 1.0
  steps = exp.programs.steps
  cache = {}

  def seconds(phase):
    if phase not in cache:
      steps[phase]  # compiled if this run has not used it yet
      transfers = [(kind, n * scale) for kind, n in steps.transfers[phase]]
      cache[phase] = parallel.transfers_seconds(
          transfers, config.mesh.workers, link)
    return cache[phase]

  return seconds


def _clock(exp: Any, *, step_time_s: float,
           speeds: Sequence[float] | None = None) -> parallel.StepClock:
  speeds = worker_speeds(exp.config) if speeds is None else tuple(speeds)
  method = exp.method
  slowdown = (1.0 / min(speeds)) if method.waits_for_stragglers else 1.0
  return parallel.StepClock(step_time_s=step_time_s,
                            overlap_steps=method.overlap_steps(exp.config),
                            slowdown=slowdown)


def simulate_run(exp: Any, link: parallel.Link, *,
                 step_time_s: float, model_params: int = 0,
                 speeds: Sequence[float] | None = None
                 ) -> parallel.WallClock:
  """Simulated wall-clock of a whole run of ``exp`` on ``link``.

  Args:
    exp: a built ``Experiment``.
    link: the link between workers.
    step_time_s: compute seconds of one step of the fastest worker.
    model_params: project the bytes to a model of this many parameters
      (bytes scale linearly); 0 keeps the run's own model.
    speeds: workers' relative speeds (default: ``wallclock.worker_speeds``).

  Returns:
    The :class:`loc_opt.parallel.WallClock`.
  """
  seconds = _phase_seconds(exp, link, model_params)
  clock = _clock(exp, step_time_s=step_time_s, speeds=speeds)
  for phase in run_phases(exp):
    clock.advance(seconds(phase))
  return clock.finish()


class RunClocks:
  """The simulated clock of a run per ``wallclock.bandwidths_gbps``,
  advanced step by step as the trainer runs (none without a ``wallclock``
  section). ``scalars()`` are the metrics ``wallclock/<bw>gbps_seconds``:
  the simulated seconds at which the last step played finished."""

  def __init__(self, exp: Any):
    wc = exp.config.get('wallclock')
    self._clocks = {}
    if wc is None:
      return
    for gbps in wc.bandwidths_gbps or ():
      link = parallel.Link(float(gbps), float(wc.latency_s))
      self._clocks[f'{float(gbps):g}gbps'] = (
          _clock(exp, step_time_s=float(wc.step_time_s)),
          _phase_seconds(exp, link, int(wc.model_params)))

  def advance(self, phase: Any) -> None:
    """Plays one step of ``phase`` on every clock."""
    for clock, seconds in self._clocks.values():
      clock.advance(seconds(phase))

  def scalars(self) -> dict[str, float]:
    return {f'wallclock/{k}_seconds': clock.now
            for k, (clock, _) in self._clocks.items()}


def wallclock_summary(exp: Any) -> dict[str, Any]:
  """The ``wallclock`` part of a run summary: per bandwidth, simulated
  seconds, compute utilization and exposed communication seconds (empty
  when the config has no ``wallclock`` section)."""
  wc = exp.config.get('wallclock')
  if wc is None:
    return {}
  out = {'step_time_s': float(wc.step_time_s),
         'latency_s': float(wc.latency_s),
         'model_params': int(wc.model_params),
         'worker_speeds': list(worker_speeds(exp.config))}
  for gbps in wc.bandwidths_gbps or ():
    clock = simulate_run(
        exp, parallel.Link(float(gbps), out['latency_s']),
        step_time_s=out['step_time_s'], model_params=out['model_params'])
    out[f'{float(gbps):g}gbps'] = {
        'seconds': clock.total_s,
        'utilization': float(np.round(clock.utilization, 6)),
        'exposed_comm_seconds': clock.exposed_comm_s,
    }
  return out
