"""Outer / local-update optimizers (the DiLoCo family) as Optax wrappers.

Every method is an ``optax.GradientTransformationExtraArgs`` over an inner
optimizer (DeMo is a whole optimizer) that takes an ``axis_name`` and runs
under ``jax.vmap`` or ``jax.shard_map`` over the worker axis. Methods whose
steps send different things take a static ``sync`` phase, chosen on the host
by the method's :class:`Plan` (see :mod:`loc_opt.outer.plan`).

* DiLoCo and local SGD (:mod:`~loc_opt.outer.diloco`).
* Streaming DiLoCo (:mod:`~loc_opt.outer.streaming_diloco`) and Eager updates
  (:mod:`~loc_opt.outer.eager_diloco`).
* NoLoCo (:mod:`~loc_opt.outer.noloco`): peer groups, no all-reduce.
* DeMo (:mod:`~loc_opt.outer.demo`) and SparseLoCo
  (:mod:`~loc_opt.outer.sparseloco`).
* DES-LOC, Local Adam and MT-DAO (:mod:`~loc_opt.outer.desloc`).
* Asynchronous local SGD with Delayed Nesterov and DyLU, simulated
  (:mod:`~loc_opt.outer.async_local_sgd`).
* Decoupled DiLoCo (:mod:`~loc_opt.outer.decoupled_diloco`): quorum,
  grace window and token-weighted merges, on a virtual clock
  (:mod:`~loc_opt.outer.decoupled_clock`).
* EDiT's pseudo-gradient penalty (:mod:`~loc_opt.outer.edit_diloco`) and
  CO2's one-round-stale outer step (:mod:`~loc_opt.outer.co2`).
* Hierarchical DiLoCo over worker groups, two sync periods
  (:mod:`~loc_opt.outer.hierarchical`).
* Robust aggregation of pseudo-gradients (:mod:`~loc_opt.outer.robust`):
  median, trimmed mean, norm-clipped mean (``diloco(..., aggregate=...)``).
* Staleness-aware options of an asynchronous syncer's outer step
  (:mod:`~loc_opt.outer.staleness`): age-weighted deltas, stale deltas
  corrected against the outer momentum, outer-momentum restarts.
"""

from loc_opt.outer._local import nesterov_outer
from loc_opt.outer._local import pseudo_gradient_bytes
from loc_opt.outer._sharded import state_bytes as outer_state_bytes
from loc_opt.outer.async_local_sgd import async_eval_params
from loc_opt.outer.async_local_sgd import async_events
from loc_opt.outer.async_local_sgd import async_local_sgd
from loc_opt.outer.async_local_sgd import async_phase_bytes
from loc_opt.outer.async_local_sgd import async_plan
from loc_opt.outer.async_local_sgd import AsyncLocalSgdState
from loc_opt.outer.async_local_sgd import dylu_periods
from loc_opt.outer.async_local_sgd import push_bytes
from loc_opt.outer.co2 import co2
from loc_opt.outer.co2 import co2_bytes
from loc_opt.outer.co2 import co2_eval_params
from loc_opt.outer.co2 import co2_plan
from loc_opt.outer.co2 import Co2State
from loc_opt.outer.decoupled_clock import chaos_failures
from loc_opt.outer.decoupled_clock import decoupled_timeline
from loc_opt.outer.decoupled_clock import Timeline
from loc_opt.outer.decoupled_clock import timeline_goodput
from loc_opt.outer.decoupled_clock import TimelineGoodput
from loc_opt.outer.decoupled_goodput import simulate_timeline
from loc_opt.outer.decoupled_diloco import balanced_fragments
from loc_opt.outer.decoupled_diloco import decoupled_diloco
from loc_opt.outer.decoupled_diloco import decoupled_eval_params
from loc_opt.outer.decoupled_diloco import DecoupledDilocoState
from loc_opt.outer.decoupled_diloco import merge_fragment
from loc_opt.outer.decoupled_diloco import merge_stacked
from loc_opt.outer.decoupled_diloco import radial_directional_average
from loc_opt.outer.decoupled_diloco import token_weight
from loc_opt.outer.decoupled_diloco import weighted_average
from loc_opt.outer.delayed_nesterov import delayed_nesterov
from loc_opt.outer.delayed_nesterov import DelayedNesterovState
from loc_opt.outer.delayed_nesterov import scale_by_delayed_nesterov
from loc_opt.outer.demo import demo
from loc_opt.outer.demo import demo_eval_params
from loc_opt.outer.demo import demo_payload_bytes
from loc_opt.outer.demo import demo_plan
from loc_opt.outer.demo import scale_by_demo
from loc_opt.outer.desloc import desloc
from loc_opt.outer.group_diloco import group_diloco
from loc_opt.outer.group_diloco import group_diloco_eval_params
from loc_opt.outer.group_diloco import group_diloco_plan
from loc_opt.outer.group_diloco import GroupDilocoState
from loc_opt.outer.desloc import desloc_eval_params
from loc_opt.outer.desloc import desloc_phase_bytes
from loc_opt.outer.desloc import desloc_plan
from loc_opt.outer.desloc import DeslocState
from loc_opt.outer.desloc import local_adam
from loc_opt.outer.desloc import mt_dao
from loc_opt.outer.diloco import diloco
from loc_opt.outer.diloco import diloco_apply_updates
from loc_opt.outer.diloco import diloco_eval_params
from loc_opt.outer.diloco import DilocoState
from loc_opt.outer.diloco import local_sgd
from loc_opt.outer.diloco import next_step_syncs
from loc_opt.outer.diloco import sync_period
from loc_opt.outer.eager_diloco import eager_bytes
from loc_opt.outer.eager_diloco import eager_diloco
from loc_opt.outer.eager_diloco import eager_eval_params
from loc_opt.outer.eager_diloco import eager_plan
from loc_opt.outer.eager_diloco import EagerDilocoState
from loc_opt.outer.edit_diloco import edit_bytes
from loc_opt.outer.edit_diloco import edit_diloco
from loc_opt.outer.edit_diloco import edit_eval_params
from loc_opt.outer.edit_diloco import edit_plan
from loc_opt.outer.edit_diloco import EditState
from loc_opt.outer.hierarchical import group_codec_mean
from loc_opt.outer.hierarchical import group_mean
from loc_opt.outer.hierarchical import hierarchical_diloco
from loc_opt.outer.hierarchical import hierarchical_eval_params
from loc_opt.outer.hierarchical import hierarchical_plan
from loc_opt.outer.hierarchical import HierarchicalDilocoState
from loc_opt.outer.noloco import noloco
from loc_opt.outer.noloco import noloco_bytes
from loc_opt.outer.noloco import noloco_eval_params
from loc_opt.outer.noloco import noloco_groups
from loc_opt.outer.noloco import noloco_plan
from loc_opt.outer.plan import Plan
from loc_opt.outer import robust
from loc_opt.outer.robust import AGGREGATES
from loc_opt.outer.sparseloco import sparseloco
from loc_opt.outer.sparseloco import sparseloco_eval_params
from loc_opt.outer.sparseloco import sparseloco_payload_bytes
from loc_opt.outer.sparseloco import sparseloco_plan
from loc_opt.outer.staleness import momentum_restarts
from loc_opt.outer.staleness import scale_by_age
from loc_opt.outer.staleness import stale_momentum_correction
from loc_opt.outer.staleness import staleness_outer
from loc_opt.outer.streaming_diloco import default_fragments
from loc_opt.outer.streaming_diloco import fragment_bytes
from loc_opt.outer.streaming_diloco import fragment_ids
from loc_opt.outer.streaming_diloco import streaming_diloco
from loc_opt.outer.streaming_diloco import streaming_eval_params
from loc_opt.outer.streaming_diloco import streaming_plan
from loc_opt.outer.streaming_diloco import StreamingDilocoState
