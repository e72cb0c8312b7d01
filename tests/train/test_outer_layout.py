"""``outer.state_layout`` in the trainer: the outer state replicated, sharded
over the workers, or offloaded to pinned host memory
(loc_opt.train.outer_layout)."""

import json
import shutil

import jax
import numpy as np
import pytest

from loc_opt import parallel
from loc_opt import train
from loc_opt.train import checkpoint as ckpt_lib
from loc_opt.train import config as cfg_lib
from loc_opt.train import experiment as exp_lib
from loc_opt.train import layout as layout_lib
from tests.train._helpers import assert_leaves_close
from tests.train._helpers import leaves
from tests.train._helpers import tiny_config

# 8 steps at H = 4: two syncs; checkpoints at steps 4 and 8.
_STEPS = 8


def _config(data_dir, layout, **overrides):
  return tiny_config(data_dir, config_schedule=True,
                     **{'outer.state_layout': layout, 'num_steps': _STEPS,
                        'eval_every': 0, **overrides})


def _losses(workdir):
  return [(r['step'], r['train/loss']) for r in train.read_metrics(workdir)
          if 'train/loss' in r]


@pytest.fixture(scope='module')
def runs(data_dir, tmp_path_factory):
  """One trainer run per layout: ``{layout: (summary, workdir)}``."""
  out = {}
  for layout in cfg_lib.STATE_LAYOUTS:
    workdir = tmp_path_factory.mktemp(layout)
    out[layout] = (train.train_and_evaluate(_config(data_dir, layout),
                                            workdir), workdir)
  return out


def _resume_from_step_4(config, workdir, tmp_path):
  """``workdir``'s run resumed from its step-4 checkpoint, in a copy (the
  run as if it had died between steps 4 and 8)."""
  copy = tmp_path / 'resumed'
  shutil.copytree(workdir, copy)
  shutil.rmtree(copy / 'checkpoints' / str(_STEPS))
  return train.train_and_evaluate(config, copy)


@pytest.mark.slow
def test_offloaded_run_is_the_replicated_run(runs, data_dir):
  # The same arithmetic, but two XLA programs (the outer state's host
  # transfers; fusion and layouts may differ): equal to float32 rounding,
  # bit for bit on some CPUs only.
  (rep, rep_dir), (off, off_dir) = runs['replicated'], runs['offloaded']
  assert rep['syncs'] == off['syncs'] == 2
  assert_leaves_close(rep['state'], off['state'])
  np.testing.assert_allclose(off['final_eval_loss'], rep['final_eval_loss'],
                             rtol=1e-5)
  off_losses, rep_losses = _losses(off_dir), _losses(rep_dir)
  assert [s for s, _ in off_losses] == [s for s, _ in rep_losses]
  np.testing.assert_allclose([x for _, x in off_losses],
                             [x for _, x in rep_losses], rtol=1e-5)
  assert off['cross_worker_bytes'] == rep['cross_worker_bytes']
  # The outer steps moved the anchor far more than the tolerance: a stale
  # or skipped outer step would fail the check.
  init = leaves(exp_lib.get_experiment(
      _config(data_dir, 'replicated')).init_state()['opt_state'].anchor)
  moved = max(float(np.max(np.abs(a - b))) for a, b in zip(
      init, leaves(off['state']['opt_state'].anchor), strict=True))
  assert moved > 1e-3, moved


@pytest.mark.slow
def test_sharded_run_equals_the_replicated_run_to_fp32_rounding(
    runs, data_dir):
  # The sharded sync takes the mean as phi - mean(theta') where the
  # replicated one takes mean(phi - theta'), and sums in another order
  # (reduce-scatter vs all-reduce): equal up to fp32 rounding, which Adam's
  # inner steps after the first sync carry on, not bit for bit.
  (rep, rep_dir), (sha, sha_dir) = runs['replicated'], runs['sharded']
  assert sha['syncs'] == 2
  for a, b in zip(leaves(rep['state']['params']),
                  leaves(sha['state']['params']), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  exp = exp_lib.get_experiment(_config(data_dir, 'sharded'))
  anchor = jax.device_get(exp.eval_params(sha['state']))  # the shards
  rep_anchor = jax.device_get(rep['state']['opt_state'].anchor)  # gathered
  for a, b in zip(leaves(rep_anchor), leaves(anchor), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(sha['final_eval_loss'], rep['final_eval_loss'],
                             rtol=1e-5)
  rep_losses, sha_losses = _losses(rep_dir), _losses(sha_dir)
  assert [s for s, _ in rep_losses] == [s for s, _ in sha_losses]
  np.testing.assert_allclose([x for _, x in sha_losses],
                             [x for _, x in rep_losses], rtol=1e-5)
  # Each worker holds 1/M of every anchor leaf (rows zero-padded to a
  # multiple of M), split inside the worker like its parameter.
  m = exp.config.mesh.workers
  for x, p in zip(jax.tree.leaves(sha['state']['opt_state'].anchor),
                  jax.tree.leaves(sha['state']['params']), strict=True):
    assert x.shape == (m, -(-p.shape[1] // m)) + p.shape[2:], (x.shape,
                                                              p.shape)
  # The sync is a reduce-scatter of the parameters and an all-gather of
  # the new anchor (and the 4-byte count of present workers), not an
  # all-reduce of the pseudo-gradient; the inner step sends nothing.
  kinds = {c.kind for c in exp.programs.steps.reports[True].collectives
           if c.cross_worker and c.bytes_per_device > 4}
  assert kinds == {'reduce-scatter', 'all-gather'}, kinds
  assert exp.programs.bytes_per_step[False] == 0
  # Each of a worker's 2 data-parallel devices reduce-scatters half of
  # every leaf (param_specs): the bytes of the replicated sync's all-reduce,
  # which worker_mean spreads the same way, plus the all-gather's 1/M.
  sync = exp.programs.bytes_per_step[True]
  replicated = exp_lib.get_experiment(
      _config(data_dir, 'replicated')).programs.bytes_per_step[True]
  assert abs(sync - replicated * (1 + 1 / m)) <= 0.01 * replicated, (
      sync, replicated)


@pytest.mark.slow
def test_sharded_checkpoint_resumes_bit_exactly(runs, data_dir, tmp_path):
  sha, workdir = runs['sharded']
  config = _config(data_dir, 'sharded')
  step_dir = workdir / 'checkpoints' / str(_STEPS)
  info = json.loads((step_dir / 'layout' / 'metadata').read_text())
  # The shards differ per worker: stored per worker, not once.
  assert info['outer_state_layout'] == 'sharded'
  assert info['shared_fields'] == ['count', 'steps_since_sync', 'num_syncs']
  resumed = _resume_from_step_4(config, workdir, tmp_path)
  assert resumed['finished']
  # The resume replays the same compiled steps on the restored state: the
  # same operations in the same order, bit for bit.
  for a, b in zip(leaves(sha['state']), leaves(resumed['state']),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  assert resumed['final_eval_loss'] == sha['final_eval_loss']


@pytest.mark.slow
def test_offloaded_outer_state_rests_in_pinned_host_memory(runs, data_dir):
  exp = exp_lib.get_experiment(_config(data_dir, 'offloaded'))
  for state in (runs['offloaded'][0]['state'], exp.init_state()):
    opt = state['opt_state']
    outer = jax.tree.leaves((opt.anchor, opt.outer_state))
    assert outer and {x.sharding.memory_kind for x in outer} == \
        {'pinned_host'}
    inner = jax.tree.leaves((state['params'], opt.inner_state))
    assert {x.sharding.memory_kind for x in inner} == {'device'}
  # The inner program passes the host-memory leaves through untouched
  # (read by nothing but the output tuple); the sync program reads them.
  inner_args = parallel.host_arguments(exp.programs.steps[False])
  assert len(inner_args) == len(outer)
  assert set(inner_args.values()) == {('tuple',)}
  sync_args = parallel.host_arguments(exp.programs.steps[True])
  assert len(sync_args) == len(outer)
  assert all(users != ('tuple',) for users in sync_args.values())


@pytest.mark.slow
def test_replicated_checkpoint_resumes_offloaded(runs, data_dir, tmp_path):
  # The two layouts store the same checkpoint: a run may switch on resume.
  rep, workdir = runs['replicated']
  resumed = _resume_from_step_4(_config(data_dir, 'offloaded'), workdir,
                                tmp_path)
  # Steps 5 to 8 ran in the offloaded layout's programs, not the replicated
  # run's: equal to float32 rounding.
  assert_leaves_close(rep['state'], resumed['state'])
  anchor = jax.tree.leaves(resumed['state']['opt_state'].anchor)
  assert {x.sharding.memory_kind for x in anchor} == {'pinned_host'}


@pytest.mark.slow
def test_sharded_checkpoint_refuses_another_worker_count_or_layout(
    runs, data_dir):
  _, workdir = runs['sharded']
  exp = exp_lib.get_experiment(_config(data_dir, 'sharded'))
  ckpt = ckpt_lib.Checkpointer(workdir, every=0, read_only=True)
  # DiLoCo may resume on another mesh, but not with a sharded outer state.
  two = _config(data_dir, 'sharded', **{'mesh.workers': 2, 'mesh.data': 4})
  layout = layout_lib.StateLayout(exp.method, exp.tx, exp.abstract_state, 2,
                                  two.batch_size, outer_state_layout='sharded')
  with pytest.raises(ckpt_lib.CheckpointError,
                     match=r"outer.state_layout='sharded'.*"
                     r'resume with mesh.workers=4'):
    ckpt.restore(layout, cfg_lib.config_to_json(two))
  # A whole outer state cannot read the shards (nor the reverse).
  saved = json.loads(cfg_lib.config_to_json(exp.config))
  for now in ('replicated', 'offloaded'):
    current = json.loads(cfg_lib.config_to_json(_config(data_dir, now)))
    assert ckpt_lib.resume_diffs(saved, current) == [
        f"outer.state_layout: 'sharded' -> {now!r}"]
    whole = layout_lib.StateLayout(exp.method, exp.tx, exp.abstract_state,
                                   4, 16, outer_state_layout=now)
    with pytest.raises(ValueError, match='cannot be exchanged'):
      whole.check({'workers': 4, 'shared_fields': [],
                   'outer_state_layout': 'sharded'})
  replicated = json.loads(cfg_lib.config_to_json(
      _config(data_dir, 'replicated')))
  del replicated['outer']['state_layout']  # a config from before the field
  current = json.loads(cfg_lib.config_to_json(
      _config(data_dir, 'offloaded')))
  assert ckpt_lib.resume_diffs(replicated, current) == []


@pytest.mark.parametrize('overrides, match', [
    ({'outer.state_layout': 'zero1'},
     "outer.state_layout must be one of 'offloaded', 'replicated', "
     "'sharded', got 'zero1'"),
    ({'outer.state_layout': 'sharded', 'outer.method': 'streaming_diloco'},
     r"outer.state_layout='sharded': outer.method='streaming_diloco' does "
     r'not support it \(its layouts: replicated; .* diloco, local_sgd\)'),
    ({'outer.state_layout': 'offloaded', 'outer.method': 'data_parallel'},
     "outer.state_layout='offloaded': outer.method='data_parallel'"),
    ({'outer.state_layout': 'sharded', 'outer.codec': 'int8'},
     "outer.codec must be 'none', got 'int8'"),
    ({'outer.state_layout': 'sharded', 'outer.aggregate': 'median'},
     "outer.aggregate must be 'mean', got 'median'"),
    ({'outer.state_layout': 'sharded', 'mesh.workers': 1, 'mesh.data': 8},
     "outer.state_layout='sharded' needs mesh.workers > 1"),
])
def test_bad_layouts_are_refused_naming_the_field(data_dir, overrides,
                                                  match):
  config = tiny_config(data_dir, **overrides)
  with pytest.raises(ValueError, match=match):
    exp_lib.validate_config(config, 8)
