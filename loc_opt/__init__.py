"""loc_opt: communication-efficient distributed training in JAX.

Optimizers, schedules and gradient compression as Optax transforms, run on
meshes whose outermost axis is the worker (DiLoCo replica) axis.
"""

from loc_opt import outer
from loc_opt import parallel
from loc_opt.outer import diloco
from loc_opt.outer import diloco_eval_params
from loc_opt.outer import DilocoState
from loc_opt.outer import local_sgd

__version__ = '0.1.0'
