"""What the virtual-clock models predict for the wall-clock chaos runs of
``experiments/async_chaos.py``, fed the run's own schedule and measured
times.

* Asynchronous learners: :func:`loc_opt.outer.decoupled_timeline` on a
  tick of one fast learner's measured inner-step time, the slow learner
  at its measured speed, the syncer's quorum, grace rule and ``H``, one
  fragment, and each scheduled learner kill as a failure lasting its
  downtime plus that learner's measured restart cost (start-up to its
  first step); :func:`loc_opt.outer.timeline_goodput` with every step
  counted as one fast step (``speeds`` all 1), i.e. tokens merged over
  ``M x T x`` a fast learner's tokens per tick: the measured definition.
  Not modelled: the syncer's own failure (the model's syncer never
  fails), the store's reads and writes beyond ``sync_steps`` (1 tick from
  a merge to its arrival), the staleness bound, and that a real learner
  publishes only whole rounds of ``H`` steps (the model's learner reports
  the steps it has).
* The synchronous job: :func:`loc_opt.parallel.goodput.restarts_on_trace`
  (the non-elastic job of the renewal model) on the job's stops and
  restarts (:func:`experiments._sync_chaos.job_actions`), with its
  measured restart cost and step time and a checkpoint every
  ``checkpoint_every`` steps; goodput = kept steps x tokens per step over
  (window x a fast learner's tokens/s), per worker.
"""

from collections.abc import Sequence

import numpy as np

from experiments._chaos_schedule import NUM_LEARNERS
from experiments._chaos_schedule import SLOW
from loc_opt.outer import decoupled_clock
from loc_opt.parallel import goodput


def learner_failures(events: Sequence[tuple[float, str, str]],
                     restart_s: dict[str, float], tick_s: float,
                     window_s: float) -> list[tuple[int, float, float]]:
  """The schedule's learner kills as the timeline's failures ``(learner,
  start tick, ticks down)``: down from the kill to its restart plus the
  learner's restart cost ``restart_s[name]`` (seconds; for a learner
  without one, the mean of the others, 0 if none); kills after the window
  are dropped.

  Raises:
    ValueError: a killed learner is never restarted, or ``tick_s`` is not
      positive.
  """
  if not tick_s > 0:
    raise ValueError(f'tick_s must be > 0, got {tick_s}')
  events = sorted(events)
  default = float(np.mean(list(restart_s.values()))) if restart_s else 0.
  out = []
  for i, (t, what, proc) in enumerate(events):
    if what != 'kill' or proc == 'syncer' or t >= window_s:
      continue
    back = next((u for u, w, p in events[i + 1:]
                 if p == proc and w == 'start'), None)
    if back is None:
      raise ValueError(f'learner {proc} killed at {t:.1f} s is never '
                       'restarted')
    down = back - t + restart_s.get(proc, default)
    out.append((int(proc[1:]), t / tick_s, down / tick_s))
  return out


def predict_async(events, *, window_s: float, fast_step_s: float,
                  slow_step_s: float, restart_s: dict[str, float],
                  sync_every: int, quorum: int, grace: float,
                  grace_cap_s: float, overlap: float,
                  sync_steps: float = 1.) -> dict[str, float]:
  """The timeline model's goodput and merges per minute for a run of the
  asynchronous learners (see the module doc)."""
  ticks = int(window_s / fast_step_s)
  speeds = [1.] * NUM_LEARNERS
  speeds[SLOW] = min(1., fast_step_s / slow_step_s)
  timeline = decoupled_clock.decoupled_timeline(
      ticks, num_learners=NUM_LEARNERS, sync_every=sync_every,
      num_fragments=1, overlap=overlap, quorum=quorum, grace=grace,
      grace_cap=grace_cap_s / fast_step_s, sync_steps=sync_steps,
      speeds=speeds,
      failures=learner_failures(events, restart_s, fast_step_s, window_s))
  g = decoupled_clock.timeline_goodput(timeline, np.ones(NUM_LEARNERS))
  return {'goodput': g.goodput,
          'merges_per_min': 60. * g.merges / (ticks * fast_step_s),
          'lost_rejoin': g.lost_rejoin, 'discarded': g.discarded}


def predict_sync(actions, *, window_s: float, step_s: float,
                 restart_s: float, checkpoint_every: int,
                 tokens_per_step: float, fast_tokens_per_s: float
                 ) -> dict[str, float]:
  """The renewal model's goodput of the synchronous job for its
  ``(time, 'kill'|'restart', worker)`` actions (a stop without a restart
  lasts past the window)."""
  stops, backs = [], []
  for i, (t, what, _) in enumerate(actions):
    if what != 'kill':
      continue
    stops.append(t)
    backs.append(next((u for u, w, _ in actions[i + 1:] if w == 'restart'),
                      np.inf))
  kept, ran = goodput.restarts_on_trace(
      stops, backs, window_s, restart_s=restart_s,
      checkpoint_every_s=checkpoint_every * step_s)
  rate = tokens_per_step / step_s
  return {'goodput': kept * rate / (window_s * fast_tokens_per_s),
          'running_fraction': ran / window_s}
