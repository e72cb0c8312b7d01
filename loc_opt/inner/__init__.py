"""Inner optimizers and the registry the launcher resolves names in."""

from loc_opt.inner.registry import make_optimizer
from loc_opt.inner.registry import OPTIMIZERS
