"""Muon on hidden matrices, AdamW on embeddings, head and norms, by path."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loc_opt import inner
from loc_opt.inner.muon_adamw import DION_NS_COEFFS
from loc_opt.inner.muon_adamw import muon_adamw_labels


def _lm_params():
  return {
      'embed': {'embedding': jnp.ones((32, 8))},
      'final_norm': {'scale': jnp.ones((8,))},
      'head': {'kernel': jnp.ones((8, 32))},
      'layer_0': {'attn': {'query': {'kernel': jnp.ones((8, 8))}},
                  'attn_norm': {'scale': jnp.ones((8,))},
                  'mlp': {'up': {'kernel': jnp.ones((8, 16))},
                          'bias': jnp.ones((16,))}},
  }


def test_labels_put_embeddings_head_and_norms_on_adamw():
  labels = muon_adamw_labels(_lm_params())
  assert labels['embed']['embedding'] == 'adamw'  # 2-D, but by name
  assert labels['head']['kernel'] == 'adamw'  # 2-D, but by name
  assert labels['final_norm']['scale'] == 'adamw'
  assert labels['layer_0']['attn_norm']['scale'] == 'adamw'
  assert labels['layer_0']['mlp']['bias'] == 'adamw'  # 1-D
  assert labels['layer_0']['attn']['query']['kernel'] == 'muon'
  assert labels['layer_0']['mlp']['up']['kernel'] == 'muon'


def test_labels_of_the_reference_transformer():
  from loc_opt.models import transformer  # pylint: disable=g-import-not-at-top
  model = transformer.build_transformer(transformer.TransformerConfig(
      vocab_size=64, d_model=16, num_heads=2, num_layers=1, d_ff=32,
      max_len=8))
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  flat = jax.tree_util.tree_flatten_with_path(muon_adamw_labels(shapes))[0]
  got = {jax.tree_util.keystr(p): label for p, label in flat}
  muon = {k for k, v in got.items() if v == 'muon'}
  assert muon and all('layer_0' in k and 'norm' not in k for k in muon)
  assert all(got[k] == 'adamw' for k in got if 'embed' in k or 'head' in k
             or 'norm' in k)


@pytest.mark.parametrize('ratio', [1.0, 0.1])
def test_each_group_gets_its_own_rule_and_learning_rate(ratio):
  params = _lm_params()
  grads = jax.tree.map(lambda x: jnp.asarray(np.random.default_rng(
      x.size).standard_normal(x.shape), jnp.float32), params)
  tx = inner.make_optimizer('muon_adamw', 0.02, adamw_lr_ratio=ratio,
                            adamw_b2=0.99)
  u, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  adam = optax.adamw(0.02 * ratio, b1=0.9, b2=0.99, eps=1e-8,
                     weight_decay=0.0, nesterov=True)
  ua, _ = adam.update(grads, adam.init(params), params)
  for path in (('embed', 'embedding'), ('head', 'kernel'),
               ('final_norm', 'scale')):
    a, b = u, ua
    for p in path:
      a, b = a[p], b[p]
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
  muon = optax.contrib.muon(0.02, beta=0.95)  # every 2-D leaf is Muon's
  for path in (('attn', 'query', 'kernel'), ('mlp', 'up', 'kernel')):
    q = grads['layer_0']
    got = u['layer_0']
    for p in path:
      q, got = q[p], got[p]
    um, _ = muon.update({'w': q}, muon.init({'w': q}), {'w': q})
    np.testing.assert_allclose(got, um['w'], rtol=1e-4, atol=1e-6)


def test_adamw_follows_the_scheduled_muon_rate():
  sched = optax.linear_schedule(0.0, 0.02, 10)
  tx = inner.muon_adamw(sched, adamw_lr_ratio=0.5)
  params = {'norm': jnp.ones((4,)), 'w': jnp.ones((4, 4))}
  grads = jax.tree.map(jnp.ones_like, params)
  state = tx.init(params)
  u, state = tx.update(grads, state, params)  # count 0: rate 0
  np.testing.assert_allclose(u['norm'], 0.0)
  u, _ = tx.update(grads, state, params)  # count 1: rate 0.002, adam 1
  adam = optax.adamw(lambda c: 0.5 * sched(c), b1=0.9, b2=0.95,
                     weight_decay=0.0, nesterov=True)
  sa = adam.init(params['norm'])
  _, sa = adam.update(grads['norm'], sa, params['norm'])
  want, _ = adam.update(grads['norm'], sa, params['norm'])
  np.testing.assert_allclose(u['norm'], want, rtol=1e-5)
  assert float(jnp.abs(u['norm'][0])) > 0


def test_spectral_width_scale_is_dions_sqrt_fan_out_over_fan_in():
  # A 16 -> 8 matrix (fan_in 16, fan_out 8): optax's sqrt(max(1, 8 / 16))
  # is 1, Dion's sqrt(8 / 16) is 0.71; an 8 -> 16 matrix gets sqrt(2) from
  # both. Weight decay stays lr * wd * w (Dion's base rate), not scaled.
  rng = np.random.default_rng(0)
  params = {'down': jnp.asarray(rng.standard_normal((16, 8)), jnp.float32),
            'up': jnp.asarray(rng.standard_normal((8, 16)), jnp.float32),
            'norm': jnp.ones((8,))}
  grads = jax.tree.map(lambda x: jnp.asarray(
      rng.standard_normal(x.shape), jnp.float32), params)

  def update(**kw):
    tx = inner.make_optimizer('muon_adamw', 0.02, momentum=0.9,
                              nesterov=False, **kw)
    return jax.jit(tx.update)(grads, tx.init(params), params)[0]

  plain = update()
  spectral = update(width_scale='spectral')
  np.testing.assert_allclose(spectral['down'], np.sqrt(0.5) * plain['down'],
                             rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(spectral['up'], plain['up'], rtol=1e-6)
  np.testing.assert_allclose(spectral['norm'], plain['norm'], rtol=1e-6)
  decayed = update(width_scale='spectral', weight_decay=0.1)
  np.testing.assert_allclose(
      decayed['down'], spectral['down'] - 0.02 * 0.1 * params['down'],
      rtol=1e-5, atol=1e-7)
  with pytest.raises(ValueError, match='width_scale must be one of'):
    inner.muon_adamw(0.02, width_scale='dion')


def test_per_iteration_newton_schulz_coefficients():
  params = {'w': jnp.asarray(np.random.default_rng(1).standard_normal(
      (8, 8)), jnp.float32)}
  tx = inner.make_optimizer('muon_adamw', 0.02, ns_coeffs=DION_NS_COEFFS)
  u, _ = jax.jit(tx.update)(params, tx.init(params), params)
  ref = optax.contrib.muon(0.02, ns_coeffs=DION_NS_COEFFS, beta=0.95)
  want, _ = ref.update(params, ref.init(params), params)
  np.testing.assert_allclose(u['w'], want['w'], rtol=1e-5, atol=1e-7)
  # an orthogonalized update: singular values near 1 (times the rate)
  s = np.linalg.svd(np.asarray(u['w']) / -0.02, compute_uv=False)
  assert 0.6 < s.min() and s.max() < 1.3, s
  with pytest.raises(ValueError, match='ns_steps=5 triples'):
    inner.muon_adamw(0.02, ns_coeffs=DION_NS_COEFFS[:3])
