"""Names kept for one release after the architecture change (issue 11)."""

import warnings

import numpy as np

from loc_opt.outer import plan as plan_lib


class SyncPlan:
  """Deprecated: use ``loc_opt.outer.plan.period_plan(sync_every,
  num_steps)``, whose ``plan(count, steps_since_sync)`` is ``syncs``."""

  def __init__(self, sync_every, num_steps: int):
    warnings.warn('loc_opt.train.SyncPlan is deprecated; use '
                  'loc_opt.outer.plan.period_plan', DeprecationWarning,
                  stacklevel=2)
    self.sync_every = sync_every
    self._plan = plan_lib.period_plan(sync_every, num_steps)
    self.periods = np.asarray(self._plan.period_fn.table)

  def period(self, count: int) -> int:
    """``H`` in force at ``count``."""
    return self._plan.period_fn(int(count))

  def syncs(self, count: int, steps_since_sync: int) -> bool:
    """Whether the step after ``count`` updates is a sync step."""
    return bool(self._plan(count, steps_since_sync))
