"""``mesh.simulate_workers``: M workers stacked on shared devices train
exactly as M workers on their own devices.

With it the mesh's worker axis has size 1, and
``loc_opt.parallel.shard_map_workers`` runs such an axis under ``jax.vmap``
with the axis name, so the stacked workers' collectives reduce over the
stack instead of crossing devices.
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
                 {'mesh.simulate_workers': True, 'mesh.data': 8}):
    config = tiny_config(data_dir, **{
        'mesh.workers': 4, 'outer.method': method, 'num_steps': 12,
        'batch_size': 32, 'data.eval_batch_size': 32, 'eval_every': 12,
        'checkpoint_every': 0, **CASES.get(method, {}), **layout})
    summaries.append(train.train_and_evaluate(
        config, tmp_path / str(len(summaries))))
  real, simulated = summaries
  assert real['finished'] and simulated['finished']
  assert simulated['syncs'] == real['syncs']
  assert real['syncs'] > 0 or method.endswith('data_parallel')
  assert simulated['simulated_workers'] == 4
  assert simulated['cross_worker_bytes'] == 0  # nothing crosses devices
  assert 'simulated_workers' not in real
  np.testing.assert_allclose(simulated['final_eval_loss'],
                             real['final_eval_loss'], rtol=1e-5)


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


def test_simulated_workers_need_the_devices_inside_one_worker(data_dir):
  config = tiny_config(data_dir, **{'mesh.workers': 4, 'mesh.data': 2,
                                    'mesh.simulate_workers': True,
                                    'batch_size': 32,
                                    'data.eval_batch_size': 32})
  with pytest.raises(ValueError, match=r'stacks the 4 workers on every '
                     r'device, so mesh.data \* mesh.fsdp \* mesh.tensor = 2'
                     r' \* 1 \* 1 = 2 must equal the 8 devices'):
    train.validate_config(config, 8)
  config.mesh.data = 8
  train.validate_config(config, 8)  # 4 workers on each of 8 devices
  config.outer.state_layout = 'sharded'
  with pytest.raises(ValueError, match="state_layout='sharded'"):
    train.validate_config(config, 8)
