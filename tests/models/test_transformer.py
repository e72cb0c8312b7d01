"""Tests for the Transformer LM and its functional interface."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loc_opt import models
from loc_opt.models import transformer as tfm

TINY = models.TransformerConfig(
    d_model=32, num_layers=2, num_heads=4, d_ff=64, max_len=32
)


SHAPE = (4, 16)  # One token shape everywhere: one compilation of apply.


@pytest.fixture(scope='module')
def model():
  return models.build_transformer(TINY)


@pytest.fixture(scope='module')
def init(model):
  return jax.jit(model.init)


@pytest.fixture(scope='module')
def apply(model):
  return jax.jit(model.apply)


@pytest.fixture(scope='module')
def params(init):
  return init(jax.random.key(0))


def _tokens(seed, shape=SHAPE):
  # NumPy, not jax.random: no per-shape compilation of the PRNG.
  return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.int32)


def _next_token_loss(model):
  def loss_fn(params, tokens):
    logits = model.apply(params, tokens[:, :-1])
    return models.lm_loss(logits, tokens[:, 1:])

  return loss_fn


@pytest.fixture(scope='module')
def loss_and_grad(model):
  """Jitted ``(params, tokens [4, 17]) -> (loss, grads)``, shared by tests."""
  return jax.jit(jax.value_and_grad(_next_token_loss(model)))


def test_logits_shape_and_dtype(apply, params):
  logits = apply(params, _tokens(1))
  assert logits.shape == (4, 16, 256)
  assert logits.dtype == jnp.float32
  assert np.all(np.isfinite(logits))


def test_default_config_structure_and_count():
  model = models.build_transformer(models.TransformerConfig())
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  d, f, v, layers = 128, 512, 256, 2
  per_layer = 4 * d * d + 2 * d * f + 2 * d
  assert model.num_params == 2 * v * d + layers * per_layer + d == 459_392
  assert sorted(shapes) == [
      'embed', 'final_norm', 'head', 'layer_0', 'layer_1'
  ]
  block = jax.tree.map(lambda x: x.shape, shapes['layer_1'])
  assert block == {
      'attn_norm': {'scale': (d,)},
      'attn': {
          'query': {'kernel': (d, d)},
          'key': {'kernel': (d, d)},
          'value': {'kernel': (d, d)},
          'out': {'kernel': (d, d)},
      },
      'mlp_norm': {'scale': (d,)},
      'mlp': {'up': {'kernel': (d, f)}, 'down': {'kernel': (f, d)}},
  }
  assert shapes['embed']['embedding'].shape == (v, d)
  assert shapes['head']['kernel'].shape == (d, v)


def test_params_are_pure_dict_matching_specs(model, params):
  def check_node(node):
    assert type(node) is dict, type(node)
    for key, child in node.items():
      assert isinstance(key, str)
      if isinstance(child, dict):
        check_node(child)
      else:
        assert isinstance(child, jax.Array)
        assert not hasattr(child, 'get_value')

  check_node(params)
  assert jax.tree.structure(params) == jax.tree.structure(model.specs)
  leaves = zip(jax.tree.leaves(params), jax.tree.leaves(model.specs))
  for param, spec in leaves:
    assert isinstance(spec, jax.P)
    assert len(spec) == param.ndim
    assert set(spec) <= {'fsdp', 'tensor', None}
  assert model.specs['layer_0']['attn']['query']['kernel'] == jax.P(
      'fsdp', 'tensor'
  )
  assert model.specs['layer_0']['mlp']['down']['kernel'] == jax.P(
      'tensor', 'fsdp'
  )
  assert model.specs['final_norm']['scale'] == jax.P(None)
  assert model.num_params == sum(x.size for x in jax.tree.leaves(params))


def test_init_is_deterministic_and_depends_on_key(init, params):
  again = init(jax.random.key(0))
  other = init(jax.random.key(1))
  jax.tree.map(np.testing.assert_array_equal, params, again)
  assert not np.allclose(
      params['head']['kernel'], other['head']['kernel']
  )


def test_causal(apply, params):
  tokens = _tokens(2)
  base = apply(params, tokens)
  for t in (0, 5, 10):
    changed = tokens.copy()
    changed[:, t + 1] = (tokens[:, t + 1] + 1) % 256
    logits = apply(params, changed)
    np.testing.assert_allclose(
        logits[:, : t + 1], base[:, : t + 1], rtol=1e-6, atol=1e-6
    )
    # The change must be visible from position t + 1 on.
    assert np.abs(logits[:, t + 1] - base[:, t + 1]).max() > 1e-3


def test_initial_loss_near_log_vocab(apply, params):
  tokens = _tokens(3, (2, *SHAPE))
  logits = jnp.concatenate([apply(params, t) for t in tokens])
  tokens = tokens.reshape(-1, SHAPE[1])
  loss = models.lm_loss(logits[:, :-1], tokens[:, 1:])
  assert abs(float(loss) - math.log(256)) < 0.1


def test_adam_reduces_loss_on_fixed_batch(params, loss_and_grad):
  tokens = _tokens(4, (4, 17))  # inputs [4, 16]
  tx = optax.adam(3e-3)
  update = jax.jit(tx.update)
  p, opt_state = params, tx.init(params)
  losses = []
  for _ in range(15):
    loss, grads = loss_and_grad(p, tokens)
    updates, opt_state = update(grads, opt_state, p)
    p = optax.apply_updates(p, updates)
    losses.append(float(loss))
  assert losses[-1] < losses[0] - 1.0, losses


def _stack(init, seeds):
  """Parameters for each seed, and all of them stacked (as NumPy arrays)."""
  members = jax.device_get([init(jax.random.key(s)) for s in seeds])
  return jax.tree.map(lambda *xs: np.stack(xs), *members), members


def test_vmap_over_stacked_params(model, init, apply):
  stacked, members = _stack(init, (5, 6))
  tokens = _tokens(6, (2, *SHAPE))
  out = jax.jit(jax.vmap(model.apply))(stacked, tokens)
  assert out.shape == (2, *SHAPE, 256)
  for i in range(2):
    np.testing.assert_allclose(
        out[i], apply(members[i], tokens[i]), rtol=1e-5, atol=1e-5
    )
  # Each member used its own parameters.
  assert not np.allclose(out[0], apply(members[1], tokens[0]), atol=1e-3)


def test_bfloat16_activations_give_float32_logits(apply, params):
  config = dataclasses.replace(TINY, dtype='bfloat16')
  assert config.dtype == jnp.bfloat16
  model = models.build_transformer(config)
  # Same parameters (param_dtype stays float32), bfloat16 compute.
  abstract = jax.eval_shape(model.init, jax.random.key(0))
  signature = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
  assert signature(params) == signature(abstract)
  tokens = _tokens(7)
  logits = jax.jit(model.apply)(params, tokens)
  assert logits.dtype == jnp.float32
  reference = apply(params, tokens)
  np.testing.assert_allclose(logits, reference, atol=0.05)
  assert not np.array_equal(logits, reference)


@jax.jit
def _rope_scores(q, k):
  sin, cos = tfm.rope_tables(12, q.shape[-1])
  q_all = tfm.apply_rope(jnp.tile(q, (1, 12, 1, 1)), sin, cos)
  k_all = tfm.apply_rope(jnp.tile(k, (1, 12, 1, 1)), sin, cos)
  return jnp.einsum('bqhd,bkhd->qk', q_all, k_all), q_all


def test_rope_scores_depend_on_relative_position_only():
  q, k = np.random.default_rng(0).normal(size=(2, 1, 1, 1, 8))
  scores, q_all = _rope_scores(q, k)
  # Same offset, same score; position 0 is the identity rotation.
  np.testing.assert_allclose(scores[3, 1], scores[10, 8], rtol=1e-4)
  np.testing.assert_allclose(scores[5, 5], scores[0, 0], rtol=1e-4)
  np.testing.assert_allclose(q_all[0, 0], q[0, 0], rtol=1e-6)
  assert not np.allclose(scores[3, 1], scores[3, 2])


def test_too_long_or_non_integer_inputs_raise(model, params):
  with pytest.raises(ValueError, match='max_len'):
    model.apply(params, jnp.zeros((1, 33), jnp.int32))
  with pytest.raises(ValueError, match='integers'):
    model.apply(params, jnp.zeros((1, 4), jnp.float32))


def test_wrong_params_structure_raises(model, params):
  bad = dict(params)
  bad.pop('head')
  with pytest.raises(ValueError, match='structure'):
    model.apply(bad, jnp.zeros((1, 4), jnp.int32))


@pytest.mark.parametrize(
    'shape, names',
    [((4, 2), ('worker', 'fsdp')), ((2, 2, 2), ('worker', 'fsdp', 'tensor'))],
)
def test_sharded_in_shard_map_matches_single_device(
    model, init, loss_and_grad, shape, names
):
  """Forward + grad inside a shard_map manual over 'worker' only, with the
  model sharded over the remaining (auto) axes, equals the unsharded run."""
  workers = shape[0]
  mesh = jax.make_mesh(
      shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape)
  )
  stacked, members = _stack(init, range(10, 10 + workers))
  tokens = _tokens(8, (workers, 4, 17))

  specs = models.resolve_specs(model.specs, mesh.axis_names)
  shardings = jax.tree.map(
      lambda s: jax.NamedSharding(mesh, jax.P('worker', *s)),
      specs,
      is_leaf=lambda x: isinstance(x, jax.P),
  )
  params = jax.device_put(stacked, shardings)
  sharded_tokens = jax.device_put(
      tokens, jax.NamedSharding(mesh, jax.P('worker'))
  )
  kernel = params['layer_0']['attn']['query']['kernel']
  tensor = 2 if 'tensor' in names else 1
  assert kernel.sharding.shard_shape(kernel.shape) == (
      1, TINY.d_model // 2, TINY.d_model // tensor
  )
  per_worker = jax.vmap(jax.value_and_grad(_next_token_loss(model)))
  step = jax.jit(
      jax.shard_map(
          per_worker,
          mesh=mesh,
          in_specs=(jax.P('worker'), jax.P('worker')),
          out_specs=jax.P('worker'),
          axis_names={'worker'},
      )
  )
  loss, grads = jax.device_get(step(params, sharded_tokens))
  for i in range(workers):
    ref_loss, ref_grads = loss_and_grad(members[i], tokens[i])
    np.testing.assert_allclose(loss[i], ref_loss, rtol=1e-5, atol=1e-6)
    jax.tree.map(
        lambda g, ref, i=i: np.testing.assert_allclose(
            g[i], ref, rtol=1e-4, atol=1e-6
        ),
        grads,
        ref_grads,
    )
  # Workers had different parameters, so their losses differ.
  assert len(set(np.asarray(loss).round(6).tolist())) == workers


@pytest.mark.parametrize('attention', ['xla', 'auto'])
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_dot_product_attention_matches_einsum(params, attention, dtype):
  """jax.nn.dot_product_attention gives the explicit formula's logits and
  gradients (up to rounding: it scales by 1/sqrt(Dh) instead of dividing)."""
  tokens = _tokens(9, (4, 17))
  results = []
  for impl in ('einsum', attention):
    config = dataclasses.replace(TINY, dtype=dtype, attention=impl)
    model = models.build_transformer(config)
    results.append(jax.jit(jax.value_and_grad(_next_token_loss(model)))(
        params, tokens))
  (loss, grads), (ref_loss, ref_grads) = results
  tol = 1e-5 if dtype == 'float32' else 2e-2
  np.testing.assert_allclose(loss, ref_loss, rtol=tol)
  jax.tree.map(lambda g, r: np.testing.assert_allclose(
      g, r, rtol=10 * tol, atol=10 * tol * np.abs(r).max()), grads, ref_grads)


def test_unknown_attention_raises():
  with pytest.raises(ValueError, match='model.attention'):
    models.TransformerConfig(attention='flash')
