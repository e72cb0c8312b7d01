"""Every training method by name (loc_opt.train.registry), through the trainer.

Every method builds from its config section (no compilation); a
representative set, one per kind of plan (fragments with apply-only phases,
peer groups, every-step exchange, sparse payloads, worker speeds, an
optimizer-state period), trains the tiny LM for a few steps on 4 workers x 2
devices, and its compiled programs' bytes are checked per phase: inner
steps move nothing across workers, sync phases move their payload, and the
summary carries the peak bytes and the simulated wall-clock. The transforms'
own numerics and bytes are tested in ``tests/outer``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loc_opt import models
from loc_opt import outer
from loc_opt import parallel
from loc_opt import train
from loc_opt.train import config as cfg_lib
from loc_opt.train import experiment as exp_lib
from loc_opt.train import registry
from loc_opt.train import simulated_time
from tests.train._helpers import NAN_ON_WORKER_1
from tests.train._helpers import assert_shared_fields_level
from tests.train._helpers import tiny_config

WORKERS = 4

# method -> config overrides (tiny model: 1 block; H = 4)
CASES = {
    'diloco': {},
    'local_sgd': {},
    'compressed_data_parallel': {},
    'streaming_diloco': {'outer.streaming_diloco.num_fragments': 2,
                         'outer.streaming_diloco.overlap': 1,
                         'checkpoint_every': 2},
    'eager_diloco': {},
    'noloco': {},
    'demo': {},
    'sparseloco': {},
    'desloc': {'outer.desloc.mu_sync_every': 4,
               'outer.desloc.nu_sync_every': 8},
    'mt_dao': {'optimizer.name': 'multi_timescale_adam',
               'optimizer.kwargs': {'b2': 0.95, 'weight_decay': 0.1}},
    'async_local_sgd': {'wallclock.worker_speeds': (1.0, 1.0, 1.0, 0.5)},
    'edit_diloco': {'outer.edit_diloco.warmup_syncs': 1},
    'co2': {},
    'decoupled_diloco': {'wallclock.worker_speeds': (1.0, 1.0, 1.0, 0.5)},
    'hierarchical_diloco': {},  # groups of 2, H1 = 4, H2 = 8
    # The MLP has no router: its first layer is the group (H_g = 2).
    'group_diloco': {'outer.group_diloco.pattern': 'dense_0/'},
}
TRAINED = ('streaming_diloco', 'noloco', 'demo', 'sparseloco', 'mt_dao',
           'async_local_sgd')


def _config(data_dir, method, **extra):
  overrides = {'outer.method': method, 'num_steps': 8, 'eval_every': 8,
               'checkpoint_every': 8, **CASES.get(method, {}), **extra}
  return tiny_config(data_dir, **overrides)


def _trained_config(data_dir, method):
  """A trained method's run; one whose workers share fields also gets a
  NaN on worker 1 (the shared-fields check of tests/train/test_layout.py
  runs on it, saving a second compile of the method)."""
  faults = NAN_ON_WORKER_1 if registry.METHODS[method].shared_fields else {}
  return _config(data_dir, method, **faults)


def test_every_method_is_registered_and_builds_from_its_config(data_dir):
  assert set(CASES) == set(registry.METHODS) - {'data_parallel'}
  for method in CASES:
    config = _config(data_dir, method)
    train.validate_config(config, 8)
    m = registry.get_method(method)
    tx = m.build(config, cfg_lib.make_inner(config), 'worker')
    model = models.build_model(config.model)
    params = jax.eval_shape(model.init, jax.random.key(0))
    state = jax.eval_shape(tx.init, params)
    assert jax.tree.leaves(state), method
    plan = m.plan(config)
    phases = plan.phases(config.num_steps)
    assert phases[0] == plan.inner, method
    if method != 'compressed_data_parallel':  # every step the same program
      assert len(phases) > 1, method
      assert plan.num_syncs(0, config.num_steps) > 0, method


def _check_run(summary, exp, config, method):
  assert summary['finished']
  assert np.isfinite(summary['final_eval_loss'])
  nbytes = exp.programs.bytes_per_step
  used = [exp.plan(c) for c in range(config.num_steps)]
  assert set(used) <= set(nbytes)  # every phase used was measured
  for phase in set(used):
    # Inner steps (and Streaming DiLoCo's apply-only steps) move nothing
    # across workers; every sync moves something.
    if exp.plan.is_sync(phase):
      assert nbytes[phase] > 0, (method, phase)
    else:
      assert nbytes[phase] == 0, (method, phase)
  assert summary['syncs'] == exp.plan.num_syncs(0, config.num_steps) > 0
  assert summary['peak_bytes_per_step'] == max(nbytes.values())
  assert summary['cross_worker_bytes'] == sum(nbytes[p] for p in used)
  clock = summary['wallclock']
  slow, fast = clock['1gbps'], clock['100gbps']
  assert slow['seconds'] >= fast['seconds'] > 0
  assert 0 < slow['utilization'] <= fast['utilization'] <= 1


def _streaming_checks(exp, config, summary, tmp_path):
  # The peak is the largest fragment, each element sent once per worker.
  params = jax.eval_shape(exp.model.init, jax.random.key(0))
  frags = outer.fragment_bytes(params, outer.fragment_ids(
      params, 2, pattern=config.outer.streaming_diloco.pattern))
  assert summary['peak_bytes_per_step'] / WORKERS == pytest.approx(
      max(frags), rel=0.02)
  assert summary['peak_bytes_per_step'] < 0.75 * 4 * exp.model.num_params \
      * WORKERS
  # A preempted and resumed run ends where the uninterrupted one did,
  # with the bytes and syncs replayed from the plan.
  config.halt_after_steps = 5  # last checkpoint at step 4
  part = train.train_and_evaluate(config, tmp_path / 'resumed')
  assert not part['finished']
  config.halt_after_steps = 0
  resumed = train.train_and_evaluate(config, tmp_path / 'resumed')
  # The resume replays the same compiled steps: bit for bit.
  for a, b in zip(jax.tree.leaves(summary['state']),
                  jax.tree.leaves(resumed['state'])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for key in ('final_eval_loss', 'cross_worker_bytes', 'syncs'):
    assert summary[key] == resumed[key], key


def _noloco_checks(exp, config, summary, tmp_path):
  del summary, tmp_path
  for phase in exp.plan.phases(config.num_steps):
    if not exp.plan.is_sync(phase):
      continue
    kinds = {kind for kind, _ in exp.programs.steps.transfers[phase]}
    assert kinds == {'collective-permute'}, kinds
    per_worker = exp.programs.bytes_per_step[phase] / WORKERS
    # phi and Delta, fp32, spread over the worker's devices.
    assert per_worker == pytest.approx(8 * exp.model.num_params, rel=0.02)


def _async_checks(exp, config, summary, tmp_path):
  del config, summary, tmp_path
  # A synchronous method waits for the slow worker; this one does not.
  link = parallel.Link(100.0)
  even = simulated_time.simulate_run(exp, link, step_time_s=1.0,
                                     speeds=(1.0,) * WORKERS)
  slow = simulated_time.simulate_run(exp, link, step_time_s=1.0)
  assert slow.compute_s == pytest.approx(even.compute_s)
  sync_method = registry.get_method('streaming_diloco')
  assert sync_method.waits_for_stragglers
  assert not exp.method.waits_for_stragglers


_EXTRA_CHECKS = {'streaming_diloco': _streaming_checks,
                 'noloco': _noloco_checks,
                 'async_local_sgd': _async_checks}


@pytest.mark.parametrize('method', TRAINED)
def test_method_trains_and_its_inner_steps_move_nothing(data_dir, tmp_path,
                                                        method):
  config = _trained_config(data_dir, method)
  summary = train.train_and_evaluate(config, tmp_path / method)
  exp = exp_lib.get_experiment(config)
  _check_run(summary, exp, config, method)
  if exp.method.shared_fields:
    assert_shared_fields_level(exp.method, jax.device_get(summary['state']))
  if method in _EXTRA_CHECKS:
    _EXTRA_CHECKS[method](exp, config, summary, tmp_path)


def test_stragglers_stretch_a_synchronous_run():
  comm = [0.0] * 8
  even = parallel.simulate_wallclock(comm, step_time_s=1.0)
  slow = parallel.simulate_wallclock(comm, step_time_s=1.0, slowdown=2.0)
  assert slow.total_s == pytest.approx(2 * even.total_s)


@pytest.mark.parametrize('method, bad, field', [
    ('streaming_diloco', {'outer.streaming_diloco.num_fragments': 3},  # 4 % 3
     'outer.streaming_diloco'),
    ('noloco', {'outer.noloco.group_size': 3}, 'outer.noloco'),  # 4 % 3
    ('desloc', {'outer.desloc.mu_sync_every': -2}, 'outer.desloc'),
    ('desloc', {'outer.desloc.average_at': 'midway'}, 'outer.desloc'),
    ('mt_dao', {'outer.desloc.clip_radius': -1.0}, 'outer.desloc'),
    ('mt_dao', {'optimizer.name': 'sgd'}, 'optimizer.name'),
    ('noloco', {'outer.sync_schedule': 'qsr',
                'outer.sync_schedule_kwargs': {'alpha': 0.01}},
     'outer.sync_schedule'),
    ('noloco', {'wallclock.worker_speeds': (1.0, 0.5)},  # 2 for 4 workers
     'wallclock.worker_speeds'),
    ('noloco', {'wallclock.worker_speeds': (0.5,) * 4},  # no fastest at 1
     'wallclock.worker_speeds'),
    ('noloco', {'wallclock.step_time_s': 0.0}, 'wallclock.step_time_s'),
    ('noloco', {'wallclock.bandwidths_gbps': (1.0, -2.0)},
     'wallclock.bandwidths_gbps'),
    ('hierarchical_diloco', {'outer.hierarchical_diloco.group_size': 3},
     'outer.hierarchical_diloco.group_size'),
    ('hierarchical_diloco',
     {'outer.hierarchical_diloco.global_momentum': 1.0},
     'outer.hierarchical_diloco.global_momentum'),
    ('hierarchical_diloco', {'outer.hierarchical_diloco.global_period': 0},
     'outer.hierarchical_diloco.global_period'),
    ('hierarchical_diloco', {'outer.hierarchical_diloco.group_codec': 'i8'},
     'outer.hierarchical_diloco.group_codec'),
    ('hierarchical_diloco',
     {'outer.hierarchical_diloco.group_codec': 'int8',
      'outer.hierarchical_diloco.group_codec_kwargs': {'bitz': 2}},
     'outer.hierarchical_diloco.group_codec_kwargs'),
    ('hierarchical_diloco',
     {'outer.hierarchical_diloco.group_error_feedback': 'ef'},  # no codec
     'outer.hierarchical_diloco.group_error_feedback'),
    ('hierarchical_diloco',
     {'outer.hierarchical_diloco.group_codec': 'int8',
      'outer.hierarchical_diloco.group_error_feedback': 'eff'},
     'outer.hierarchical_diloco.group_error_feedback'),
    ('hierarchical_diloco',
     {'outer.hierarchical_diloco.group_codec': 'int8',
      'outer.hierarchical_diloco.group_error_feedback': 'ef',
      'outer.hierarchical_diloco.group_ef_decay': 1.5},
     'outer.hierarchical_diloco.group_ef_decay'),
    ('hierarchical_diloco',
     {'outer.hierarchical_diloco.group_codec': 'powersgd',
      'outer.hierarchical_diloco.group_error_feedback': 'ef'},
     'outer.hierarchical_diloco.group_error_feedback'),
    ('diloco', {'outer.aggregate': 'mode'}, 'outer.aggregate'),
    ('noloco', {'outer.aggregate': 'median'}, 'outer.aggregate'),
    ('diloco', {'outer.aggregate': 'median', 'outer.codec': 'int8',
                'outer.error_feedback': 'ef'}, 'outer.error_feedback'),
    ('diloco', {'outer.aggregate': 'median', 'outer.codec': 'powersgd'},
     'outer.codec'),
    ('local_sgd', {'outer.aggregate': 'trimmed_mean',
                   'outer.aggregate_trim': 2}, 'outer.aggregate_trim'),
    ('streaming_diloco', {'outer.aggregate_clip': 0.0},
     'outer.aggregate_clip'),
    ('eager_diloco', {'outer.eager_diloco.momentum': 1.0},
     'outer.eager_diloco.momentum'),
    ('eager_diloco', {'outer.eager_diloco.learning_rate': -0.1},
     'outer.eager_diloco.learning_rate'),
])
def test_bad_fields_are_named(data_dir, method, bad, field):
  with pytest.raises(ValueError, match=field.replace('.', r'\.')):
    train.validate_config(_config(data_dir, method, **bad), 8)


def test_eager_outer_step_reads_its_own_section(data_dir):
  # Eager updates' own outer lr / momentum replace the shared ones where
  # set; unset (None), the shared outer step is used.
  def updates(tx):
    params = {'w': jnp.array([0.5, -1.0, 2.0])}
    state, out = tx.init(params), []
    for g in ([1.0, -2.0, 0.5], [0.3, 0.1, -1.0], [-0.7, 0.2, 0.4]):
      u, state = tx.update({'w': jnp.array(g)}, state, params)
      out.append(u['w'])
    return np.stack(out)

  config = _config(data_dir, 'eager_diloco', **{
      'outer.eager_diloco.learning_rate': 0.3,
      'outer.eager_diloco.momentum': 0.5})
  own = updates(cfg_lib.outer_optimizer(config, 'eager_diloco'))
  np.testing.assert_allclose(own, updates(outer.nesterov_outer(0.3, 0.5)),
                             rtol=1e-6)
  shared = updates(outer.nesterov_outer(config.outer.learning_rate,
                                        config.outer.momentum))
  assert not np.allclose(own, shared)
  np.testing.assert_allclose(
      updates(cfg_lib.outer_optimizer(config)), shared, rtol=1e-6)
  unset = _config(data_dir, 'eager_diloco', **{
      'outer.eager_diloco.learning_rate': None,
      'outer.eager_diloco.momentum': None})
  np.testing.assert_allclose(
      updates(cfg_lib.outer_optimizer(unset, 'eager_diloco')), shared,
      rtol=1e-6)


@pytest.mark.parametrize('name', sorted(
    n for n, m in registry.METHODS.items() if m.library_kwargs is not None))
def test_config_defaults_are_the_library_defaults(data_dir, name):
  # One source for every default: a field of outer.<method> that a library
  # function also takes has that function's default in configs/diloco_lm.py
  # (whose model, the Transformer, keeps the fragment pattern's default).
  config = tiny_config(data_dir, model='transformer')
  method = registry.METHODS[name]
  assert method.section in config.outer, name
  calls = method.library_kwargs(config)
  assert calls and any(calls.values()), name
  for fn, kwargs in calls.items():
    for arg, value in kwargs.items():
      want = registry.library_default(fn, arg)
      assert value == want, (name, fn.__name__, arg, value, want)


def test_aggregate_defaults_are_the_library_defaults(data_dir):
  kwargs = cfg_lib.aggregate_kwargs(tiny_config(data_dir))
  assert set(kwargs) == set(cfg_lib.AGGREGATE_FIELDS.values())
  for fn in (outer.diloco, outer.local_sgd, outer.streaming_diloco):
    for arg, value in kwargs.items():
      assert value == registry.library_default(fn, arg), (fn, arg)


def test_hierarchical_group_codec_from_the_config(data_dir):
  config = _config(data_dir, 'hierarchical_diloco', **{
      'outer.hierarchical_diloco.group_codec': 'statistical',
      'outer.hierarchical_diloco.group_codec_kwargs': {'bits': 2},
      'outer.hierarchical_diloco.group_error_feedback': 'ef',
      'outer.hierarchical_diloco.group_ef_decay': 0.9})
  train.validate_config(config, 8)
  tx = registry.get_method('hierarchical_diloco').build(
      config, cfg_lib.make_inner(config), 'worker')
  params = {'w': np.ones((3, 2), np.float32)}
  state = tx.init(params)
  # error feedback: one float32 residual per leaf, zero at the start
  np.testing.assert_array_equal(state.group_codec_state.error['w'],
                                np.zeros((3, 2), np.float32))


def test_robust_aggregate_builds_a_gathering_diloco(data_dir):
  config = _config(data_dir, 'diloco', **{'outer.aggregate': 'median'})
  train.validate_config(config, 8)
  tx = registry.get_method('diloco').build(
      config, cfg_lib.make_inner(config), None)
  params = {'w': np.ones((3, 2), np.float32)}
  state = tx.init(params)
  bad = {'w': np.full((3, 2), np.nan, np.float32)}
  # One worker, not finite: left out, the anchor stays.
  for _ in range(config.outer.sync_every):
    _, state = tx.update(bad, state, params)
  assert int(state.left_out) == 1
  np.testing.assert_array_equal(state.anchor['w'], params['w'])


def test_every_method_section_is_read(data_dir):
  # Every outer.<section> of the config belongs to a method (no stale keys).
  config = tiny_config(data_dir)
  sections = {k for k, v in config.outer.items()
              if hasattr(v, 'items') and k not in (
                  'codec_kwargs', 'sync_schedule_kwargs')}
  assert sections == {m.section for m in registry.METHODS.values()
                      if m.section is not None}
