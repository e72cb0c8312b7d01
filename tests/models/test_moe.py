"""The Mixture-of-Experts MLP against a dense loop over experts."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loc_opt import models
from loc_opt.models import moe as moe_lib

D, F, GROUPS, S = 16, 24, 3, 8


def _config(**moe):
  return models.TransformerConfig(d_model=D, d_ff=F, num_heads=2,
                                  num_layers=2, max_len=16, moe=moe)


def _gelu(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _reference(x, router, up, down, top_k, slots):
  """Token by token: the k largest router probabilities, first choices of
  every token before second choices, each expert taking at most ``slots``
  assignments per group in token order; gates as the module docstring
  says. Float64 NumPy."""
  x, router, up, down = (np.asarray(a, np.float64)
                         for a in (x, router, up, down))
  groups, length, _ = x.shape
  experts = router.shape[1]
  out = np.zeros_like(x)
  dropped = 0
  for g in range(groups):
    logits = x[g] @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1, kind='stable')[:, :top_k]
    chosen = np.take_along_axis(probs, order, -1)
    gates = chosen if top_k == 1 else chosen / chosen.sum(-1, keepdims=True)
    taken = np.zeros(experts, int)
    for j in range(top_k):
      for s in range(length):
        e = order[s, j]
        if taken[e] >= slots:
          dropped += 1
          continue
        taken[e] += 1
        out[g, s] += gates[s, j] * (_gelu(x[g, s] @ up[e]) @ down[e])
  return out, dropped / (groups * length * top_k)


@pytest.mark.parametrize('top_k, factor, experts', [
    (1, 1.0, 4),  # Switch routing, tokens dropped
    (2, 1.0, 4),  # top-2, tokens dropped
    (2, 0.0, 3),  # top-2, no capacity limit
    (1, 0.0, 1),  # one expert: a dense MLP
])
def test_moe_mlp_equals_a_dense_loop_over_experts(top_k, factor, experts):
  config = _config(num_experts=experts, top_k=top_k, capacity_factor=factor)
  with nnx.use_eager_sharding(False):
    layer = moe_lib.MoeMLP(config, rngs=nnx.Rngs(params=1))
  # A router large enough that tokens disagree on their experts.
  layer.router.kernel[...] = 3.0 * jax.random.normal(jax.random.key(2),
                                                     (D, experts))
  x = jax.random.normal(jax.random.key(3), (GROUPS, S, D))
  y, stats = layer(x)
  slots = moe_lib.capacity(config.moe, S)
  want, dropped = _reference(x, layer.router.kernel[...], layer.up[...],
                             layer.down[...], top_k, slots)
  np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(stats['dropped'], dropped, atol=1e-6)
  if factor == 1.0:
    assert dropped > 0  # the capacity binds in these cases
  if factor == 0.0:
    assert dropped == 0
  np.testing.assert_allclose(jnp.sum(stats['load']), 1.0, rtol=1e-6)


def test_route_statistics_by_hand():
  """Two groups of two tokens, two experts: loads, drops (one slot per
  expert), entropy, load-balancing and z losses from their formulas."""
  logits = jnp.array([[[2.0, 0.0], [1.0, 0.0]], [[0.0, 3.0], [0.0, 1.0]]])
  dispatch, combine, stats = moe_lib.route(logits, top_k=1, slots=1)
  # Each group sends both tokens to one expert: the second is dropped.
  np.testing.assert_array_equal(dispatch[0, :, 0, 0], [1.0, 0.0])
  np.testing.assert_array_equal(dispatch[1, :, 1, 0], [1.0, 0.0])
  np.testing.assert_allclose(stats['dropped'], 0.5)
  np.testing.assert_allclose(stats['load'], [0.5, 0.5])
  probs = jax.nn.softmax(logits)
  np.testing.assert_allclose(combine[0, 0, 0, 0], probs[0, 0, 0], rtol=1e-6)
  np.testing.assert_allclose(
      stats['balance_loss'], 2 * np.sum(np.array([0.5, 0.5]) * probs.mean((0, 1))),
      rtol=1e-6)
  np.testing.assert_allclose(
      stats['entropy'], -np.mean(np.sum(probs * np.log(probs), -1)),
      rtol=1e-6)
  np.testing.assert_allclose(
      stats['z_loss'], np.mean(jax.nn.logsumexp(logits, -1) ** 2), rtol=1e-6)


def test_one_expert_moe_lm_equals_the_dense_lm():
  """E = 1, top-1, no capacity limit: the gate is 1 and the MoE LM is the
  dense LM with the expert's kernels; the shared expert adds a dense MLP."""
  tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 256)
  dense = models.build_transformer(_config())
  moe = models.build_transformer(_config(num_experts=1, capacity_factor=0.0))
  params = moe.init(jax.random.key(0))
  as_dense = dense.init(jax.random.key(0))
  for i in range(2):
    mlp = params[f'layer_{i}']['mlp']
    as_dense[f'layer_{i}'] = dict(params[f'layer_{i}'], mlp={
        'up': {'kernel': mlp['up'][0]}, 'down': {'kernel': mlp['down'][0]}})
  for key in ('embed', 'final_norm', 'head'):
    as_dense[key] = params[key]
  logits, aux = moe.apply_aux(params, tokens)
  np.testing.assert_allclose(logits, dense.apply(as_dense, tokens),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(aux['dropped'], 0.0)
  np.testing.assert_allclose(aux['balance_loss'], 1.0, rtol=1e-6)
  np.testing.assert_allclose(
      aux['aux_loss'],
      np.sum(0.01 * aux['balance_loss'] + 0.001 * aux['z_loss']), rtol=1e-6)
  assert dense.apply_aux is None


def test_scanned_moe_lm_equals_the_unrolled_one():
  config = dict(num_experts=4, top_k=2)
  unrolled = models.build_transformer(_config(**config))
  scanned = models.build_transformer(models.TransformerConfig(
      **{**vars(_config(**config)), 'scan_layers': True}))
  params = unrolled.init(jax.random.key(0))
  stacked = scanned.init(jax.random.key(0))
  layers = [params[f'layer_{i}'] for i in range(2)]
  stacked['layers'] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 256)
  a, aux_a = unrolled.apply_aux(params, tokens)
  b, aux_b = scanned.apply_aux(stacked, tokens)
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(aux_a['load'], aux_b['load'], atol=1e-6)
  assert aux_b['load'].shape == (2, 4)


def test_expert_kernels_are_sharded_over_the_expert_axis():
  specs = models.build_transformer(_config(num_experts=4)).specs
  mlp = specs['layer_0']['mlp']
  assert mlp['up'] == jax.P('fsdp', None, 'tensor')
  assert mlp['down'] == jax.P('fsdp', 'tensor', None)
  assert mlp['router']['kernel'] == jax.P('fsdp', None)


@pytest.mark.parametrize('moe, match', [
    ({'num_experts': -1}, 'num_experts'),
    ({'num_experts': 4, 'top_k': 3}, 'top_k must be 1 or 2'),
    ({'num_experts': 1, 'top_k': 2}, 'exceeds'),
    ({'num_experts': 4, 'balance_loss': -1.0}, 'balance_loss'),
    ({'num_experts': 4, 'shared_expert': 1}, 'shared_expert'),
    ({'experts': 4}, r'model.moe.experts is not a field'),
    ({'num_experts': 4, 'dispatch': 'gather'}, 'dispatch must be one of'),
])
def test_bad_moe_settings_name_the_field(moe, match):
  with pytest.raises(ValueError, match=match):
    _config(**moe)
