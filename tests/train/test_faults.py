"""Non-finite steps (loc_opt.train.faults): skipped where they happen,
counted, bounded, and never checkpointed."""

import json
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loc_opt import train
from loc_opt.train import checkpoint as ckpt_lib
from loc_opt.train import experiment as exp_lib
from loc_opt.train import faults
from loc_opt.train import registry
from loc_opt.train import registry
from loc_opt.train.method import shared_mask
from tests.train._helpers import leaves
from tests.train._helpers import tiny_config


def _one_step(config, phase=False):
  exp = exp_lib.build_experiment(config)
  state = exp.init_state()
  before = jax.device_get(state)
  batch = exp_lib.load_data(config).train.batch(0)
  if not exp.method.per_worker:
    batch = batch.reshape(-1, batch.shape[-1])
  after, _ = exp.programs.steps[phase](state, batch)
  return before, jax.device_get(after)


def test_a_non_finite_inner_step_is_skipped_on_its_worker_only(data_dir):
  config = tiny_config(data_dir, **{'faults.nan_grad_steps': (0,),
                                    'faults.nan_grad_workers': (1,)})
  before, after = _one_step(config)
  own = jax.tree.map(lambda s: not s, shared_mask(
      registry.METHODS['diloco'], before['opt_state']))
  kept = [x for x, o in zip(jax.tree.leaves(before['opt_state']),
                            jax.tree.leaves(own)) if o]
  stepped = [x for x, o in zip(jax.tree.leaves(after['opt_state']),
                               jax.tree.leaves(own)) if o]
  for old, new in zip(leaves(before['params']) + leaves(kept),
                      leaves(after['params']) + leaves(stepped)):
    np.testing.assert_array_equal(new[1], old[1])  # skipped, bit for bit
  # The other workers stepped (their Adam moments moved; the learning rate
  # of step 0 is 0 under the warmup, so their parameters did not).
  changed = [not np.array_equal(np.asarray(o)[0], np.asarray(n)[0])
             for o, n in zip(jax.tree.leaves(before['opt_state']),
                             jax.tree.leaves(after['opt_state']))]
  assert sum(changed) >= len(jax.tree.leaves(before['params']))
  np.testing.assert_array_equal(after['faults']['bad_steps'], [0, 1, 0, 0])
  np.testing.assert_array_equal(after['faults']['bad_streak'], [0, 1, 0, 0])
  assert all(np.isfinite(x).all() for x in leaves(after['params']))


def test_a_skipped_step_keeps_the_shared_fields_level(data_dir):
  # DiLoCo: worker 1 skips step 0; its counters advance with the others'
  # while its parameters and inner optimizer state stay.
  config = tiny_config(data_dir, **{'faults.nan_grad_steps': (0,),
                                    'faults.nan_grad_workers': (1,)})
  before, after = _one_step(config)
  old, new = before['opt_state'], after['opt_state']
  # Shared fields: the same operations on every worker in one program, and
  # a skipped worker's own fields are selected, not recomputed: exact.
  for field in registry.METHODS['diloco'].shared_fields:
    for x in leaves(getattr(new, field)):
      for m in range(1, x.shape[0]):
        np.testing.assert_array_equal(x[m], x[0])
  np.testing.assert_array_equal(new.count, [1, 1, 1, 1])
  np.testing.assert_array_equal(new.steps_since_sync, [1, 1, 1, 1])
  for a, b in zip(leaves(old.inner_state), leaves(new.inner_state)):
    np.testing.assert_array_equal(b[1], a[1])


def test_data_parallel_skips_the_whole_step(data_dir):
  config = tiny_config(data_dir, **{'outer.method': 'data_parallel',
                                    'faults.nan_grad_steps': (0,)})
  before, after = _one_step(config)
  # A skipped step selects the old values (no arithmetic): exact.
  for old, new in zip(leaves(before['params']), leaves(after['params'])):
    np.testing.assert_array_equal(new, old)
  assert int(after['faults']['bad_steps']) == 1


def test_nan_on_a_sync_step_keeps_every_worker_finite(data_dir, tmp_path):
  # Step 3 syncs (H = 4): the bad workers' gradients are zeroed for the
  # inner update and the sync averages finite pseudo-gradients.
  config = tiny_config(data_dir, **{'faults.nan_grad_steps': (3,),
                                    'faults.nan_grad_workers': (0, 2)})
  summary = train.train_and_evaluate(config, tmp_path)
  assert summary['finished'] and summary['bad_steps'] == 2
  assert np.isfinite(summary['final_eval_loss'])
  assert all(np.isfinite(x).all() for x in leaves(summary['state']['params']))
  records = train.read_metrics(tmp_path)
  assert [r['faults/bad_steps'] for r in records if 'faults/bad_steps' in r
          ][-1] == 2


def test_consecutive_bad_steps_stop_the_run_with_finite_checkpoints(
    data_dir, tmp_path):
  config = tiny_config(data_dir, **{
      'faults.nan_grad_steps': tuple(range(5, 12)),
      'faults.max_bad_steps': 3, 'log_every': 1, 'checkpoint_every': 2})
  with pytest.raises(faults.NonFiniteError, match='max_bad_steps=3'):
    train.train_and_evaluate(config, tmp_path)
  ckpt = ckpt_lib.Checkpointer(tmp_path, every=2, max_to_keep=2)
  step = ckpt.latest_step()
  # Steps 5, 6, 7 (0-based) were bad: the run stopped when it logged step
  # 8, before saving it; the last checkpoint is the one of step 6.
  assert step == 6
  exp = exp_lib.get_experiment(config)
  _, state = ckpt.restore(exp.layout,
                          train.config.config_to_json(config))
  ckpt.close()
  assert all(np.isfinite(x).all() for x in leaves(state['params']))


def test_non_finite_params_are_never_saved():
  faults.check_params({'w': jnp.ones(3)}, 4)
  with pytest.raises(faults.NonFiniteError, match='step 4'):
    faults.check_params({'w': jnp.array([1.0, jnp.nan])}, 4)


@pytest.mark.parametrize('field, value', [
    ('faults.nan_grad_workers', (4,)),
    ('faults.nan_grad_steps', (-1,)),
    ('faults.nan_param_workers', (5,)),
    ('faults.max_bad_steps', -1),
    ('faults.drop_workers', (4,)),
    ('faults.drop_syncs', (1,)),  # without drop_workers
    ('faults.drop_fraction', 1.0),
    ('faults.drop_fraction', -0.1),
    ('faults.drop_fraction', True),
    ('faults.step_sleep_s', (-0.5,)),
])
def test_bad_fault_fields_are_named(data_dir, tmp_path, field, value):
  overrides = {field: value}
  if field == 'faults.drop_workers':
    overrides['faults.drop_syncs'] = (0,)
  config = tiny_config(data_dir, **overrides)
  with pytest.raises(ValueError, match=field.replace('.', r'\.')):
    train.train_and_evaluate(config, tmp_path / 'wd')
  assert not (tmp_path / 'wd').exists()


@pytest.mark.parametrize('overrides, match', [
    ({'outer.method': 'demo'}, "'demo' does not support worker dropout"),
    ({'outer.codec': 'int8', 'outer.error_feedback': 'ef21'},
     "error_feedback='ef21'"),
])
def test_dropout_needs_a_method_that_can_leave_workers_out(
    data_dir, tmp_path, overrides, match):
  config = tiny_config(data_dir, **{'faults.drop_fraction': 0.5,
                                    **overrides})
  with pytest.raises(ValueError, match=match):
    train.train_and_evaluate(config, tmp_path / 'wd')
  assert not (tmp_path / 'wd').exists()


def test_absences_are_drawn_from_the_seed(data_dir):
  config = tiny_config(data_dir, **{'num_steps': 48,
                                    'faults.drop_fraction': 0.25,
                                    'faults.drop_syncs': (0, 40),
                                    'faults.drop_workers': (3,)})
  plan = registry.get_method('diloco').plan(config)
  steps, workers = faults.absences(config, plan)
  # 12 syncs (H = 4: steps 3, 7, ..., 47): a quarter of them lose one
  # drawn worker, and the first sync loses worker 3 (sync 40 does not exist).
  drawn = [(s, w) for s, w in zip(steps, workers) if (s, w) != (3, 3)]
  assert len(drawn) in (3, 2)  # 2 if a draw hit (step 3, worker 3) too
  assert (3, 3) in set(zip(steps.tolist(), workers.tolist()))
  assert all(s % 4 == 3 for s in steps) and all(0 <= w < 4 for w in workers)
  again = faults.absences(config, plan)
  np.testing.assert_array_equal(again[0], steps)
  np.testing.assert_array_equal(again[1], workers)
  other = faults.absences(tiny_config(data_dir, **{
      'num_steps': 48, 'seed': 1, 'faults.drop_fraction': 0.25}), plan)
  assert len(other[0]) == 3


def test_a_dropped_worker_is_left_out_and_rejoins_at_the_anchor(
    data_dir, tmp_path):
  # H = 4: syncs at steps 3, 7, 11; worker 2 misses sync 1 (step 7).
  config = tiny_config(data_dir, **{'faults.drop_syncs': (1,),
                                    'faults.drop_workers': (2,)})
  summary = train.train_and_evaluate(config, tmp_path / 'drop')
  assert summary['finished'] and summary['left_out'] == 1
  state = summary['state']
  np.testing.assert_array_equal(state['opt_state'].left_out, [0, 0, 1, 0])
  # Step 11 synced: every worker, the dropped one too, is at the shared
  # anchor (within the rounding of theta + (phi - theta)).
  # (The anchor: one all-reduced value, the same on every worker: exact.)
  for p, a in zip(leaves(state['params']), leaves(state['opt_state'].anchor)):
    for m in range(4):
      np.testing.assert_array_equal(a[m], a[0])
      np.testing.assert_allclose(p[m], a[0], rtol=1e-6, atol=1e-9)
  records = train.read_metrics(tmp_path / 'drop')
  lefts = [r['faults/left_out'] for r in records if 'faults/left_out' in r]
  assert lefts[0] == 0 and lefts[-1] == 1


def test_a_worker_with_nan_params_is_left_out_and_reset_at_the_sync(
    data_dir, tmp_path):
  # Worker 1's parameters go NaN at step 5: it skips steps 5 and 6, sends a
  # NaN pseudo-gradient at the sync of step 7, which leaves it out and
  # resets it to the (finite) anchor; it trains normally afterwards.
  config = tiny_config(data_dir, **{'faults.nan_param_steps': (5,),
                                    'faults.nan_param_workers': (1,)})
  summary = train.train_and_evaluate(config, tmp_path)
  assert summary['finished'] and summary['left_out'] == 1
  assert summary['bad_steps'] == 3
  state = summary['state']
  np.testing.assert_array_equal(state['faults']['bad_steps'], [0, 3, 0, 0])
  np.testing.assert_array_equal(state['faults']['bad_streak'], [0] * 4)
  np.testing.assert_array_equal(state['opt_state'].left_out, [0, 1, 0, 0])
  assert all(np.isfinite(x).all() for x in leaves(state['params']))
  assert np.isfinite(summary['final_eval_loss'])


@pytest.mark.parametrize('sync_every', [1, 10, 50])
def test_a_diverged_run_stops_whatever_the_sync_period(data_dir, tmp_path,
                                                      sync_every):
  # Learning rate 1e30: every worker goes non-finite right after each sync
  # resets it to the anchor. With syncs every 10 steps no worker has
  # faults.max_bad_steps (10) bad steps in a row, but 9 of every 10 are
  # bad: the fraction rule stops it; at 50, the consecutive rule.
  config = tiny_config(data_dir, **{
      'num_steps': 60, 'outer.sync_every': sync_every,
      'optimizer.learning_rate': 1e30, 'checkpoint_every': 8,
      'eval_every': 0})
  with pytest.raises(faults.NonFiniteError) as info:
    train.train_and_evaluate(config, tmp_path)
  records = train.read_metrics(tmp_path)
  assert records and records[-1]['step'] < 60
  assert not (tmp_path / 'summary.json').exists()
  # Syncs every 10 steps keep every run of bad steps below 10: only the
  # fraction rule can stop it (before it, this run ended with rc 0).
  rule = 'more than half' if sync_every == 10 else 'consecutive steps'
  assert rule in str(info.value), info.value
  step = ckpt_lib.latest_step(tmp_path)
  if step is not None:  # every checkpoint it left is finite
    exp = exp_lib.get_experiment(config)
    ckpt = ckpt_lib.Checkpointer(tmp_path, every=8)
    _, state = ckpt.restore(exp.layout, train.config.config_to_json(config))
    ckpt.close()
    assert all(np.isfinite(x).all() for x in leaves(state)
               if np.issubdtype(x.dtype, np.floating))


def test_step_sleep_is_one_value_or_one_per_process(data_dir):
  config = tiny_config(data_dir, **{'faults.step_sleep_s': (0.1, 0.3)})
  assert faults.step_sleep(config, 1, 2) == 0.3
  with pytest.raises(ValueError, match='2 values for 3 processes'):
    faults.step_sleep(config, 0, 3)
  config.faults.step_sleep_s = (0.2,)
  assert faults.step_sleep(config, 2, 3) == 0.2
  config.faults.step_sleep_s = ()
  assert faults.step_sleep(config, 0, 1) == 0.


def test_step_sleep_paces_every_step_of_a_run(data_dir, tmp_path,
                                              monkeypatch):
  # An emulated slower machine: the loop sleeps after each of the 12 steps.
  from loc_opt.train import loop  # pylint: disable=g-import-not-at-top
  slept = []
  clock = types.SimpleNamespace(perf_counter=time.perf_counter,
                                sleep=slept.append)
  monkeypatch.setattr(loop, 'time', clock)
  config = tiny_config(data_dir, **{'faults.step_sleep_s': (0.25,)})
  summary = train.train_and_evaluate(config, tmp_path)
  assert summary['finished'] and slept == [0.25] * config.num_steps


def test_a_run_resumes_with_another_step_sleep(data_dir):
  # Pacing changes no number: a run saved before the field, or with another
  # value, resumes.
  from loc_opt.train import resume_rules  # pylint: disable=g-import-not-at-top
  current = json.loads(json.dumps(tiny_config(
      data_dir, **{'faults.step_sleep_s': (0.5,)}).to_dict(), default=str))
  saved = json.loads(json.dumps(tiny_config(data_dir).to_dict(), default=str))
  assert resume_rules.resume_diffs(saved, current) == []
  del saved['faults']['step_sleep_s']
  assert resume_rules.resume_diffs(saved, current) == []
  saved['faults']['max_bad_steps'] = 3  # for contrast: a change that is not
  saved['seed'] = 7
  assert resume_rules.resume_diffs(saved, current)
