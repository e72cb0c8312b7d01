"""Trainer integration of schedules: QSR sync periods, schedule-free,
WSD-S branches, WSM merges and injected gradient spikes."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import schedules
from loc_opt import train
from loc_opt.train import config as cfg_lib
from loc_opt.train import experiment as exp_lib
from loc_opt.train import method as method_lib
from loc_opt.train import spikes as spikes_lib
from tests.train._helpers import assert_leaves_close
from tests.train._helpers import leaves
from tests.train._helpers import tiny_config


def dp_config(data_dir, **overrides):
  """A data-parallel tiny schedule-free run, checkpoints every 2 steps.

  One compiled program per config; the main run below serves the
  schedule-free, branch, merge and spike tests.
  """
  base = {'outer.method': 'data_parallel', 'num_steps': 8,
          'checkpoint_every': 2, 'keep_checkpoints': 4, 'log_every': 1,
          'eval_every': 4, 'optimizer.name': 'schedule_free_adamw',
          'optimizer.schedule': 'warmup_constant',
          'optimizer.schedule_kwargs': {'warmup_steps': 2},
          'optimizer.grad_clip_norm': 0.}
  base.update(overrides)
  return tiny_config(data_dir, config_schedule=True, **base)


def by_step(workdir, key):
  return {r['step']: r[key] for r in train.read_metrics(workdir) if key in r}


@pytest.fixture(scope='module')
def main_run(data_dir, tmp_path_factory):
  """The constant-rate (schedule-free) main run that branches and merges
  start from."""
  workdir = tmp_path_factory.mktemp('main')
  config = dp_config(data_dir)
  return config, workdir, train.train_and_evaluate(config, workdir)


# ---------------------------------------------------------------- QSR


def test_qsr_sync_steps_follow_the_schedule_without_recompiling(
    data_dir, tmp_path):
  alpha, base, steps = 4.5e-3, 2, 12
  config = tiny_config(data_dir, config_schedule=True, **{
      'outer.sync_every': base, 'outer.sync_schedule': 'qsr',
      'outer.sync_schedule_kwargs': {'alpha': alpha}, 'log_every': 1,
      'optimizer.schedule_kwargs': {'warmup_steps': 0, 'end_value': 3e-4}})
  compiled = []

  def listener(event, duration, **kwargs):
    del duration
    if event == '/jax/core/compile/backend_compile_duration':
      compiled.append(kwargs.get('fun_name'))

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    summary = train.train_and_evaluate(config, tmp_path)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)

  # The sync steps the run took (cumulative syncs logged at every step).
  syncs = by_step(tmp_path, 'comm/syncs')
  taken = [s for s in range(1, steps + 1) if syncs[s] > syncs.get(s - 1, 0)]
  # The same schedule built independently, decided by diloco's own rule.
  lr = schedules.make_schedule('warmup_cosine', 3e-3, steps, warmup_steps=0,
                               end_value=3e-4)
  h = schedules.qsr_sync_schedule(base, alpha, lr, total_steps=steps)
  expected, since = [], 0
  for t in range(steps):
    if loc_opt.outer.next_step_syncs(h, t, since):
      expected.append(t + 1)
      since = 0
    else:
      since += 1
  assert taken == expected
  periods = np.diff([0] + taken)
  assert len(set(periods.tolist())) >= 3, periods  # H really changed
  assert summary['syncs'] == len(taken)
  assert summary['cross_worker_bytes'] == \
      len(taken) * summary['bytes_per_sync_step']
  opt_state = summary['state']['opt_state']
  assert np.all(np.asarray(opt_state.num_syncs) == len(taken))
  # Two train-step programs (inner, sync) plus the data-parallel reference
  # step of the summary, whatever the number of distinct periods.
  assert compiled.count('jit(step)') == 3, compiled


def test_sync_plan_matches_next_step_syncs():
  lr = optax.cosine_decay_schedule(0.01, 50, alpha=0.05)
  for h in (schedules.qsr_sync_schedule(2, 0.02, lr),
            schedules.step_sync_schedule({0: 3, 20: 7}), 5):
    plan = loc_opt.outer.plan.period_plan(h, 50)
    since = 0
    for t in range(50):
      want = loc_opt.outer.next_step_syncs(h, t, since)
      assert plan(t, since) == want, (h, t)
      since = 0 if want else since + 1


def test_sync_schedules_from_config(data_dir):
  config = tiny_config(data_dir, config_schedule=True, **{
      'outer.sync_schedule': 'step', 'outer.sync_schedule_kwargs': {
          'boundaries_and_periods': {'0': 2, '6': 5}}})
  plan = loc_opt.outer.plan.period_plan(cfg_lib.make_sync_every(config), 12)
  assert plan.period_fn.table.tolist() == [2] * 6 + [5] * 6
  config.outer.sync_schedule = 'constant'  # H = outer.sync_every = 4
  config.outer.sync_schedule_kwargs = {}
  plan = loc_opt.outer.plan.period_plan(cfg_lib.make_sync_every(config), 12)
  assert plan.period_fn.table.tolist() == [4] * 12


# ---------------------------------------------------------- schedule-free


def test_schedule_free_evaluates_x_and_resumes_bit_exactly(main_run,
                                                           tmp_path):
  config, _, full = main_run
  config = ml_collections.ConfigDict(config.to_dict())
  config.checkpoint_every = 4
  config.halt_after_steps = 7  # dies after step 7; last checkpoint at 4
  part = train.train_and_evaluate(config, tmp_path / 'resumed')
  assert part['step'] == 7 and not part['finished']
  config.halt_after_steps = 0
  resumed = train.train_and_evaluate(config, tmp_path / 'resumed')
  # The resume replays the same compiled steps: bit for bit.
  for a, b in zip(leaves(full['state']), leaves(resumed['state'])):
    np.testing.assert_array_equal(a, b)
  assert full['final_eval_loss'] == resumed['final_eval_loss']

  exp = exp_lib.get_experiment(config)
  state = full['state']
  x = exp.eval_params(state)
  want = schedules.schedule_free_eval_params(state['opt_state'],
                                             state['params'])
  for a, b, p in zip(leaves(x), leaves(want), leaves(state['params'])):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert np.max(np.abs(a - p)) > 1e-4
  batches = exp_lib.load_data(config).eval_batches(config.eval_batches)
  at_x = exp.evaluate_params(x, batches)
  at_y = exp.evaluate_params(state['params'], batches)
  np.testing.assert_allclose(full['final_eval_loss'], at_x, rtol=1e-6)
  assert abs(at_x - at_y) > 1e-4


def test_diloco_evaluates_the_anchor_even_when_schedule_free():
  inner = schedules.schedule_free_adamw(1e-2)
  params = {'w': jnp.arange(4.0)}
  dp = method_lib.eval_params_fn(train.METHODS['data_parallel'],
                                  jax.eval_shape(inner.init, params))
  state = inner.init(params)
  grads = {'w': jnp.ones(4)}
  for _ in range(3):
    updates, state = inner.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  # The same function called on the same values: exact.
  np.testing.assert_array_equal(
      dp(state, params)['w'],
      schedules.schedule_free_eval_params(state, params)['w'])
  assert not np.allclose(dp(state, params)['w'], params['w'])

  tx = loc_opt.diloco(inner, sync_every=2, axis_name=None)
  fn = method_lib.eval_params_fn(train.METHODS['diloco'],
                                  jax.eval_shape(tx.init, params))
  dstate = tx.init(params)
  for _ in range(3):
    updates, dstate = tx.update(grads, dstate, params)
    params = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(fn(dstate, params)['w'],
                                dstate.anchor['w'])


# ----------------------------------------------------- WSD-S branch, WSM


def test_branch_equals_uninterrupted_run_with_the_branch_schedule(
    data_dir, main_run, tmp_path):
  _, main_dir, _ = main_run
  # WSD for budget 8 with a 4-step decay: equal to the main run's
  # warmup-constant schedule before count 4, where the branch starts.
  start, sched = schedules.wsds_branch(3e-3, (), 4, 8, warmup_steps=2)
  assert start == 4
  config = dp_config(data_dir, **{
      'optimizer.schedule': 'wsd',
      'optimizer.schedule_kwargs': {'warmup_steps': 2, 'decay_steps': 4}})
  # Two schedule functions (WSD and the branch's) and, below, programs
  # compiled with different schedules (the main run's warmup-constant for
  # steps 0-3): equal to float32 rounding.
  np.testing.assert_allclose(
      exp_lib.get_experiment(config).lr_schedule(jnp.arange(10)),
      sched(jnp.arange(10)), rtol=1e-6, atol=1e-9)
  single = train.train_and_evaluate(config, tmp_path / 'single')
  branch = train.branch_and_evaluate(config, tmp_path / 'branch',
                                     from_workdir=main_dir, from_step=start)
  assert branch['finished'] and branch['init_from']['step'] == start
  assert_leaves_close(single['state'], branch['state'])
  np.testing.assert_allclose(branch['final_eval_loss'],
                             single['final_eval_loss'], rtol=1e-5)
  # The main run (no decay) ended elsewhere: the check bites.
  assert abs(main_run[2]['final_eval_loss']
             - single['final_eval_loss']) > 1e-3
  # the branch logged only its own steps
  assert min(r['step'] for r in train.read_metrics(tmp_path / 'branch')) > 4


@pytest.mark.parametrize('overrides,match', [
    ({'model.hidden': 32}, 'model.hidden'),
    ({'mesh.data': 1, 'mesh.fsdp': 2}, 'mesh.data'),
    ({'outer.method': 'diloco'}, 'outer.method'),
    ({'optimizer.kwargs': {'b1': 0.9, 'b2': 0.95, 'weight_decay': 0.2}},
     'optimizer.kwargs.weight_decay'),
    ({'init_from.step': 3}, 'saved steps'),
    ({'init_from.workdir': '/nonexistent/run'}, 'init_from.workdir'),
])
def test_branch_from_an_incompatible_run_fails_clearly(
    data_dir, main_run, tmp_path, overrides, match):
  _, main_dir, _ = main_run
  config = dp_config(data_dir, **{'init_from.workdir': str(main_dir),
                                  'init_from.step': 4})
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split('.')
    for p in parents:
      node = node[p]
    node[leaf] = value
  with pytest.raises(train.CheckpointError, match=match):
    train.train_and_evaluate(config, tmp_path / 'branch')
  assert not (tmp_path / 'branch').exists()


def test_wsm_merge_of_last_checkpoint_equals_its_eval(main_run):
  config, main_dir, summary = main_run
  steps = schedules.wsm_checkpoint_steps(8, 2, 2)
  assert steps == [4, 6, 8]
  last = train.merge_and_evaluate(config, main_dir, steps, [0., 0., 1.])
  np.testing.assert_allclose(last['eval_loss'], summary['final_eval_loss'],
                             rtol=1e-6)
  # merged from the evaluation weights (the schedule-free x), not from y
  x = exp_lib.get_experiment(config).eval_params(summary['state'])
  # Coefficients 0, 0, 1 of the restored x: exact by construction.
  for a, b in zip(leaves(last['params']), leaves(x)):
    np.testing.assert_array_equal(a, b)
  merged = train.merge_and_evaluate(config, main_dir, steps,
                                    schedules.wsm_coefficients(2))
  assert merged['coefficients'] == [0.0, 0.5, 0.5]
  assert np.isfinite(merged['eval_loss'])
  assert merged['eval_loss'] != last['eval_loss']
  with pytest.raises(train.CheckpointError, match='saved steps'):
    train.merge_and_evaluate(config, main_dir, [1, 8], [0.5, 0.5])
  with pytest.raises(ValueError, match='sum to 1'):
    train.merge_and_evaluate(config, main_dir, [6, 8], [0.5, 0.6])


# ------------------------------------------------------------- spikes


def test_spike_transform_hits_exactly_the_given_steps():
  steps = spikes_lib.spike_steps(100, 4, seed=3)
  assert steps == spikes_lib.spike_steps(100, 4, seed=3)
  assert steps != spikes_lib.spike_steps(100, 4, seed=4)
  assert len(steps) == 4 and all(20 <= s < 80 for s in steps)
  assert min(np.diff(steps)) >= 7  # at least half a 15-step bin apart
  tx = spikes_lib.inject_gradient_spikes(steps, 1000.)
  update = jax.jit(tx.update)
  state = tx.init({'g': jnp.ones(2)})
  hit = []
  for t in range(100):
    u, state = update({'g': jnp.ones(2)}, state)
    assert float(u['g'][0]) in (1.0, 1000.0)
    if float(u['g'][0]) == 1000.0:
      hit.append(t)
  assert hit == steps and int(state.hits) == 4


def test_spiked_run_diverges_exactly_after_the_spike(data_dir, main_run,
                                                     tmp_path):
  _, main_dir, _ = main_run
  # One spike in the window [2, 6): the same seed gives the same step.
  config = dp_config(data_dir, **{'optimizer.spike_num': 1,
                                  'optimizer.spike_window': (0.25, 0.75)})
  (spike,) = spikes_lib.spike_steps(8, 1, seed=0, window=(0.25, 0.75))
  assert exp_lib.get_experiment(config).spike_steps == [spike]
  summary = train.train_and_evaluate(config, tmp_path)
  # The main run without the spike (no clip in either): the train loss is
  # logged before each update, so steps 1..spike+1 agree, spike+2 differs.
  main = by_step(main_dir, 'train/loss')
  spiked = by_step(tmp_path, 'train/loss')
  for s in range(1, spike + 2):
    assert spiked[s] == pytest.approx(main[s], rel=1e-5), s
  assert abs(spiked[spike + 2] - main[spike + 2]) > 1e-3
  hits = jax.tree.leaves(summary['state']['opt_state'],
                         is_leaf=lambda x: isinstance(x, spikes_lib.SpikeState))
  (st,) = [x for x in hits if isinstance(x, spikes_lib.SpikeState)]
  assert int(st.hits) == 1 and int(st.count) == 8


# --------------------------------------------------------- bad fields


@pytest.mark.parametrize('overrides,match', [
    ({'outer.sync_schedule': 'cubic'}, 'outer.sync_schedule'),
    ({'outer.sync_schedule': 'qsr'}, 'outer.sync_schedule_kwargs'),
    ({'outer.sync_schedule': 'qsr',
      'outer.sync_schedule_kwargs': {'alpha': -1.}},
     'outer.sync_schedule_kwargs'),
    ({'outer.sync_schedule': 'step',
      'outer.sync_schedule_kwargs': {'boundaries_and_periods': {'5': 2}}},
     'outer.sync_schedule_kwargs'),
    ({'optimizer.spike_num': -1}, 'optimizer.spike_num'),
    ({'optimizer.spike_num': 1, 'optimizer.spike_scale': 0.},
     'optimizer.spike_scale'),
    ({'optimizer.spike_num': 1, 'optimizer.spike_window': (0.9, 0.1)},
     'optimizer.spike_window'),
    ({'optimizer.spike_num': 5}, 'optimizer.spike_num'),
    ({'init_from.workdir': '/somewhere', 'init_from.step': -1},
     'init_from.step'),
    ({'init_from.workdir': '/somewhere', 'init_from.step': 12},
     'init_from.step'),
])
def test_bad_schedule_fields_raise_clear_errors(data_dir, tmp_path,
                                                overrides, match):
  config = tiny_config(data_dir, config_schedule=True)
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split('.')
    for p in parents:
      node = node[p]
    node[leaf] = value
  with pytest.raises(ValueError, match=match):
    train.train_and_evaluate(config, tmp_path)
  assert not (tmp_path / 'checkpoints').exists()


def test_config_without_new_fields_still_builds(data_dir):
  config = tiny_config(data_dir, config_schedule=True)
  for key in ('sync_schedule', 'sync_schedule_kwargs'):
    del config.outer[key]
  del config['init_from']
  exp_lib.validate_config(config, 8)
  assert isinstance(config, ml_collections.ConfigDict)


def test_deprecated_sync_plan_warns_and_matches_the_period_plan():
  h = schedules.step_sync_schedule({0: 3, 20: 7})
  with pytest.warns(DeprecationWarning, match='period_plan'):
    old = train.SyncPlan(h, 40)
  new = loc_opt.outer.plan.period_plan(h, 40)
  assert old.periods.tolist() == new.period_fn.table.tolist()
  since = 0
  for t in range(40):
    assert old.syncs(t, since) == new(t, since)
    assert old.period(t) == (3 if t < 20 else 7)
    since = 0 if new(t, since) else since + 1
