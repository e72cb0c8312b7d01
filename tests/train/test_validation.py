"""Config validation before a run writes anything (issue 12).

Every run-control field, learning rate, momentum, sync period, codec
argument and step-or-fraction schedule argument is checked by
``loc_opt.train.validate_config``, which ``train_and_evaluate`` calls before
it creates the workdir: a bad value raises a ``ValueError`` that names the
field, and nothing is written.
"""

import importlib
import math
import pathlib
import re

import pytest

from loc_opt import train
from loc_opt.train import registry
from tests.train._helpers import tiny_config

NAN, INF = math.nan, math.inf
_SCHEDULE = 'optimizer.schedule_kwargs'
_TOO_LONG = 60  # sync_every > num_steps = 12 (and a multiple of 3)

_BAD = [
    # Run control.
    ({'log_every': 0}, 'log_every'),
    ({'log_every': -2}, 'log_every'),
    ({'eval_every': -1}, 'eval_every'),
    ({'checkpoint_every': -4}, 'checkpoint_every'),
    ({'keep_checkpoints': 0}, 'keep_checkpoints'),
    ({'eval_batches': 0}, 'eval_batches'),
    ({'halt_after_steps': -1}, 'halt_after_steps'),
    # Shared learning rates and momentum.
    ({'optimizer.learning_rate': NAN}, 'optimizer.learning_rate'),
    ({'optimizer.learning_rate': -3e-3}, 'optimizer.learning_rate'),
    ({'optimizer.learning_rate': INF}, 'optimizer.learning_rate'),
    ({_SCHEDULE: {'warmup_steps': 0.1, 'end_value': -3e-4}},
     f'{_SCHEDULE}.end_value'),
    ({_SCHEDULE: {'warmup_steps': 0.1, 'end_value': NAN}},
     f'{_SCHEDULE}.end_value'),
    ({'outer.learning_rate': NAN}, 'outer.learning_rate'),
    ({'outer.learning_rate': -0.7}, 'outer.learning_rate'),
    ({'outer.momentum': 1.0}, 'outer.momentum'),
    ({'outer.momentum': -0.1}, 'outer.momentum'),
    ({'outer.momentum': NAN}, 'outer.momentum'),
    # The methods' own rates and momenta.
    ({'outer.method': 'co2', 'outer.co2.learning_rate': NAN},
     'outer.co2.learning_rate'),
    ({'outer.method': 'co2', 'outer.co2.momentum': 1.0},
     'outer.co2.momentum'),
    ({'outer.method': 'sparseloco', 'outer.sparseloco.learning_rate': -1.0},
     'outer.sparseloco.learning_rate'),
    ({'outer.method': 'sparseloco', 'outer.sparseloco.ef_decay': 1.5},
     'outer.sparseloco.ef_decay'),
    ({'outer.method': 'demo', 'outer.demo.lr_scale': NAN},
     'outer.demo.lr_scale'),
    ({'outer.method': 'demo', 'outer.demo.beta': 1.0}, 'outer.demo.beta'),
    ({'outer.method': 'noloco', 'outer.noloco.momentum': 1.0},
     'outer.noloco.momentum'),
    ({'outer.method': 'noloco', 'outer.noloco.consensus': -0.5},
     'outer.noloco.consensus'),
    # Codec arguments of the wrong type (or name).
    ({'outer.codec': 'int8', 'outer.codec_kwargs': {'block_size': 'big'}},
     'outer.codec_kwargs'),
    ({'outer.codec': 'powersgd', 'outer.codec_kwargs': {'rank': 4.0}},
     'outer.codec_kwargs'),
    ({'outer.codec': 'topk', 'outer.codec_kwargs': {'density': '1%'}},
     'outer.codec_kwargs'),
    ({'outer.codec': 'int8', 'outer.codec_kwargs': {'blocksize': 64}},
     'outer.codec_kwargs'),
    # A step count given as a float (a float is a fraction of the run).
    ({_SCHEDULE: {'warmup_steps': 30.0, 'end_value': 3e-4}},
     f'{_SCHEDULE}.warmup_steps'),
    ({_SCHEDULE: {'warmup_steps': 1.0, 'end_value': 3e-4}},
     f'{_SCHEDULE}.warmup_steps'),
    ({'optimizer.schedule': 'wsd',
      _SCHEDULE: {'warmup_steps': 2, 'decay_steps': 4.0}},
     f'{_SCHEDULE}.decay_steps'),
    ({'outer.sync_schedule': 'qsr',
      'outer.sync_schedule_kwargs': {'alpha': 0.01, 'warmup_steps': 3.0}},
     'outer.sync_schedule_kwargs.warmup_steps'),
] + [
    # A period longer than the run: the method would never sync.
    ({'outer.method': method, 'outer.sync_every': _TOO_LONG},
     'outer.sync_every')
    for method in ('diloco', 'local_sgd', 'streaming_diloco', 'eager_diloco',
                   'noloco', 'sparseloco', 'desloc', 'edit_diloco', 'co2',
                   'async_local_sgd', 'decoupled_diloco', 'hierarchical_diloco')
] + [
    # Both of group_diloco's periods longer than the run.
    ({'outer.method': 'group_diloco', 'outer.sync_every': _TOO_LONG,
      'outer.group_diloco.sync_every': _TOO_LONG}, 'outer.sync_every'),
]


def _id(case):
  overrides, _ = case
  return ','.join(f'{k}={v}' for k, v in overrides.items())


@pytest.mark.parametrize('overrides, field', _BAD, ids=map(_id, _BAD))
def test_bad_field_is_named_and_nothing_is_written(data_dir, tmp_path,
                                                    overrides, field):
  config = tiny_config(data_dir, config_schedule=True, **overrides)
  workdir = tmp_path / 'wd'
  with pytest.raises(ValueError, match=re.escape(field)):
    train.train_and_evaluate(config, workdir)
  assert not workdir.exists()


def test_every_method_with_a_period_is_covered():
  # The methods that never sync on a period: data parallel (never across
  # workers on its own), compressed data parallel and DeMo (every step).
  periodic = {overrides['outer.method'] for overrides, field in _BAD
              if field == 'outer.sync_every'}
  others = {'data_parallel', 'compressed_data_parallel', 'demo', 'mt_dao'}
  assert periodic | others == set(registry.METHODS)


_VALID = [
    {},
    {'eval_every': 0, 'checkpoint_every': 0, 'halt_after_steps': 0},
    {'log_every': 100, 'keep_checkpoints': 1, 'eval_batches': 1},
    {'optimizer.learning_rate': 0.0, 'outer.momentum': 0.0,
     'outer.learning_rate': 0.0},
    {'outer.momentum': 0.999},
    {'outer.sync_every': 12},  # = num_steps: one sync, at the end
    {_SCHEDULE: {'warmup_steps': 0.0, 'end_value': 0.0}},
    {_SCHEDULE: {'warmup_steps': 11, 'end_value': 3e-4}},
    {'optimizer.schedule': 'warmup_linear',
     _SCHEDULE: {'warmup_steps': 0.99, 'end_value': 3e-4}},
    {'optimizer.schedule': 'wsd',
     _SCHEDULE: {'warmup_steps': 0, 'decay_steps': 1.0}},
    {'outer.codec': 'int8', 'outer.codec_kwargs': {'block_size': None}},
    {'outer.codec': 'topk',
     'outer.codec_kwargs': {'density': 0.01, 'value_codec': 'two_bit'}},
    {'outer.codec': 'powersgd', 'outer.codec_kwargs': {'rank': 2}},
    {'outer.method': 'data_parallel', 'outer.sync_every': 1000},
    {'outer.method': 'compressed_data_parallel', 'outer.sync_every': 1000},
    {'outer.method': 'demo', 'outer.sync_every': 1000},
    # Streaming DiLoCo syncs its first fragment after sync_every / 3 steps.
    {'outer.method': 'streaming_diloco', 'outer.sync_every': 15},
    {'outer.method': 'sparseloco', 'outer.sparseloco.ef_decay': 1.0},
    {'outer.method': 'noloco', 'outer.noloco.consensus': None},
]


@pytest.mark.parametrize('overrides', _VALID, ids=map(str, _VALID))
def test_valid_edge_values_pass(data_dir, overrides):
  train.validate_config(
      tiny_config(data_dir, config_schedule=True, **overrides), 8)


_CONFIGS = pathlib.Path(__file__).parents[2] / 'configs'


@pytest.mark.parametrize('name', sorted(
    p.stem for p in _CONFIGS.glob('*.py') if p.stem != '__init__'))
def test_configs_validate(name):
  module = importlib.import_module(f'configs.{name}')
  train.validate_config(module.get_config(), 8)
