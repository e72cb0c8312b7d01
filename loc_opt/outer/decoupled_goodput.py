"""Decoupled DiLoCo's goodput measured on its own driver's timeline.

:func:`loc_opt.parallel.goodput.simulate` gives the renewal model's figure
(every step of a live learner counts), an upper bound; this runs
:func:`loc_opt.outer.decoupled_timeline` under the same chaos model and
counts only the work that reaches the global model. It lives in ``outer``
because it drives the outer layer's timeline (``parallel`` sits below it).
"""

from loc_opt import _checks
from loc_opt.outer import decoupled_clock
from loc_opt.parallel import goodput


def simulate_timeline(
    num_chips: int, num_learners: int,
    assumptions: goodput.Assumptions = goodput.Assumptions(), *,
    num_steps: int = 20_000, sync_every: int = 24, num_fragments: int = 24,
    quorum: int = 1, grace: float = 0.2, overlap: float = 2,
    sync_steps: float = 1.0, seed: int = 0,
) -> decoupled_clock.TimelineGoodput:
  """Decoupled DiLoCo's goodput measured on its own driver's timeline.

  Where :func:`loc_opt.parallel.goodput.simulate` (``'decoupled'``) counts every step of a live
  learner as useful (a renewal model: ``M`` learners are elastic data
  parallel on ``N / M`` chips), this runs
  :func:`loc_opt.outer.decoupled_timeline`, the schedule that
  :func:`loc_opt.outer.decoupled_diloco` trains on, under the chaos model
  and counts only the work that reaches the global model
  (:func:`loc_opt.outer.timeline_goodput`): steps of learners not admitted
  to a merge, steps taken between a merge and its fragment's arrival (both
  overwritten, ``alpha = 0``), and unmerged steps of a learner that
  rejoins after a failure are lost; quorum waits and skipped rounds delay
  merges. So :func:`~loc_opt.parallel.goodput.simulate`'s figure is an upper bound of this one.

  The mapping: one tick is one step of ``assumptions.step_s``; a learner of
  ``N / M`` chips fails at the rate ``(N / M) / mtbi_s``
  (:func:`loc_opt.outer.chaos_failures`) and is down for ``downscale_s +
  upscale_s`` (the renewal model's two reconfiguration pauses back to
  back; the slice's own absence, 64 of ``N / M`` chips, is not modelled).
  Every learner runs at one speed.

  Args:
    num_chips: ``N``.
    num_learners: ``M`` (``N`` a multiple of it).
    assumptions: ``mtbi_s``, ``step_s``, ``downscale_s`` and ``upscale_s``
      are used.
    num_steps: ticks simulated.
    sync_every, num_fragments, quorum, grace, overlap, sync_steps: the
      timeline's (defaults: the paper's main setting as described
      second-hand, ``H = P = 24``, ``tau = 2``, ``K = 1`` and a grace
      factor of 0.2).
    seed: seeds the failure clocks.

  Returns:
    A :class:`loc_opt.outer.TimelineGoodput`.
  """
  num_chips = _checks.positive_int(num_chips, 'num_chips')
  num_learners = _checks.positive_int(num_learners, 'num_learners')
  if num_chips % num_learners:
    raise ValueError(f'num_chips ({num_chips}) must be a multiple of '
                     f'num_learners ({num_learners})')
  if not isinstance(assumptions, goodput.Assumptions):
    raise TypeError(f'assumptions must be an Assumptions, got '
                    f'{type(assumptions).__name__}')
  downtime = (assumptions.downscale_s + assumptions.upscale_s) / \
      assumptions.step_s
  failures = decoupled_clock.chaos_failures(
      num_learners, num_steps, mtbf=assumptions.mtbi_s / assumptions.step_s,
      downtime=max(downtime, 1e-9), chips=num_chips // num_learners,
      seed=seed)
  timeline = decoupled_clock.decoupled_timeline(
      num_steps, num_learners=num_learners, sync_every=sync_every,
      num_fragments=num_fragments, overlap=overlap, quorum=quorum,
      grace=grace, sync_steps=sync_steps, failures=failures, seed=seed)
  return decoupled_clock.timeline_goodput(timeline)
