"""The seeded kill / restart schedule of ``experiments/async_chaos.py``,
apart from the program so that tests import it without its flags."""

import numpy as np

NUM_LEARNERS = 4  # learners of a chaos run (learner SLOW runs slower)
SLOW = 3


def schedule(seed: int, seconds: float, kills: int, down_s: float
             ) -> list[tuple[float, str, str]]:
  """Seeded ``(time, 'kill'|'start', process)`` events within the window:
  ``kills`` learner kills in its middle 60% (a learner that is down is not
  picked), each followed by a restart after an exponential downtime (mean
  ``down_s``, at least 2 s), and the syncer killed at 50% of the window."""
  rng = np.random.default_rng(seed)
  events, up_at = [], {}
  for t in np.sort(rng.uniform(0.2 * seconds, 0.8 * seconds, kills)):
    alive = [m for m in range(NUM_LEARNERS) if up_at.get(m, 0.) <= t]
    if not alive:
      continue
    m = int(rng.choice(alive))
    back = float(t + max(2., rng.exponential(down_s)))
    up_at[m] = back
    events += [(float(t), 'kill', f'l{m}'), (back, 'start', f'l{m}')]
  events.append((0.5 * seconds, 'kill', 'syncer'))
  return sorted(events)
