"""Shared state fields (Method.shared_fields) and the checkpoint layout that
stores them once (loc_opt.train.layout)."""

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from loc_opt import train
from loc_opt.outer.diloco import DilocoState
from loc_opt.train import checkpoint as ckpt_lib
from loc_opt.train import config as cfg_lib
from loc_opt.train import experiment as exp_lib
from loc_opt.train import registry
from loc_opt.train.method import shared_mask
from tests.train._helpers import NAN_ON_WORKER_1
from tests.train._helpers import assert_shared_fields_level
from tests.train._helpers import leaves
from tests.train._helpers import tiny_config
from tests.train.test_registry import CASES
from tests.train.test_registry import TRAINED

SHARING = sorted(name for name, m in registry.METHODS.items()
                 if m.shared_fields)
# local_sgd is diloco with outer SGD(1): the same state and code path, so
# the run-time check of diloco covers it (saves a run in the suite);
# tests/train/test_decoupled.py checks decoupled_diloco's in its own run.
CHECKED = [name for name in SHARING
           if name not in ('local_sgd', 'decoupled_diloco')]
# The methods that tests/train/test_registry.py trains run with the same
# NaN faults there and are checked in that run (one compile of each).
RUN_HERE = [name for name in CHECKED if name not in TRAINED]


def _run(config, steps):
  """The state after ``steps`` steps, each picked from the method's plan."""
  exp = exp_lib.build_experiment(config)
  data = exp_lib.load_data(config)
  state, since, syncs = exp.init_state(), 0, 0
  for step in range(steps):
    phase = exp.plan(step, since)
    state, _ = exp.programs.steps[phase](
        state, exp_lib.train_batch(exp, data, step))
    synced = exp.plan.is_sync(phase)
    since, syncs = (0 if synced else since + 1), syncs + int(synced)
  return exp, jax.device_get(state), syncs


def test_every_sharing_method_is_checked_in_a_run():
  trained = [name for name in TRAINED if name in SHARING]
  assert trained  # checked in test_registry's runs
  assert sorted(RUN_HERE + trained) == sorted(CHECKED)


def test_every_per_worker_method_names_real_fields():
  assert 'data_parallel' not in SHARING and 'demo' not in SHARING
  assert {'diloco', 'local_sgd', 'streaming_diloco'} <= {
      n for n, m in registry.METHODS.items() if m.elastic}
  for name in SHARING:
    assert 'inner_state' not in registry.METHODS[name].shared_fields, name
    assert 'codec_state' not in registry.METHODS[name].shared_fields, name


@pytest.mark.slow
@pytest.mark.parametrize('method', RUN_HERE)
def test_shared_fields_are_bit_identical_on_every_worker(data_dir, method):
  # Every worker reads its own data; a NaN on worker 1 at steps 0 and 1
  # (skipped where it is an inner step) must not split the shared fields.
  config = tiny_config(data_dir, **{
      'outer.method': method, 'num_steps': 10, **NAN_ON_WORKER_1,
      **CASES.get(method, {})})
  exp, state, syncs = _run(config, 9)
  assert syncs >= 1
  assert_shared_fields_level(exp.method, state)


def test_shared_mask_marks_top_level_fields():
  method = registry.METHODS['diloco']
  opt = DilocoState(inner_state=({'a': 1},), anchor={'inner_state': 2},
                    outer_state=(3,), count=4, steps_since_sync=5,
                    num_syncs=6, codec_state=({'x': 7},))
  mask = shared_mask(method, opt)
  assert mask.inner_state == ({'a': False},)
  assert mask.anchor == {'inner_state': True}  # by top-level field only
  assert mask.codec_state == ({'x': False},)
  assert (mask.outer_state, mask.count, mask.num_syncs) == ((True,), True,
                                                            True)
  with pytest.raises(ValueError, match='NamedTuple'):
    shared_mask(method, (1, 2))


def _saved_tree(step_dir, exp):
  """The stored ``state`` item's leaf shapes by path, and its layout."""
  meta = ocp.StandardCheckpointer().metadata(step_dir / 'state')
  tree = getattr(meta, 'item_metadata', meta)
  tree = getattr(tree, 'tree', tree)
  shapes = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in
            jax.tree_util.tree_leaves_with_path(tree) if hasattr(x, 'shape')}
  return shapes, json.loads((step_dir / 'layout' / 'metadata').read_text())


@pytest.mark.slow
def test_checkpoint_stores_the_anchor_once_and_resumes_bit_exactly(
    data_dir, tmp_path):
  config = tiny_config(data_dir)  # diloco, 4 workers
  workers = config.mesh.workers
  full = train.train_and_evaluate(config, tmp_path / 'full')
  exp = exp_lib.get_experiment(config)
  shapes, layout = _saved_tree(tmp_path / 'full' / 'checkpoints' / '12', exp)
  assert layout == {'format': 1, 'workers': workers, 'shared_fields': [
      'anchor', 'outer_state', 'count', 'steps_since_sync', 'num_syncs'],
                    'outer_state_layout': 'replicated'}
  anchor = {k: v for k, v in shapes.items() if "['anchor']" in k}
  params = {k: v for k, v in shapes.items() if "['params']" in k}
  assert anchor and len(anchor) == len(params)
  assert all(k.startswith("['shared']") for k in anchor)
  assert all(k.startswith("['per_worker']") for k in params)
  # The anchor has no worker axis; the parameters have one.
  assert sorted(anchor.values()) == sorted(v[1:] for v in params.values())
  assert all(v[0] == workers for v in params.values())
  assert shapes["['shared']['opt_state']['count']"] == ()
  # A resume restores it, broadcast to every worker, bit for bit.
  config.halt_after_steps = 6  # last checkpoint at 4
  train.train_and_evaluate(config, tmp_path / 'resumed')
  config.halt_after_steps = 0
  resumed = train.train_and_evaluate(config, tmp_path / 'resumed')
  # The same compiled steps replayed on the restored state, and a restore
  # that copies what was saved: bit for bit.
  for a, b in zip(leaves(full['state']), leaves(resumed['state']),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  _, state = ckpt_lib.Checkpointer(
      tmp_path / 'full', every=0, read_only=True).restore(
          exp.layout, cfg_lib.config_to_json(config), 12)
  for a, b in zip(leaves(full['state']), leaves(state), strict=True):
    np.testing.assert_array_equal(a, b)
