"""M = 1 on a multi-device mesh (DiLoCo's scaling-law headline setting):
every method that averages over workers used to fail to compile there."""

import numpy as np
import pytest

from loc_opt import train
from tests.train._helpers import tiny_config


# Every method runs at M = 1 through the same runner
# (tests/parallel/test_runners.py checks it); DiLoCo end to end here.
@pytest.mark.parametrize('method, layouts', [
    ('diloco', ({'mesh.data': 8}, {'mesh.data': 2, 'mesh.fsdp': 4})),
])
def test_one_worker_runs_on_eight_devices_as_on_any_layout(
    data_dir, tmp_path, method, layouts):
  losses = []
  for layout in layouts:
    config = tiny_config(data_dir, **{
        'mesh.workers': 1, 'outer.method': method, 'num_steps': 8,
        'eval_every': 8, 'checkpoint_every': 0, **layout})
    summary = train.train_and_evaluate(config, tmp_path / str(len(losses)))
    assert summary['finished'] and summary['syncs'] == 2
    assert summary['cross_worker_bytes'] == 0  # one worker: nothing crosses
    losses.append(summary['final_eval_loss'])
  assert np.isfinite(losses[0])
  np.testing.assert_allclose(losses, losses[0], rtol=1e-5)
