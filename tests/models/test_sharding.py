"""Tests for logical axis rules, activation constraints and tensor parallelism
of the Transformer LM (8 virtual CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loc_opt import models
from loc_opt.models import sharding

P = jax.P
AXES = ('worker', 'data', 'fsdp', 'tensor')
# 4 heads, d_ff 64 and vocab 256 divide by tensor = 4.
TINY = models.TransformerConfig(
    d_model=32, num_layers=2, num_heads=4, d_ff=64, max_len=32
)


def _mesh(shape):
  return jax.make_mesh(shape, AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * 4)


def test_logical_to_spec_skips_taken_and_missing_axes():
  rules = sharding.DEFAULT_RULES
  assert sharding.logical_to_spec(('embed', 'mlp'), rules) == P(
      'fsdp', 'tensor')
  # 'batch' takes fsdp first, so the activation's embed stays whole.
  assert sharding.logical_to_spec(
      ('batch', 'length', 'embed'), rules, ('data', 'fsdp', 'tensor')
  ) == P(('data', 'fsdp'), None, None)
  assert sharding.logical_to_spec(('batch', 'vocab'), rules,
                                  ('worker', 'fsdp')) == P(('worker', 'fsdp'),
                                                           None)
  assert sharding.logical_to_spec((None, 'kv'), rules) == P(None, None)
  with pytest.raises(KeyError, match='no rule'):
    sharding.logical_to_spec(('nope',), rules)


def test_normalize_rules_accepts_mappings_and_rejects_bad_tables():
  rules = sharding.normalize_rules({'batch': 'data', 'embed': None,
                                    'mlp': ['tensor', 'fsdp']})
  assert rules == (('batch', ('data',)), ('embed', ()),
                   ('mlp', ('tensor', 'fsdp')))
  assert sharding.normalize_rules(None) == sharding.DEFAULT_RULES
  with pytest.raises(ValueError):
    sharding.normalize_rules([('batch', 'data'), ('batch', 'fsdp')])
  with pytest.raises(ValueError):
    sharding.normalize_rules([('batch',)])
  with pytest.raises(ValueError, match='axis_rules'):
    models.TransformerConfig(axis_rules=[('batch', 3)])


def test_param_specs_follow_the_rules():
  model = models.build_transformer(TINY)
  assert model.specs['embed']['embedding'] == P('tensor', 'fsdp')
  assert model.specs['head']['kernel'] == P('fsdp', 'tensor')
  assert model.specs['layer_1']['attn']['out']['kernel'] == P(
      'tensor', 'fsdp')
  # One table changes the layout: no tensor parallelism for the MLP.
  rules = dict(sharding.DEFAULT_RULES, mlp=())
  other = models.build_transformer(
      models.TransformerConfig(**{**vars(TINY), 'axis_rules': rules}))
  assert other.specs['layer_0']['mlp']['up']['kernel'] == P('fsdp', None)


def test_constrain_is_a_no_op_without_a_mesh():
  x = jnp.ones((4, 8, 32))
  out = jax.jit(lambda x: sharding.constrain(
      x, ('batch', 'length', 'embed'), sharding.DEFAULT_RULES))(x)
  np.testing.assert_array_equal(out, x)
  with pytest.raises(ValueError, match='logical spec'):
    sharding.constrain(x, ('batch',), sharding.DEFAULT_RULES)


def test_cross_entropy_equals_optax():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(4, 16, 256)) * 3, jnp.float32)
  targets = jnp.asarray(rng.integers(0, 256, (4, 16)), jnp.int32)
  reference = optax.softmax_cross_entropy_with_integer_labels
  loss = lambda f, t=targets: jax.jit(lambda z: f(z, t).mean())
  # The same formula, but XLA fuses the two programs' reductions
  # differently: equal to float32 rounding (bit for bit on some CPUs).
  want = loss(reference)(logits)
  np.testing.assert_allclose(loss(models.core.cross_entropy)(logits), want,
                             rtol=1e-6)
  grad = jax.jit(jax.grad(loss(reference)))(logits)
  np.testing.assert_allclose(
      jax.jit(jax.grad(loss(models.core.cross_entropy)))(logits), grad,
      rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(grad))))
  # Other targets give another loss: the check bites.
  other = loss(models.core.cross_entropy, (targets + 1) % 256)(logits)
  assert abs(float(other) - float(want)) > 1e-3


def _loss(model):
  def loss_fn(params, tokens):
    return models.lm_loss(model.apply(params, tokens[:, :-1]), tokens[:, 1:])
  return jax.value_and_grad(loss_fn)


def _per_worker_step(model, mesh):
  """value_and_grad per worker, in a shard_map manual over 'worker'."""
  specs = models.resolve_specs(model.specs, mesh)
  shardings = jax.tree.map(lambda s: jax.NamedSharding(mesh, P('worker', *s)),
                           specs, is_leaf=lambda x: isinstance(x, P))
  run = jax.shard_map(jax.vmap(_loss(model)), mesh=mesh,
                      in_specs=(P('worker'), P('worker')),
                      out_specs=P('worker'), axis_names={'worker'})
  batch = jax.NamedSharding(mesh, P('worker', ('data', 'fsdp')))
  return jax.jit(run, in_shardings=(shardings, batch)), shardings, batch


@pytest.mark.parametrize('shape, scan', [((2, 1, 2, 2), False),
                                         ((2, 1, 1, 4), False),
                                         ((1, 2, 1, 4), False),
                                         ((2, 1, 2, 2), True)])
def test_tensor_parallel_matches_unsharded(shape, scan):
  """tensor = 2 and 4 compile (no SPMD partitioner abort) and give the
  unsharded model's loss and gradients (blocks unrolled or scanned)."""
  model = models.build_transformer(
      models.TransformerConfig(**{**vars(TINY), 'scan_layers': scan}))
  mesh = _mesh(shape)
  workers = shape[0]
  params = [jax.jit(model.init)(jax.random.key(s)) for s in range(workers)]
  stacked = jax.tree.map(lambda *xs: np.stack(xs), *jax.device_get(params))
  tokens = np.random.default_rng(1).integers(
      0, 256, (workers, 4, 17), dtype=np.int32)
  step, shardings, batch = _per_worker_step(model, mesh)
  loss, grads = jax.device_get(step(jax.device_put(stacked, shardings),
                                    jax.device_put(tokens, batch)))
  block = shardings['layers' if scan else 'layer_0']
  kernel = block['mlp']['up']['kernel']
  shape_of = (workers, 2, 32, 64) if scan else (workers, 32, 64)
  assert kernel.shard_shape(shape_of)[-1] == 64 // shape[3]
  reference = jax.jit(_loss(model))
  for i in range(workers):
    ref_loss, ref_grads = reference(params[i], tokens[i])
    np.testing.assert_allclose(loss[i], ref_loss, rtol=1e-5)
    jax.tree.map(lambda g, r, i=i: np.testing.assert_allclose(
        g[i], r, rtol=1e-4, atol=1e-6), grads, ref_grads)
