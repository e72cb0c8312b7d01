"""``mesh.simulate_workers``: M workers stacked on shared devices train
exactly as M workers on their own devices.

With it the mesh's worker axis holds the G groups of devices the workers
are stacked over (``mesh.data * mesh.fsdp * mesh.tensor`` devices each), and
``loc_opt.parallel.shard_map_workers(..., stacked=True)`` runs the worker
function under ``jax.vmap`` with the axis name: with one group the stacked
workers' collectives reduce over the stack and cross no device; with G,
GSPMD keeps M / G workers on each group and only the collectives cross.
"""

import os

import numpy as np
import pytest

from loc_opt import train
from tests.train._helpers import tiny_config
from tests.train.test_registry import CASES  # per-method fields

# The suite runs DiLoCo (an all-reduce of the pseudo-gradient over the
# stacked workers); the others, NoLoCo's collective-permutes between peers
# among them, run with LOC_OPT_ALL_METHODS=1 (about 5 more minutes on 2
# cores; each method is two trainer runs of programs no other test
# compiles). Every method of loc_opt.train.registry passed when the option
# was added.
SUITE = ['diloco']
OTHERS = ['noloco', 'streaming_diloco', 'eager_diloco', 'co2', 'sparseloco',
          'demo', 'desloc', 'mt_dao', 'local_sgd', 'async_local_sgd',
          'edit_diloco', 'hierarchical_diloco', 'decoupled_diloco',
          'data_parallel', 'compressed_data_parallel']


def _check(data_dir, tmp_path, method):
  summaries = []
  for layout in ({'mesh.data': 2},
                 {'mesh.simulate_workers': True, 'mesh.data': 8},
                 {'mesh.simulate_workers': True, 'mesh.data': 4}):
    config = tiny_config(data_dir, **{
        'mesh.workers': 4, 'outer.method': method, 'num_steps': 12,
        'batch_size': 32, 'data.eval_batch_size': 32, 'eval_every': 12,
        'checkpoint_every': 0, **CASES.get(method, {}), **layout})
    summaries.append(train.train_and_evaluate(
        config, tmp_path / str(len(summaries))))
  real, one_group, two_groups = summaries
  assert all(s['finished'] for s in summaries)
  assert one_group['syncs'] == two_groups['syncs'] == real['syncs']
  assert real['syncs'] > 0 or method.endswith('data_parallel')
  assert 'simulated_workers' not in real
  for simulated, groups in ((one_group, 1), (two_groups, 2)):
    assert simulated['simulated_workers'] == 4
    assert simulated['worker_groups'] == groups
    np.testing.assert_allclose(simulated['final_eval_loss'],
                               real['final_eval_loss'], rtol=1e-5)
  assert one_group['cross_worker_bytes'] == 0  # nothing crosses devices
  if method == 'diloco':  # the inner steps stay inside each group
    assert two_groups['bytes_per_phase']['False'] == 0
    assert two_groups['cross_worker_bytes'] > 0


@pytest.mark.slow
@pytest.mark.parametrize('method', SUITE)
def test_simulated_workers_train_as_workers_on_their_own_devices(
    data_dir, tmp_path, method):
  _check(data_dir, tmp_path, method)


@pytest.mark.skipif(os.environ.get('LOC_OPT_ALL_METHODS') != '1',
                    reason='set LOC_OPT_ALL_METHODS=1')
@pytest.mark.parametrize('method', OTHERS)
def test_every_other_method_too(data_dir, tmp_path, method):
  _check(data_dir, tmp_path, method)


def test_simulated_workers_need_groups_that_divide_the_workers(data_dir):
  config = tiny_config(data_dir, **{'mesh.workers': 4, 'mesh.data': 1,
                                    'mesh.simulate_workers': True,
                                    'batch_size': 32,
                                    'data.eval_batch_size': 32})
  with pytest.raises(ValueError, match=r'stacks the 4 workers on groups of '
                     r'mesh.data \* mesh.fsdp \* mesh.tensor = 1 \* 1 \* 1 '
                     r'= 1 devices, so the 8 devices must form a number of '
                     r'groups that divides the 4 workers'):
    train.validate_config(config, 8)  # 8 groups
  config.mesh.data = 3
  with pytest.raises(ValueError, match='the 8 devices must form'):
    train.validate_config(config, 8)  # 8 devices are no groups of 3
  for data in (8, 4, 2):  # 1, 2 or 4 groups: 4, 2 or 1 worker(s) on each
    config.mesh.data = data
    train.validate_config(config, 8)
  config.outer.state_layout = 'sharded'
  with pytest.raises(ValueError, match="state_layout='sharded'"):
    train.validate_config(config, 8)
