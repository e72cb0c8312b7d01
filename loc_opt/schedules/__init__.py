"""Learning-rate and sync-period schedules, and the registries configs use.

Learning-rate schedules are pure, jittable ``step -> value`` functions in the
Optax count convention (the first update reads count 0); every name in
:data:`SCHEDULES` is built by ``make_schedule(name, peak, total_steps,
**kwargs)``. Alongside them: WSD-S branching (:func:`wsds_branch`), WSM
checkpoint merging (:func:`wsm_coefficients`, :func:`merge_params`),
schedule-free optimizers and their evaluation weights, schedule refinement
from gradient norms, the convex-theory bound tools, and sync-period
schedules ``count -> H`` for ``loc_opt.diloco`` (:data:`SYNC_SCHEDULES`,
including QSR).

Not included: UBA, the budget-aware schedule of *Stepsize anything: A
unified learning rate schedule for budgeted-iteration training* (Tang et
al., 2025). Its closed form has not been verified against the paper (spec
§B7 and §6 item 7), so no function is shipped for it.
"""

from loc_opt.schedules.base import constant_schedule
from loc_opt.schedules.base import make_schedule
from loc_opt.schedules.base import SCHEDULES
from loc_opt.schedules.base import steps_from_fraction
from loc_opt.schedules.base import warmup_cosine_schedule
from loc_opt.schedules.base import warmup_linear_schedule
from loc_opt.schedules.convex import bound_constants
from loc_opt.schedules.convex import schedule_shape
from loc_opt.schedules.convex import theory_bound
from loc_opt.schedules.convex import theory_optimal_base_lr
from loc_opt.schedules.convex import transfer_lr
from loc_opt.schedules.refinement import median_filter
from loc_opt.schedules.refinement import refined_schedule
from loc_opt.schedules.refinement import schedule_from_array
from loc_opt.schedules.restarts import cosine_restarts_schedule
from loc_opt.schedules.schedule_free import find_schedule_free_state
from loc_opt.schedules.schedule_free import schedule_free_adamw
from loc_opt.schedules.schedule_free import schedule_free_eval_params
from loc_opt.schedules.schedule_free import schedule_free_optimizer
from loc_opt.schedules.schedule_free import SCHEDULE_FREE_OPTIMIZERS
from loc_opt.schedules.schedule_free import schedule_free_sgd
from loc_opt.schedules.schedule_free import schedule_free_warmup
from loc_opt.schedules.sync import constant_sync_schedule
from loc_opt.schedules.sync import make_sync_schedule
from loc_opt.schedules.sync import qsr_sync_schedule
from loc_opt.schedules.sync import step_sync_schedule
from loc_opt.schedules.sync import SYNC_SCHEDULES
from loc_opt.schedules.wsd import DECAY_SHAPES
from loc_opt.schedules.wsd import decay_shape_fn
from loc_opt.schedules.wsd import linear_decay_schedule
from loc_opt.schedules.wsd import warmup_constant_schedule
from loc_opt.schedules.wsd import wsd_schedule
from loc_opt.schedules.wsd import wsds_branch
from loc_opt.schedules.wsd import wsds_schedule
from loc_opt.schedules.wsm import accumulate_params
from loc_opt.schedules.wsm import merge_params
from loc_opt.schedules.wsm import wsm_checkpoint_steps
from loc_opt.schedules.wsm import wsm_coefficients
