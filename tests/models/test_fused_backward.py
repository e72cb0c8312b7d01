"""Tests for the fused backward rules (loc_opt.models.fused_backward) and the
RoPE attention VJP of the Transformer."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loc_opt.models import attention
from loc_opt.models import fused_backward
from loc_opt.models import transformer as tfm
# The 2-layer LM's loss and gradients (weight_grad first, then model fields).
from tests.models.test_weight_grad import _grads as _lm_grads
from tests.same_program import assert_same_program


def _close(got, want, rtol=1e-5):
  got, want = np.asarray(got), np.asarray(want)
  np.testing.assert_allclose(got, want, rtol=rtol,
                             atol=rtol * float(np.max(np.abs(want))))


def _norm_layer(width=48):
  layer = nnx.RMSNorm(width, epsilon=1e-6, rngs=nnx.Rngs(0))
  layer.scale[...] = 1 + 0.1 * jax.random.normal(jax.random.key(3), (width,))
  return layer


def test_rms_norm_forward_identical_gradients_close():
  layer = _norm_layer()
  x = 3 * jax.random.normal(jax.random.key(0), (4, 16, 48))
  g = jax.random.normal(jax.random.key(1), x.shape)
  scale = layer.scale[...]
  want_fn = lambda x: layer(x)
  got_fn = lambda x: fused_backward.rms_norm(x, scale, 1e-6)
  # The forward is nnx.RMSNorm's operations: the same compiled program,
  # so bit-identical on any machine.
  assert_same_program(got_fn, want_fn, x)
  np.testing.assert_array_equal(np.asarray(jax.jit(got_fn)(x)),
                                np.asarray(jax.jit(want_fn)(x)))

  def ref(x, s):  # nnx.RMSNorm's operations, differentiated by JAX
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6)
    return x * (inv * s)

  vjp = lambda f: jax.jit(lambda x, s, g: jax.vjp(f, x, s)[1](g))
  dx_want, ds_want = vjp(ref)(x, scale, g)
  dx, ds = vjp(lambda x, s: fused_backward.rms_norm(x, s, 1e-6))(x, scale, g)
  _close(dx, dx_want)
  _close(ds, ds_want)
  # Without the normalization's own term the input gradient is far off.
  inv = jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6)
  assert not np.allclose(g * scale * inv, dx_want, rtol=1e-2)


def test_rms_norm_rejects_other_dtypes():
  x = jnp.ones((2, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match='float32'):
    fused_backward.rms_norm(x, jnp.ones((8,)), 1e-6)


def test_gelu_forward_identical_gradient_close():
  x = 3 * jax.random.normal(jax.random.key(0), (8, 64, 96))
  g = jax.random.normal(jax.random.key(1), x.shape)
  gelu = lambda x: jax.nn.gelu(x, approximate=True)
  # The forward is jax.nn.gelu's operations: the same compiled program, so
  # bit-identical on any machine.
  assert_same_program(fused_backward.gelu_tanh, gelu, x)
  np.testing.assert_array_equal(
      np.asarray(jax.jit(fused_backward.gelu_tanh)(x)),
      np.asarray(jax.jit(gelu)(x)))
  vjp = lambda f: jax.jit(lambda x, g: jax.vjp(f, x)[1](g)[0])
  want = vjp(gelu)(x, g)
  _close(vjp(fused_backward.gelu_tanh)(x, g), want)
  # The exact-GELU derivative differs from the tanh form's: the check bites.
  exact = lambda x: jax.nn.gelu(x, approximate=False)
  assert not np.allclose(vjp(exact)(x, g), want, rtol=1e-5, atol=1e-6)


def test_apply_rope_is_the_half_split_rotation():
  x = jax.random.normal(jax.random.key(0), (2, 16, 4, 8))
  sin, cos = tfm.rope_tables(16, 8)

  def half_split(x):
    x1, x2 = jnp.split(x, 2, axis=-1)
    s, c = sin[:, None, :], cos[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

  # The same products and sums, in programs XLA fuses differently: equal
  # to float32 rounding.
  got = jax.jit(lambda x: tfm.apply_rope(x, sin, cos))(x)
  _close(got, jax.jit(half_split)(x), rtol=1e-6)
  # The inverse rotation (sin negated) is far off: the check bites.
  assert not np.allclose(got, jax.jit(lambda x: tfm.apply_rope(
      x, -sin, cos))(x), rtol=1e-2)


def test_causal_mask_gives_the_probabilities_of_a_select_and_of_a_bias():
  scores = jax.random.normal(jax.random.key(0), (2, 3, 16, 16))
  causal = jnp.tril(jnp.ones((16, 16), bool))
  minimum = jnp.finfo(jnp.float32).min

  def selected(s):  # a constant boolean mask, as earlier releases had it
    return jax.nn.softmax(jnp.where(causal, s, minimum), axis=-1)

  def biased(s):  # 0 below and on the diagonal, the minimum above, added
    return jax.nn.softmax(s + jnp.where(causal, 0.0, minimum), axis=-1)

  probs = jax.jit(lambda s: attention._softmax_probs(s, False))(scores)
  # The masked scores are the same values either way (s + minimum rounds
  # to minimum), but the softmax's reductions are fused into different
  # programs: equal to float32 rounding; the masked entries exactly 0.
  for other in (selected, biased):
    _close(probs, jax.jit(other)(scores), rtol=1e-6)
  # Without the mask the probabilities are far off: the check bites.
  assert not np.allclose(probs, jax.nn.softmax(scores, axis=-1), rtol=1e-2)
  assert float(jnp.max(jnp.where(causal, 0.0, probs))) == 0.0
  assert float(jnp.min(jnp.where(causal, probs, 1.0))) > 0.0


def _rope_inputs(shape=(2, 16, 4, 8)):
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, d_out = (jax.random.normal(key, shape) for key in keys)
  sin, cos = tfm.rope_tables(shape[1], shape[-1])
  return q, k, v, d_out, sin, cos


@pytest.mark.parametrize('blocks', [1, 2, 4, 3])
def test_rope_attention_equals_jax_rules(blocks):
  # One block: the forward the einsum formula's operations, in another
  # program (so to float32 rounding, 1e-6). More (3 does not divide T = 16:
  # one block): the scores above the diagonal's blocks are skipped, equal
  # to float32 rounding.
  q, k, v, d_out, sin, cos = _rope_inputs()

  def reference(q, k, v):  # JAX's rules through RoPE and the einsum formula
    rope = lambda x: tfm.apply_rope(x, sin, cos)
    return tfm.attend(rope(q), rope(k), v, 'einsum', 'xla')

  fused = lambda q, k, v: tfm.rope_attention(q, k, v, sin, cos, blocks)
  out_want, pull_want = jax.vjp(reference, q, k, v)
  out, pull = jax.vjp(fused, q, k, v)
  if tfm.query_blocks(q.shape[1], blocks) == 1:
    _close(jax.jit(fused)(q, k, v), jax.jit(reference)(q, k, v), rtol=1e-6)
  _close(out, out_want)
  want = pull_want(d_out)
  got = pull(d_out)
  for a, b in zip(got, want):
    _close(a, b)
  # The keys' gradient is not the queries': the check bites.
  assert not np.allclose(got[1], want[0], rtol=1e-2)


def test_causal_blocks_skip_the_scores_above_the_diagonal():
  # Two blocks of 8 queries of T = 16: the residual probabilities are
  # [.., 8, 8] and [.., 8, 16], three quarters of the full [.., 16, 16].
  q, k, v, d_out, sin, cos = _rope_inputs()
  _, residuals = jax.vjp(lambda q: tfm.rope_attention(q, k, v, sin, cos, 2),
                         q)
  shapes = sorted(x.shape[-2:] for x in jax.tree.leaves(residuals)
                  if x.ndim == 4 and x.shape[-2] == 8)
  assert shapes == [(8, 8), (8, 16)], shapes
  assert tfm.query_blocks(16, 2) == 2 and tfm.query_blocks(15, 2) == 1
  with pytest.raises(ValueError, match='causal_blocks must be a positive'):
    tfm.TransformerConfig(causal_blocks=0)


def test_causal_blocks_auto_splits_only_on_one_core(monkeypatch):
  assert tfm.resolve_causal_blocks(3) == 3
  monkeypatch.setattr('os.sched_getaffinity', lambda pid: {0})
  assert tfm.resolve_causal_blocks('auto') == 2
  monkeypatch.setattr('os.sched_getaffinity', lambda pid: {0, 1})
  assert tfm.resolve_causal_blocks('auto') == 1
  assert tfm.TransformerConfig().causal_blocks == 'auto'
  assert tfm.TransformerConfig(causal_blocks='2').causal_blocks == 2
  with pytest.raises(ValueError, match="'auto' or a positive int"):
    tfm.TransformerConfig(causal_blocks='two')


@pytest.mark.parametrize('fields', [
    {}, {'weight_grad': 'xla'}, {'remat': 'dots'},
    {'scan_layers': True, 'remat': 'full'}],
    ids=['narrow', 'weight_grad_xla', 'remat_dots', 'scan_remat_full'])
def test_model_gradients_match_jax_rules(fields):
  fields = dict(fields)
  weight_grad = fields.pop('weight_grad', 'auto')
  loss_xla, g_xla = _lm_grads(weight_grad, backward='xla', **fields)
  loss_fused, g_fused = _lm_grads(weight_grad, backward='fused', **fields)
  np.testing.assert_allclose(float(loss_fused), float(loss_xla), rtol=1e-6)
  assert jax.tree.structure(g_xla) == jax.tree.structure(g_fused)
  for a, b in zip(jax.tree.leaves(g_xla), jax.tree.leaves(g_fused)):
    _close(b, a, rtol=2e-5)


def test_mixed_precision_keeps_jax_rules():
  config = tfm.TransformerConfig(dtype='bfloat16', backward='fused')
  assert not config.fused()
  assert tfm.TransformerConfig(backward='fused').fused()
  assert not tfm.TransformerConfig(backward='xla').fused()


def test_config_values():
  assert fused_backward.resolve('auto') == 'fused'  # the tests run on CPU
  assert fused_backward.resolve('xla') == 'xla'
  with pytest.raises(ValueError, match='model.backward'):
    tfm.TransformerConfig(backward='fast')
