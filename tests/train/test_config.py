"""Shared config fields to library objects (loc_opt.train.config), and the
one-source rule for the defaults of the shared fields."""

import pytest

from configs import diloco_lm
from configs import dp_lm
from loc_opt import compression
from loc_opt import models
from loc_opt import outer
from loc_opt import train
from loc_opt.train import config as cfg_lib
from loc_opt.train import registry
from loc_opt.train import spikes
from tests.train._helpers import tiny_config


def _check_defaults(calls):
  for fn, kwargs in calls.items():
    for arg, value in kwargs.items():
      want = registry.library_default(fn, arg)
      assert value == want, (fn.__name__, arg, value, want)


def test_outer_optimizer_defaults_are_diloco_s(data_dir):
  # outer.learning_rate / momentum: DiLoCo's Nesterov outer optimizer.
  config = tiny_config(data_dir)
  _check_defaults({outer.nesterov_outer: {
      'learning_rate': config.outer.learning_rate,
      'momentum': config.outer.momentum}})
  assert config.outer.nesterov


def test_compressor_defaults_are_the_library_defaults(data_dir):
  kwargs = cfg_lib.compressor_kwargs(tiny_config(data_dir))
  assert set(kwargs) == {'error_feedback', 'econtrol_eta', 'ef_decay'}
  _check_defaults({compression.build_compressor: kwargs})


def test_spike_defaults_are_the_library_defaults(data_dir):
  calls = spikes.spike_kwargs(tiny_config(data_dir).optimizer)
  assert set(calls[spikes.spike_steps]) == {'seed', 'window'}
  assert set(calls[spikes.inject_gradient_spikes]) == {'scale'}
  _check_defaults(calls)


def test_absent_fields_take_the_library_defaults(data_dir):
  config = tiny_config(data_dir)
  for field in ('error_feedback', 'econtrol_eta', 'ef_decay'):
    del config.outer[field]
  assert cfg_lib.compressor_kwargs(config) == {}
  optimizer = config.optimizer
  for field in ('spike_seed', 'spike_window', 'spike_scale'):
    del optimizer[field]
  optimizer.spike_num = 2
  transform, steps = spikes.spikes_from_config(optimizer, 100)
  assert transform is not None
  assert steps == spikes.spike_steps(100, 2)


@pytest.mark.parametrize('field, value', [
    ('optimizer.spike_scale', -1.0),
    ('optimizer.spike_seed', -1),
    ('optimizer.spike_window', (0.1, 0.5, 0.9)),
])
def test_bad_spike_fields_are_named(data_dir, field, value):
  config = tiny_config(data_dir, **{field: value, 'optimizer.spike_num': 2})
  with pytest.raises(ValueError, match=field.replace('.', r'\.')):
    spikes.spikes_from_config(config.optimizer, 100)


def test_with_overrides_copies_and_sets_dotted_fields(data_dir):
  config = tiny_config(data_dir)
  other = cfg_lib.with_overrides(config, {'outer__sync_every': 9,
                                          'mesh__workers': 2}, sep='__')
  assert (other.outer.sync_every, other.mesh.workers) == (9, 2)
  assert (config.outer.sync_every, config.mesh.workers) == (4, 4)


def test_compress_skip_and_ef_decay_reach_the_compressor(data_dir):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  config = tiny_config(data_dir, **{
      'outer.codec': 'statistical', 'outer.codec_kwargs': {'bits': 2},
      'outer.error_feedback': 'ef', 'outer.ef_decay': 0.9,
      'outer.compress_skip': ('norm', 'embed')})
  c = cfg_lib.make_compressor(config)
  assert c.name == 'partition(ef0.9(statistical2))'
  tree = {'embed': {'embedding': jax.ShapeDtypeStruct((8, 4), jnp.float32)},
          'norm': {'scale': jax.ShapeDtypeStruct((4,), jnp.float32)},
          'mlp': {'kernel': jax.ShapeDtypeStruct((4, 8), jnp.float32)}}
  assert c.payload_bytes(tree) == 4 * (32 + 4) + (4 * 2 + 4 * 4 * 5)
  with pytest.raises(ValueError, match='compress_skip'):
    cfg_lib.make_compressor(tiny_config(data_dir, **{
        'outer.codec': 'int8', 'outer.compress_skip': ('norm', 3)}))


def test_config_argument_picks_the_model():
  # --config=configs/<file>.py:mlp: the MLP's section, a valid config, and
  # Streaming DiLoCo's fragments by size (the MLP has no numbered blocks).
  for module in (diloco_lm, dp_lm):
    assert module.get_config().model.name == 'transformer'
    config = module.get_config('mlp')
    assert config.model.name == 'mlp'
    assert config.outer.streaming_diloco.pattern == 'balanced'
    train.validate_config(config, 8)
    assert isinstance(models.build_model(config.model).num_params, int)
  with pytest.raises(ValueError, match="'mpl' is not a model"):
    diloco_lm.get_config('mpl')
