"""Tests for build_model, resolve_specs and lm_loss."""

import math

from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from loc_opt import models


def _config(**fields):
  return ml_collections.ConfigDict(fields)


def test_build_model_from_config_dict():
  model = models.build_model(
      _config(
          name='transformer', vocab_size=64, d_model=16, num_layers=1,
          num_heads=2, d_ff=32, max_len=8, dtype='bfloat16',
          param_dtype='float32',
      )
  )
  assert isinstance(model, models.Model)
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  assert shapes['embed']['embedding'].shape == (64, 16)
  assert shapes['layer_0']['mlp']['up']['kernel'].shape == (16, 32)
  assert sorted(k for k in shapes if k.startswith('layer_')) == ['layer_0']
  assert model.num_params == sum(
      math.prod(x.shape) for x in jax.tree.leaves(shapes)
  )
  tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
  out = jax.eval_shape(model.apply, shapes, tokens)
  assert out.shape == (2, 8, 64) and out.dtype == jnp.float32


def test_missing_fields_take_defaults():
  model = models.build_model(_config(name='transformer'))
  assert model.num_params == 459_392
  mlp = models.build_model({'name': 'mlp', 'in_dim': 3, 'out_dim': 2})
  assert mlp.num_params == 3 * 128 + 128 + 128 * 2 + 2


def test_unknown_name_lists_valid_names():
  with pytest.raises(ValueError, match='model.name') as info:
    models.build_model(_config(name='resnet'))
  assert "'mlp'" in str(info.value) and "'transformer'" in str(info.value)
  with pytest.raises(ValueError, match='model.name'):
    models.build_model(_config(d_model=8))


def test_unknown_field_is_named():
  with pytest.raises(ValueError, match='model.d_modle'):
    models.build_model(_config(name='transformer', d_modle=64))


@pytest.mark.parametrize(
    'fields, field',
    [
        ({'d_model': 30, 'num_heads': 4}, 'model.d_model'),
        ({'d_model': 12, 'num_heads': 4}, 'model.d_model // model.num_heads'),
        ({'num_layers': 0}, 'model.num_layers'),
        ({'vocab_size': -1}, 'model.vocab_size'),
        ({'d_ff': 2.5}, 'model.d_ff'),
        ({'max_len': True}, 'model.max_len'),
        ({'dtype': 'float31'}, 'model.dtype'),
        ({'param_dtype': 'int32'}, 'model.param_dtype'),
    ],
)
def test_invalid_transformer_config(fields, field):
  with pytest.raises(ValueError) as info:
    models.build_model(_config(name='transformer', **fields))
  assert field in str(info.value)


@pytest.mark.parametrize(
    'fields, field',
    [
        ({'hidden': 0}, 'model.hidden'),
        ({'num_layers': 0}, 'model.num_layers'),
        ({'dtype': 'complex64'}, 'model.dtype'),
    ],
)
def test_invalid_mlp_config(fields, field):
  with pytest.raises(ValueError, match=field):
    models.build_model(_config(name='mlp', **fields))


def test_dataclass_configs_normalize_dtypes():
  config = models.TransformerConfig(dtype='bfloat16', param_dtype=jnp.float32)
  assert config.dtype == jnp.bfloat16 and config.param_dtype == jnp.float32
  assert models.MLPConfig(dtype='float32').dtype == jnp.float32


def test_resolve_specs_drops_unknown_axes():
  specs = {
      'a': jax.P('fsdp', 'tensor'),
      'b': {'c': jax.P(None), 'd': jax.P(('fsdp', 'tensor'), None)},
      'e': jax.P('tensor', 'fsdp'),
  }
  resolved = models.resolve_specs(specs, ('worker', 'fsdp'))
  assert resolved == {
      'a': jax.P('fsdp', None),
      'b': {'c': jax.P(None), 'd': jax.P('fsdp', None)},
      'e': jax.P(None, 'fsdp'),
  }
  assert models.resolve_specs(specs, ('fsdp', 'tensor')) == specs
  assert models.resolve_specs(specs, ()) == {
      'a': jax.P(None, None),
      'b': {'c': jax.P(None), 'd': jax.P(None, None)},
      'e': jax.P(None, None),
  }
  mesh = jax.make_mesh(
      (2, 4), ('worker', 'tensor'),
      axis_types=(jax.sharding.AxisType.Auto,) * 2,
  )
  assert models.resolve_specs(specs, mesh)['e'] == jax.P('tensor', None)


def test_resolved_model_specs_make_valid_shardings():
  model = models.build_model(_config(name='transformer'))
  mesh = jax.make_mesh(
      (4, 2), ('worker', 'fsdp'), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  specs = models.resolve_specs(model.specs, mesh.axis_names)
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  for spec, shape in zip(jax.tree.leaves(specs), jax.tree.leaves(shapes)):
    assert 'tensor' not in jax.tree.leaves(tuple(spec))
    sharding = jax.NamedSharding(mesh, jax.P('worker', *spec))
    sharding.shard_shape((4, *shape.shape))  # raises if incompatible


def test_lm_loss_matches_reference():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
  targets = rng.integers(0, 7, size=(2, 5))
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  nll = -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(
      models.lm_loss(logits, targets), nll.mean(), rtol=1e-6
  )
  mask = rng.random((2, 5)) < 0.5
  np.testing.assert_allclose(
      models.lm_loss(logits, targets, mask), nll[mask].mean(), rtol=1e-6
  )
  assert models.lm_loss(logits, targets, np.zeros((2, 5))) == 0.0


def test_lm_loss_uniform_logits_and_dtype():
  logits = jnp.zeros((3, 4, 256), jnp.bfloat16)
  loss = jax.jit(models.lm_loss)(logits, jnp.zeros((3, 4), jnp.int32))
  assert loss.dtype == jnp.float32
  np.testing.assert_allclose(loss, math.log(256), rtol=1e-6)


def test_lm_loss_shape_errors():
  with pytest.raises(ValueError, match='targets'):
    models.lm_loss(jnp.zeros((2, 4, 8)), jnp.zeros((2, 5), jnp.int32))
  with pytest.raises(ValueError, match='mask'):
    models.lm_loss(
        jnp.zeros((2, 4, 8)), jnp.zeros((2, 4), jnp.int32), jnp.ones((2,))
    )


def test_from_nnx_wraps_any_annotated_module():
  model = models.from_nnx(
      lambda rngs: nnx.Linear(
          3, 2,
          kernel_init=nnx.with_partitioning(
              nnx.initializers.ones_init(), ('fsdp', None)
          ),
          rngs=rngs,
      )
  )
  params = model.init(jax.random.key(0))
  assert model.specs == {'kernel': jax.P('fsdp', None), 'bias': jax.P()}
  np.testing.assert_allclose(
      model.apply(params, jnp.ones((1, 3))), [[3.0, 3.0]]
  )
