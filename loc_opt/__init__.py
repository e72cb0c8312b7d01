"""loc_opt: communication-efficient distributed training in JAX.

Optimizers, schedules and gradient compression as Optax transforms, run on
meshes whose outermost axis is the worker (DiLoCo replica) axis.
"""

from loc_opt import compression
from loc_opt import inner
from loc_opt import outer
from loc_opt import parallel
from loc_opt import schedules
from loc_opt.outer import diloco
from loc_opt.outer import diloco_eval_params
from loc_opt.outer import DilocoState
from loc_opt.outer import local_sgd
from loc_opt.outer import async_local_sgd
from loc_opt.outer import co2
from loc_opt.outer import decoupled_diloco
from loc_opt.outer import edit_diloco
from loc_opt.outer import delayed_nesterov
from loc_opt.outer import demo
from loc_opt.outer import desloc
from loc_opt.outer import eager_diloco
from loc_opt.outer import local_adam
from loc_opt.outer import mt_dao
from loc_opt.outer import noloco
from loc_opt.outer import sparseloco
from loc_opt.outer import streaming_diloco


# loc_opt.models, loc_opt.data and loc_opt.train pull in Flax, TFDS and Orbax;
# import them explicitly when needed, so `import loc_opt` stays light.

__version__ = '0.1.0'
