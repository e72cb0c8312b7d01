"""Outer / local-update optimizers (the DiLoCo family) as Optax wrappers."""

from loc_opt.outer.diloco import diloco
from loc_opt.outer.diloco import diloco_eval_params
from loc_opt.outer.diloco import DilocoState
from loc_opt.outer.diloco import local_sgd
from loc_opt.outer.diloco import nesterov_outer
from loc_opt.outer.diloco import next_step_syncs
from loc_opt.outer.diloco import pseudo_gradient_bytes
from loc_opt.outer.diloco import sync_period

__all__ = [
    'diloco',
    'diloco_eval_params',
    'DilocoState',
    'local_sgd',
    'nesterov_outer',
    'next_step_syncs',
    'pseudo_gradient_bytes',
    'sync_period',
]
