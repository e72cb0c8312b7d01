"""Outer / local-update optimizers (the DiLoCo family) as Optax wrappers.

Every method is an ``optax.GradientTransformationExtraArgs`` over an inner
optimizer (DeMo is a whole optimizer) that takes an ``axis_name`` and runs
under ``jax.vmap`` or ``jax.shard_map`` over the worker axis. Methods whose
steps send different things take a static ``sync`` phase, chosen on the host
by the method's :class:`Plan` (see :mod:`loc_opt.outer.plan`).

* DiLoCo and local SGD (:mod:`~loc_opt.outer.diloco`).
* Streaming DiLoCo (:mod:`~loc_opt.outer.streaming`) and Eager updates
  (:mod:`~loc_opt.outer.eager`).
* NoLoCo (:mod:`~loc_opt.outer.no_allreduce`): peer groups, no all-reduce.
* DeMo (:mod:`~loc_opt.outer.decoupled`) and SparseLoCo
  (:mod:`~loc_opt.outer.sparse_outer`).
* DES-LOC, Local Adam and MT-DAO (:mod:`~loc_opt.outer.desynced`).
* Asynchronous local SGD with Delayed Nesterov and DyLU, simulated
  (:mod:`~loc_opt.outer.asynchronous`).
* EDiT's pseudo-gradient penalty (:mod:`~loc_opt.outer.robust_average`) and
  CO2's one-round-stale outer step (:mod:`~loc_opt.outer.stale_overlap`).
"""

from loc_opt.outer.asynchronous import async_eval_params
from loc_opt.outer.asynchronous import async_events
from loc_opt.outer.asynchronous import async_local_sgd
from loc_opt.outer.asynchronous import async_phase_bytes
from loc_opt.outer.asynchronous import async_plan
from loc_opt.outer.asynchronous import AsyncLocalSgdState
from loc_opt.outer.server_momentum import delayed_nesterov
from loc_opt.outer.server_momentum import DelayedNesterovState
from loc_opt.outer.asynchronous import dylu_periods
from loc_opt.outer.asynchronous import push_bytes
from loc_opt.outer.server_momentum import scale_by_delayed_nesterov
from loc_opt.outer.decoupled import demo
from loc_opt.outer.decoupled import demo_eval_params
from loc_opt.outer.decoupled import demo_payload_bytes
from loc_opt.outer.decoupled import demo_plan
from loc_opt.outer.decoupled import scale_by_demo
from loc_opt.outer.desynced import desloc
from loc_opt.outer.desynced import desloc_eval_params
from loc_opt.outer.desynced import desloc_phase_bytes
from loc_opt.outer.desynced import desloc_plan
from loc_opt.outer.desynced import DeslocState
from loc_opt.outer.desynced import local_adam
from loc_opt.outer.desynced import mt_dao
from loc_opt.outer.diloco import diloco
from loc_opt.outer.diloco import diloco_eval_params
from loc_opt.outer.diloco import DilocoState
from loc_opt.outer.diloco import local_sgd
from loc_opt.outer.diloco import nesterov_outer
from loc_opt.outer.diloco import next_step_syncs
from loc_opt.outer.diloco import pseudo_gradient_bytes
from loc_opt.outer.diloco import sync_period
from loc_opt.outer.eager import eager_bytes
from loc_opt.outer.eager import eager_diloco
from loc_opt.outer.eager import eager_eval_params
from loc_opt.outer.eager import eager_plan
from loc_opt.outer.eager import EagerDilocoState
from loc_opt.outer.no_allreduce import noloco
from loc_opt.outer.no_allreduce import noloco_bytes
from loc_opt.outer.no_allreduce import noloco_eval_params
from loc_opt.outer.no_allreduce import noloco_groups
from loc_opt.outer.no_allreduce import noloco_plan
from loc_opt.outer.plan import Plan
from loc_opt.outer.robust_average import edit_bytes
from loc_opt.outer.robust_average import edit_diloco
from loc_opt.outer.robust_average import edit_eval_params
from loc_opt.outer.robust_average import edit_plan
from loc_opt.outer.robust_average import EditState
from loc_opt.outer.sparse_outer import sparseloco
from loc_opt.outer.sparse_outer import sparseloco_eval_params
from loc_opt.outer.sparse_outer import sparseloco_payload_bytes
from loc_opt.outer.sparse_outer import sparseloco_plan
from loc_opt.outer.stale_overlap import co2
from loc_opt.outer.stale_overlap import co2_bytes
from loc_opt.outer.stale_overlap import co2_eval_params
from loc_opt.outer.stale_overlap import co2_plan
from loc_opt.outer.stale_overlap import Co2State
from loc_opt.outer.streaming import fragment_bytes
from loc_opt.outer.streaming import fragment_ids
from loc_opt.outer.streaming import streaming_diloco
from loc_opt.outer.streaming import streaming_eval_params
from loc_opt.outer.streaming import streaming_plan
from loc_opt.outer.streaming import StreamingDilocoState
