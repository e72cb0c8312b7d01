"""The DiLoCo family through the trainer: every method by name, end to end.

Each method trains the tiny LM for a few steps on 4 workers x 2 devices; the
compiled programs' bytes are checked per phase (inner steps move nothing
across workers; sync phases move what the method's byte helper says), and
the summary carries the peak bytes and the simulated wall-clock.
"""

import jax
import numpy as np
import pytest

from loc_opt import outer
from loc_opt import train
from loc_opt.train import trainer as trainer_lib
from tests.train.test_trainer import tiny_config

WORKERS = 4

# method -> config overrides (tiny model: 1 block; H = 4)
CASES = {
    'streaming_diloco': {'outer.streaming.num_fragments': 2,
                         'outer.streaming.overlap': 1},
    'eager_diloco': {},
    'noloco': {},
    'demo': {},
    'sparseloco': {},
    'desloc': {'outer.desloc.mu_sync_every': 4,
               'outer.desloc.nu_sync_every': 8},
    'mt_dao': {'optimizer.name': 'multi_timescale_adam',
               'optimizer.kwargs': {'b2': 0.95, 'weight_decay': 0.1}},
    'async_local_sgd': {'wallclock.worker_speeds': (1.0, 1.0, 1.0, 0.5)},
    'edit_diloco': {'outer.edit.warmup_syncs': 1},
    'co2': {},
}


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp('tfds'))


def _config(data_dir, method, **extra):
  overrides = {'outer.method': method, 'num_steps': 8, 'eval_every': 8,
               'checkpoint_every': 8, **CASES[method], **extra}
  return tiny_config(data_dir, **overrides)


def _fp32_params_bytes(exp):
  """Bytes of one fp32 copy of the model, per worker."""
  return 4 * exp.model.num_params


@pytest.mark.parametrize('method', sorted(CASES))
def test_method_trains_and_its_inner_steps_move_nothing(data_dir, tmp_path,
                                                        method):
  config = _config(data_dir, method)
  summary = train.train_and_evaluate(config, tmp_path / method)
  assert summary['finished']
  assert np.isfinite(summary['final_eval_loss'])
  exp = trainer_lib.get_experiment(config)
  nbytes = exp.programs.bytes_per_step
  phases = list(nbytes)
  # Every phase the run used was compiled and measured.
  used = {exp.plan(c) for c in range(config.num_steps)}
  assert used <= set(phases)
  for phase in phases:
    # Inner steps (and Streaming DiLoCo's apply-only steps) move nothing
    # across workers; every sync moves something.
    if not exp.plan.is_sync(phase):
      assert nbytes[phase] == 0, (method, phase)
    else:
      assert nbytes[phase] > 0, (method, phase)
  assert summary['syncs'] == exp.plan.num_syncs(0, config.num_steps) > 0
  assert summary['peak_bytes_per_step'] == max(nbytes.values())
  assert summary['cross_worker_bytes'] == sum(
      nbytes[exp.plan(c)] for c in range(config.num_steps))
  clock = summary['wallclock']
  slow, fast = clock['1gbps'], clock['100gbps']
  assert slow['seconds'] >= fast['seconds'] > 0
  assert 0 < slow['utilization'] <= fast['utilization'] <= 1


def test_streaming_peak_is_a_fragment_and_fp4_cuts_it(data_dir):
  exp = trainer_lib.get_experiment(_config(data_dir, 'streaming_diloco'))
  fp4 = trainer_lib.get_experiment(_config(
      data_dir, 'streaming_diloco', **{'outer.codec': 'fp4_e3m0',
                                       'outer.codec_kwargs': {
                                           'block_size': None}}))
  dil = trainer_lib.get_experiment(_config(
      data_dir, 'eager_diloco', **{'outer.method': 'diloco'}))
  full = dil.programs.bytes_per_step[True]
  peak = max(exp.programs.bytes_per_step[p] for p in exp.plan.phases(8))
  peak_fp4 = max(fp4.programs.bytes_per_step[p] for p in fp4.plan.phases(8))
  params = jax.eval_shape(exp.model.init, jax.random.key(0))
  frags = outer.streaming.fragment_bytes(
      params, outer.streaming.fragment_ids(params, 2))
  # The largest fragment, sent once per worker device pair (spread), per
  # worker: the compiled peak matches the byte helper.
  assert peak / WORKERS == pytest.approx(max(frags), rel=0.02)
  assert peak < 0.75 * full
  assert peak_fp4 < peak / 7


def test_noloco_sync_is_only_collective_permutes(data_dir):
  exp = trainer_lib.get_experiment(_config(data_dir, 'noloco'))
  for phase in exp.plan.phases(8):
    if not exp.plan.is_sync(phase):
      continue
    exp.programs.steps[phase]  # compiled on first use
    kinds = {kind for kind, _ in exp.programs.steps.transfers[phase]}
    assert kinds == {'collective-permute'}, kinds
    per_worker = exp.programs.bytes_per_step[phase] / WORKERS
    assert per_worker == pytest.approx(2 * _fp32_params_bytes(exp), rel=0.02)


@pytest.mark.parametrize('method, field', [
    ('streaming_diloco', 'outer.streaming'),
    ('noloco', 'outer.noloco'),
    ('desloc', 'outer.desloc'),
])
def test_bad_family_fields_name_the_section(data_dir, method, field):
  bad = {
      'streaming_diloco': {'outer.streaming.num_fragments': 3},  # 4 % 3
      'noloco': {'outer.noloco.group_size': 3},  # 4 % 3
      'desloc': {'outer.desloc.mu_sync_every': -2},
  }[method]
  with pytest.raises(ValueError, match=field.replace('.', r'\.')):
    train.validate_config(_config(data_dir, method, **bad), 8)


def test_mt_dao_needs_its_optimizer(data_dir):
  config = _config(data_dir, 'mt_dao', **{'optimizer.name': 'adamw'})
  with pytest.raises(ValueError, match='optimizer.name'):
    train.validate_config(config, 8)


def test_fixed_plan_methods_refuse_a_sync_schedule(data_dir):
  config = _config(data_dir, 'noloco', **{'outer.sync_schedule': 'qsr',
                                          'outer.sync_schedule_kwargs': {
                                              'alpha': 0.01}})
  with pytest.raises(ValueError, match='outer.sync_schedule'):
    train.validate_config(config, 8)


def test_resumed_plan_run_equals_uninterrupted(data_dir, tmp_path):
  config = _config(data_dir, 'streaming_diloco', checkpoint_every=2)
  full = train.train_and_evaluate(config, tmp_path / 'full')
  config.halt_after_steps = 5  # last checkpoint at step 4
  part = train.train_and_evaluate(config, tmp_path / 'resumed')
  assert not part['finished']
  config.halt_after_steps = 0
  resumed = train.train_and_evaluate(config, tmp_path / 'resumed')
  for a, b in zip(jax.tree.leaves(full['state']),
                  jax.tree.leaves(resumed['state'])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for key in ('final_eval_loss', 'cross_worker_bytes', 'syncs'):
    assert full[key] == resumed[key], key


def test_stragglers_slow_synchronous_methods_only(data_dir):
  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  from loc_opt.train import simulated_time  # pylint: disable=g-import-not-at-top
  sync = trainer_lib.get_experiment(_config(
      data_dir, 'eager_diloco', **{'outer.method': 'diloco'}))
  asynchronous = trainer_lib.get_experiment(_config(data_dir,
                                                    'async_local_sgd'))
  link = parallel.Link(100.0)
  for exp, factor in ((sync, 2.0), (asynchronous, 1.0)):
    even = simulated_time.simulate_run(exp, link, step_time_s=1.0,
                                       speeds=(1.0,) * WORKERS)
    slow = simulated_time.simulate_run(exp, link, step_time_s=1.0,
                                       speeds=(1.0, 1.0, 1.0, 0.5))
    assert slow.compute_s == pytest.approx(factor * even.compute_s)
    assert slow.ideal_s == even.ideal_s == exp.config.num_steps


@pytest.mark.parametrize('field, value', [
    ('wallclock.worker_speeds', (1.0, 0.5)),  # 2 speeds for 4 workers
    ('wallclock.worker_speeds', (0.5, 0.5, 0.5, 0.5)),  # no fastest at 1
    ('wallclock.step_time_s', 0.0),
    ('wallclock.bandwidths_gbps', (1.0, -2.0)),
])
def test_bad_wallclock_fields_are_named(data_dir, field, value):
  config = _config(data_dir, 'noloco', **{field: value})
  with pytest.raises(ValueError, match=field.replace('.', r'\.')):
    train.validate_config(config, 8)
