r"""Data-parallel vs DiLoCo (M = 4) on a Mixture-of-Experts LM and on the
dense LM of equal active parameters.

The dense model is the claims study's smallest LM (2 blocks, d_model 128,
MLP 512); the MoE model replaces each MLP by 4 experts of width 512 with
top-1 routing (capacity factor 1.25, load-balancing loss 0.01, z-loss
0.001), so a token passes the same matmuls as in the dense model (plus a
128 x 4 router). Each is trained data-parallel and with DiLoCo (4 workers
x 2 devices, H = ``--sync_every``, outer Nesterov lr 0.7, momentum 0.9) at
the claims study's budget (``--num_steps`` x 32 sequences x 128 bytes, the
config's AdamW learning rate and schedule, no tuning), and the table
reports the final eval loss, the cross-worker bytes and, for the MoE runs,
the routing diagnostics over time (``loc_opt.train.routing``): expert
imbalance, dropped assignments, router entropy and, under DiLoCo, the
workers' router drift before each sync. A fifth run syncs the routers
three times as often as the rest (``outer.method='group_diloco'``).

  python -m experiments.moe_study --workdir=/tmp/moe_study \
    [--runs=dense_dp,moe_diloco] [--num_steps=600] [--sync_every=30] \
    [--results_name=moe_study]

Finished runs are read back, so a second call only tabulates.
"""

import copy
import os

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _runs
from experiments import tables

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/diloco_lm.py',
                                          'Config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Parent of the run dirs.')
_RUNS = flags.DEFINE_list('runs', None, 'Subset of the runs (default: all).')
_NUM_STEPS = flags.DEFINE_integer('num_steps', 600, 'Steps of every run.')
_SYNC_EVERY = flags.DEFINE_integer('sync_every', 30, 'DiLoCo H.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')
_RESULTS_NAME = flags.DEFINE_enum(
    'results_name', 'moe_study', ['moe_study', 'moe_study_router'],
    'Name of the results file (docs/moe.md: the four dense / MoE runs, and '
    'the router-sync run).')
flags.mark_flag_as_required('workdir')

DENSE = {'model__num_layers': 2, 'model__d_model': 128, 'model__d_ff': 512,
         'model__num_heads': 4}
MOE = {**DENSE, 'model__moe__num_experts': 4, 'model__moe__top_k': 1}
DP = {'outer__method': 'data_parallel'}
DILOCO = {'outer__method': 'diloco'}
# name -> (label, overrides with '__' for nested fields)
RUNS = {
    'dense_dp': ('dense, data-parallel', {**DENSE, **DP}),
    'dense_diloco': ('dense, DiLoCo M=4', {**DENSE, **DILOCO}),
    'moe_dp': ('MoE 4 experts top-1, data-parallel', {**MOE, **DP}),
    'moe_diloco': ('MoE 4 experts top-1, DiLoCo M=4', {**MOE, **DILOCO}),
    # The routers synced 3x as often (outer.method='group_diloco').
    'moe_router_sync': ('MoE, DiLoCo M=4, routers every H/3',
                        {**MOE, 'outer__method': 'group_diloco'}),
}
ROUTING = ('routing/imbalance', 'routing/dropped', 'routing/entropy',
           'routing/router_drift')


def active_params(config, num_params: int) -> int:
  """Parameters a token passes: all but the experts it is not routed to."""
  moe, m = config.model.moe, config.model
  experts = moe.num_experts
  if not experts:
    return num_params
  per_expert = 2 * m.d_model * m.d_ff
  return num_params - (experts - moe.top_k) * per_expert * m.num_layers


def _routing_curve(workdir) -> dict[str, dict[int, float]]:
  from loc_opt import train  # pylint: disable=g-import-not-at-top
  out = {k: {} for k in ROUTING}
  for r in train.read_metrics(workdir):
    for k in ROUTING:
      if k in r:
        out[k][int(r['step'])] = float(r[k])
  return out


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  names = _runs.chosen(_RUNS.value, RUNS)
  base = copy.deepcopy(_CONFIG.value)
  base.progress = False
  base.num_steps = _NUM_STEPS.value
  base.outer.sync_every = _SYNC_EVERY.value
  base.outer.group_diloco.sync_every = max(1, _SYNC_EVERY.value // 3)
  base.log_every = 50
  base.eval_every = 100
  setup = {'num_steps': base.num_steps, 'batch_size': base.batch_size,
           'seq_len': base.data.seq_len, 'workers': base.mesh.workers,
           'devices': 8, 'sync_every': base.outer.sync_every,
           'learning_rate': base.optimizer.learning_rate,
           'outer_learning_rate': base.outer.learning_rate,
           'outer_momentum': base.outer.momentum}
  rows = []
  for i, name in enumerate(names):
    label, overrides = RUNS[name]
    c = _runs.variant(base, **overrides)
    s = _runs.run(c, os.path.join(_WORKDIR.value, name), label)
    rows.append({'name': name, 'label': label, 'method': c.outer.method,
                 'experts': c.model.moe.num_experts,
                 'final_eval_loss': s['final_eval_loss'],
                 'steps': s['step'], 'syncs': s['syncs'],
                 'cross_worker_bytes': s['cross_worker_bytes'],
                 'num_params': s['num_params'],
                 'active_params': active_params(c, s['num_params']),
                 'eval': s['curve']['eval'],
                 'routing': _routing_curve(os.path.join(_WORKDIR.value,
                                                        name))})
    results = {'setup': setup, 'rows': rows, 'pending': names[i + 1:]}
    _runs.write(_WORKDIR.value, _RESULTS_NAME.value,
                tables.render('moe_study', 'main', {'results': results}),
                results)


if __name__ == '__main__':
  app.run(main)
