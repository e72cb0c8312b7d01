"""A Mixture-of-Experts LM in the trainer: experts sharded inside a worker
(the compiled steps' collectives), DiLoCo from the launcher's entry point,
and the routing diagnostics in the metrics."""

import collections
import copy
import json
import os

import jax
import numpy as np
import pytest

from loc_opt import parallel
from loc_opt import train
from loc_opt.train import checkpoint as ckpt_lib
from loc_opt.train import experiment
from loc_opt.train import metrics as metrics_lib
from loc_opt.train import programs
from loc_opt.train import routing
from tests.train import _helpers
from tests.train.test_registry import CASES  # per-method fields



def _config(data_dir, **overrides):
  """A 1-block MoE LM (4 experts, top-2) under DiLoCo (H = 4) on 2 workers
  x fsdp 2 x tensor 2: experts over fsdp, expert MLPs over tensor."""
  return _helpers.tiny_config(data_dir, model='transformer', **{
      'model.moe.num_experts': 4, 'model.moe.top_k': 2,
      'mesh.workers': 2, 'mesh.data': 1, 'mesh.fsdp': 2, 'mesh.tensor': 2,
      'num_steps': 8, 'outer.sync_every': 4, **overrides})


@pytest.fixture(scope='module')
def diloco_moe(data_dir):
  """The experiment of :func:`_config` (the trainer test below reuses it
  through the experiment cache); only the programs a test reads are
  compiled."""
  eager = programs.EAGER_COMPILE_PHASES
  programs.EAGER_COMPILE_PHASES = 0
  try:
    return experiment.get_experiment(_config(data_dir))
  finally:
    programs.EAGER_COMPILE_PHASES = eager


def _kinds(report, cross):
  return collections.Counter(c.kind for c in report.collectives
                             if c.cross_worker == cross)


def test_inner_step_dispatches_to_experts_inside_the_worker(diloco_moe):
  """The inner step's all-to-alls (dispatch / combine between the tokens'
  and the experts' fsdp devices) stay inside the workers: zero bytes
  cross them."""
  exp = diloco_moe
  report = parallel.collective_bytes(exp.programs.steps[exp.plan.inner],
                                     exp.mesh)
  assert report.cross_worker_bytes == 0
  assert not _kinds(report, True)
  # Dispatch and combine, forward and backward: all-to-alls (GShard), not
  # the worker's whole batch gathered onto every expert's device and its
  # partial outputs all-reduced (XLA's choice without the token-sharded
  # constraint before the expert-sharded one).
  assert _kinds(report, False)['all-to-all'] >= 4, report.summary()
  rows = exp.config.batch_size // exp.config.mesh.workers
  whole_batch = f'[{rows},{exp.config.data.seq_len},'
  assert not [c.shape for c in report.collectives if whole_batch in c.shape]


def test_sync_moves_one_payload_of_every_parameter(diloco_moe):
  """The sync all-reduces one float32 copy of every parameter (router and
  experts included) across the workers, and nothing else crosses them."""
  exp = diloco_moe
  report = parallel.collective_bytes(exp.programs.steps[True], exp.mesh)
  workers = exp.config.mesh.workers
  assert report.cross_worker_bytes == workers * 4 * exp.model.num_params
  assert set(_kinds(report, True)) == {'all-reduce'}


def test_moe_lm_trains_under_diloco_with_routing_metrics(diloco_moe, data_dir,
                                                        tmp_path):
  """The MoE config from the trainer's entry point (the launcher calls
  it): DiLoCo, two syncs; the routing
  diagnostics are written at every log step and before every sync, with
  the routers' drift zero right after a sync and positive before one."""
  config = _config(data_dir, log_every=3, eval_every=8, checkpoint_every=0)
  assert experiment.get_experiment(config) is diloco_moe
  summary = train.train_and_evaluate(config, tmp_path)
  assert summary['finished'] and summary['syncs'] == 2
  assert np.isfinite(summary['final_eval_loss'])
  assert summary['bytes_per_inner_step'] == 0
  records = {r['step']: r for r in metrics_lib.read_metrics(tmp_path)
             if 'routing/entropy' in r}
  # Log steps 3, 6, 8 and the syncs (steps 4, 8).
  assert sorted(records) == [3, 4, 6, 8]
  for r in records.values():
    load = [r[f'routing/load_e{i}'] for i in range(4)]
    assert sum(load) == pytest.approx(1.0, rel=1e-5)
    assert 1.0 <= r['routing/imbalance'] <= r['routing/imbalance_max'] <= 4
    assert 0.0 <= r['routing/dropped'] < 1.0
    assert 0.0 < r['routing/entropy'] <= np.log(4) + 1e-6
  # Before the first sync the workers' routers have drifted apart (3
  # local steps on different data); the step after a sync starts equal.
  assert records[4]['routing/router_drift'] > 0
  params = summary['state']['params']
  assert routing.router_drift(params) < 1e-6  # the last step synced


def test_router_syncs_on_its_own_period(data_dir, tmp_path):
  """``outer.method='group_diloco'`` on the MoE LM: the routers sync every
  2 steps, the rest every 4; a routers-only sync moves the routers'
  float32 bytes across the workers, a full one every parameter's."""
  config = _config(data_dir, **{
      'outer.method': 'group_diloco', 'outer.group_diloco.sync_every': 2,
      'num_steps': 4, 'log_every': 4, 'eval_every': 4,
      'checkpoint_every': 0})
  summary = train.train_and_evaluate(config, tmp_path)
  assert summary['finished'] and summary['syncs'] == 2
  router = sum(x[0].size for x in jax.tree.leaves(
      summary['state']['params']['layer_0']['mlp']['router']))
  workers = config.mesh.workers
  assert summary['bytes_per_phase'] == {
      'False': 0, "('group',)": workers * 4 * router,
      "('group', 'main')": workers * 4 * summary['num_params']}
  record = metrics_lib.read_metrics(tmp_path)[-1]
  assert record['routing/router_drift'] > 0  # before the last sync


def test_a_run_saved_before_the_moe_fields_resumes(data_dir):
  """A dense run saved before ``model.moe`` (and the ``expert`` axis rule)
  existed resumes with their defaults, not with an MoE."""
  current = json.loads(json.dumps(
      _helpers.tiny_config(data_dir, model='transformer').to_dict()))
  saved = copy.deepcopy(current)
  del saved['model']['moe'], saved['model']['axis_rules']['expert']
  assert ckpt_lib.resume_diffs(saved, current) == []
  current['model']['moe']['num_experts'] = 4
  assert ckpt_lib.resume_diffs(saved, current) == [
      'model.moe.num_experts: None -> 4']


# Every other method on the MoE LM (4 workers x fsdp 2: experts split over
# fsdp) with LOC_OPT_ALL_METHODS=1: one trainer run each (one to three
# minutes on 2 busy cores; Streaming DiLoCo's fragments split the blocks,
# experts and routers included). The suite runs DiLoCo and group_diloco
# above.
OTHERS = sorted(set(CASES) - {'diloco', 'group_diloco'})


@pytest.mark.skipif(os.environ.get('LOC_OPT_ALL_METHODS') != '1',
                    reason='set LOC_OPT_ALL_METHODS=1')
@pytest.mark.parametrize('method', OTHERS)
def test_every_other_method_runs_on_the_moe_lm(data_dir, tmp_path, method):
  overrides = dict(CASES[method])
  overrides.pop('outer.group_diloco.pattern', None)
  config = _config(data_dir, **{
      'mesh.workers': 4, 'mesh.fsdp': 2, 'mesh.tensor': 1,
      'outer.method': method, 'eval_every': 8, 'checkpoint_every': 0,
      **overrides})
  summary = train.train_and_evaluate(config, tmp_path)
  assert summary['finished'] and np.isfinite(summary['final_eval_loss'])
  assert summary['cross_worker_bytes'] > 0
  if method != 'compressed_data_parallel':  # it talks every step
    assert summary['bytes_per_phase']['False'] == 0
