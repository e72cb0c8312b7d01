"""loc_opt: communication-efficient distributed training in JAX.

Optimizers, schedules and gradient compression as Optax transforms, run on
meshes whose outermost axis is the worker (DiLoCo replica) axis.

Every transform and schedule is reachable from here, as in Optax
(``loc_opt.diloco``, ``loc_opt.spam``, ``loc_opt.wsd_schedule``); each
family also has its own submodule with its helpers and registries:
``loc_opt.outer`` (the DiLoCo family and its plans), ``loc_opt.inner``
(inner optimizers, ``make_optimizer``), ``loc_opt.schedules``,
``loc_opt.compression`` (codecs and compressors) and ``loc_opt.parallel``
(worker meshes, ``vmap_workers`` / ``shard_map_workers``, byte accounting).
A transform that averages over workers (``axis_name='worker'``) runs inside
``loc_opt.parallel.vmap_workers`` or ``shard_map_workers``:
``docs/quickstart.md`` has the recipes for jit, NNX, Linen and sharded
loops.
"""

from loc_opt import compression
from loc_opt import inner
from loc_opt import outer
from loc_opt import parallel
from loc_opt import schedules
# The DiLoCo family (outer optimizers) and their evaluation weights.
from loc_opt.outer import async_eval_params
from loc_opt.outer import async_local_sgd
from loc_opt.outer import co2
from loc_opt.outer import co2_eval_params
from loc_opt.outer import decoupled_diloco
from loc_opt.outer import decoupled_eval_params
from loc_opt.outer import delayed_nesterov
from loc_opt.outer import demo
from loc_opt.outer import demo_eval_params
from loc_opt.outer import desloc
from loc_opt.outer import desloc_eval_params
from loc_opt.outer import diloco
from loc_opt.outer import diloco_apply_updates
from loc_opt.outer import diloco_eval_params
from loc_opt.outer import DilocoState
from loc_opt.outer import eager_diloco
from loc_opt.outer import eager_eval_params
from loc_opt.outer import group_diloco
from loc_opt.outer import group_diloco_eval_params
from loc_opt.outer import edit_diloco
from loc_opt.outer import edit_eval_params
from loc_opt.outer import hierarchical_diloco
from loc_opt.outer import hierarchical_eval_params
from loc_opt.outer import local_adam
from loc_opt.outer import local_sgd
from loc_opt.outer import mt_dao
from loc_opt.outer import noloco
from loc_opt.outer import noloco_eval_params
from loc_opt.outer import scale_by_delayed_nesterov
from loc_opt.outer import scale_by_demo
from loc_opt.outer import sparseloco
from loc_opt.outer import sparseloco_eval_params
from loc_opt.outer import streaming_diloco
from loc_opt.outer import streaming_eval_params
# Inner (per-worker) optimizers and their pieces.
from loc_opt.inner import adaptive_grad_norm
from loc_opt.inner import adaptive_max_clip
from loc_opt.inner import clip_by_moment_ratio
from loc_opt.inner import dion
from loc_opt.inner import drop_muon
from loc_opt.inner import fira
from loc_opt.inner import frugal
from loc_opt.inner import multi_timescale_adam
from loc_opt.inner import muon_adamw
from loc_opt.inner import reset_every
from loc_opt.inner import sampled_layers
from loc_opt.inner import scale_by_dion
from loc_opt.inner import scale_by_drop_muon
from loc_opt.inner import scale_by_fira
from loc_opt.inner import scale_by_frugal
from loc_opt.inner import scale_by_multi_timescale
from loc_opt.inner import scale_by_spam
from loc_opt.inner import scale_by_stable_spam
from loc_opt.inner import scale_by_swan
from loc_opt.inner import spam
from loc_opt.inner import stable_spam
from loc_opt.inner import swan
# Learning-rate and sync-period schedules, schedule-free optimizers.
from loc_opt.schedules import constant_schedule
from loc_opt.schedules import constant_sync_schedule
from loc_opt.schedules import cosine_restarts_schedule
from loc_opt.schedules import linear_decay_schedule
from loc_opt.schedules import qsr_sync_schedule
from loc_opt.schedules import refined_schedule
from loc_opt.schedules import schedule_free_adamw
from loc_opt.schedules import schedule_free_eval_params
from loc_opt.schedules import schedule_free_sgd
from loc_opt.schedules import step_sync_schedule
from loc_opt.schedules import warmup_constant_schedule
from loc_opt.schedules import warmup_cosine_schedule
from loc_opt.schedules import warmup_linear_schedule
from loc_opt.schedules import wsd_schedule
from loc_opt.schedules import wsds_branch
from loc_opt.schedules import wsds_schedule


# loc_opt.models, loc_opt.data and loc_opt.train pull in Flax, TFDS and Orbax;
# import them explicitly when needed, so `import loc_opt` stays light.

__version__ = '0.1.0'
