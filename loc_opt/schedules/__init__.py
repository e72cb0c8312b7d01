"""Learning-rate schedules and the registry the launcher resolves names in."""

from loc_opt.schedules.base import constant_schedule
from loc_opt.schedules.base import make_schedule
from loc_opt.schedules.base import SCHEDULES
from loc_opt.schedules.base import steps_from_fraction
from loc_opt.schedules.base import warmup_cosine_schedule
from loc_opt.schedules.base import warmup_linear_schedule
