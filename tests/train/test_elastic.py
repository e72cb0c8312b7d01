"""Elastic resume (loc_opt.train.elastic): a run continues from its
checkpoint with another number of workers."""

import json

import jax
import numpy as np
import pytest

from loc_opt import train
from loc_opt.train import checkpoint as ckpt_lib
from loc_opt.train import config as cfg_lib
from loc_opt.train import experiment as exp_lib
from loc_opt.train.method import shared_mask
from tests.train._helpers import leaves
from tests.train._helpers import tiny_config
from tests.train.test_registry import CASES

# 8 CPU devices: the worker count and the data-parallel devices inside a
# worker change together.
MESHES = {4: {'mesh.workers': 4, 'mesh.data': 2},
          2: {'mesh.workers': 2, 'mesh.data': 4}}


def _config(data_dir, workers, **extra):
  # H = 4: a checkpoint at step 6 is two inner steps past DiLoCo's last
  # sync, so the workers' parameters differ from the anchor and each other.
  return tiny_config(data_dir, **{**MESHES[workers], 'checkpoint_every': 6,
                                  'eval_every': 12, **extra})


def _restore(workdir, config):
  exp = exp_lib.get_experiment(config)
  notes = []
  ckpt = ckpt_lib.Checkpointer(workdir, every=0, read_only=True,
                               report=notes.append)
  try:
    step, state = ckpt.restore(exp.layout, cfg_lib.config_to_json(config))
  finally:
    ckpt.close()
  return step, jax.device_get(state), notes


def _check_carried(old, new, method):
  """Shared fields and scalars equal; surviving workers' leaves equal (an
  elastic restore copies and selects what was saved, no arithmetic: exact)."""
  o, n = old['opt_state'], new['opt_state']
  for field in method.shared_fields:
    for a, b in zip(leaves(getattr(o, field)), leaves(getattr(n, field)),
                    strict=True):
      for m in range(b.shape[0]):
        np.testing.assert_array_equal(b[m], a[0])
  for key in ('step', 'data_position', 'rng'):
    np.testing.assert_array_equal(new[key], old[key])
  keep = min(jax.tree.leaves(o.count)[0].shape[0],
             jax.tree.leaves(n.count)[0].shape[0])
  own = jax.tree.map(lambda s: not s, shared_mask(method, o))
  pairs = [(a, b) for a, b, s in zip(jax.tree.leaves(o), jax.tree.leaves(n),
                                     jax.tree.leaves(own), strict=True) if s]
  pairs += list(zip(jax.tree.leaves(old['params']),
                    jax.tree.leaves(new['params']), strict=True))
  pairs += list(zip(jax.tree.leaves(old['faults']),
                    jax.tree.leaves(new['faults']), strict=True))
  for a, b in pairs:
    np.testing.assert_array_equal(np.asarray(b)[:keep],
                                  np.asarray(a)[:keep])
  return keep


# local_sgd is diloco with outer SGD(1): the same state, resized alike;
# diloco's fields are a subset of Streaming DiLoCo's (which adds per-fragment
# outer states and in-flight buffers), and 2 -> 4 below runs diloco.
@pytest.mark.slow
@pytest.mark.parametrize('method', ['streaming_diloco'])
def test_four_to_two_workers(data_dir, tmp_path, capfd, method):
  extra = {'outer.method': method, **CASES[method], 'checkpoint_every': 6}
  config = _config(data_dir, 4, halt_after_steps=6, **extra)
  old = jax.device_get(train.train_and_evaluate(config, tmp_path)['state'])
  new_config = _config(data_dir, 2, **extra)
  step, new, notes = _restore(tmp_path, new_config)
  assert step == 6
  assert notes == ['elastic resume at step 6: 4 -> 2 workers; workers 0-1 '
                   'continue; workers 2-3 dropped (their steps since the '
                   'last sync are lost); anchor, outer state and counters '
                   'carried over; global batch 16 = 2 x 8 per worker']
  method = exp_lib.get_experiment(new_config).method
  assert _check_carried(old, new, method) == 2
  assert leaves(new['params'])[0].shape[0] == 2
  # Mid-round: the surviving workers are not at the anchor.
  assert not np.array_equal(leaves(new['params'])[0][0],
                            leaves(new['opt_state'].anchor)[0][0])
  capfd.readouterr()
  summary = train.train_and_evaluate(new_config, tmp_path)
  assert 'elastic resume at step 6: 4 -> 2 workers' in capfd.readouterr().out
  assert summary['finished'] and np.isfinite(summary['final_eval_loss'])
  assert summary['syncs'] == exp_lib.get_experiment(
      new_config).plan.num_syncs(0, 12)
  assert all(np.isfinite(x).all() for x in leaves(summary['state']))
  # The resized run saves and resumes as a 2-worker run.
  saved = json.loads((tmp_path / 'checkpoints' / '12' / 'layout' /
                      'metadata').read_text())
  assert saved['workers'] == 2


@pytest.mark.slow
def test_two_to_four_workers_new_ones_start_from_the_anchor(data_dir,
                                                            tmp_path):
  config = _config(data_dir, 2, halt_after_steps=6)
  old = jax.device_get(train.train_and_evaluate(config, tmp_path)['state'])
  new_config = _config(data_dir, 4)
  _, new, notes = _restore(tmp_path, new_config)
  assert 'workers 0-1 continue; workers 2-3 start from the anchor' in \
      notes[0]
  exp = exp_lib.get_experiment(new_config)
  assert _check_carried(old, new, exp.method) == 2
  o = new['opt_state']
  for p, a in zip(leaves(new['params']), leaves(o.anchor), strict=True):
    for m in (2, 3):
      np.testing.assert_array_equal(p[m], a[0].astype(p.dtype))
  # A fresh inner state (zero moments) whose step counters are worker 0's,
  # so the learning-rate schedule continues at the run's step.
  at_anchor = jax.tree.map(lambda a, p: a[0].astype(p.dtype), o.anchor,
                           new['params'])
  fresh = leaves(exp.tx.init(at_anchor).inner_state)
  assert any(np.issubdtype(x.dtype, np.integer) for x in fresh)
  for x, f in zip(leaves(o.inner_state), fresh, strict=True):
    for m in (2, 3):
      if np.issubdtype(x.dtype, np.integer):
        np.testing.assert_array_equal(x[m], x[0])
        assert (x[0] == 6).all()
      else:
        np.testing.assert_array_equal(x[m], f)
  np.testing.assert_array_equal(new['faults']['bad_steps'][2:], [0, 0])
  summary = train.train_and_evaluate(new_config, tmp_path)
  assert summary['finished'] and np.isfinite(summary['final_eval_loss'])
  assert all(np.isfinite(x).all() for x in leaves(summary['state']))


@pytest.mark.parametrize('method, reason', [
    ('noloco', 'no anchor shared by all workers'),
    ('eager_diloco', 'no anchor shared by all workers'),
    ('data_parallel', 'one replicated copy'),
])
def test_other_methods_refuse_another_worker_count(data_dir, method, reason):
  saved = json.loads(cfg_lib.config_to_json(
      _config(data_dir, 4, **{'outer.method': method})))
  now = json.loads(cfg_lib.config_to_json(
      _config(data_dir, 2, **{'outer.method': method})))
  diffs = ckpt_lib.resume_diffs(saved, now)
  assert [d.split(' (')[0] for d in diffs] == ['mesh.data: 2 -> 4',
                                               'mesh.workers: 4 -> 2']
  assert all(reason in d and f"outer.method='{method}'" in d for d in diffs)
  # An elastic method may change the mesh; nothing else.
  saved['outer']['method'] = now['outer']['method'] = 'diloco'
  assert ckpt_lib.resume_diffs(saved, now) == []
  now['batch_size'] = 8
  assert ckpt_lib.resume_diffs(saved, now) == ['batch_size: 16 -> 8']


def test_a_worker_count_that_does_not_divide_the_batch_is_refused(data_dir):
  config = tiny_config(data_dir, **{'mesh.workers': 8, 'mesh.data': 1,
                                    'batch_size': 12})
  with pytest.raises(ValueError, match='batch_size=12 does not divide'):
    train.validate_config(config, 8)
