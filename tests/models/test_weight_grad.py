"""Tests for the narrow-transpose weight gradient (loc_opt.models.weight_grad)."""

import re

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from loc_opt import models
from loc_opt.models import transformer as tfm
from loc_opt.models import weight_grad


def _grads(weight_grad_value, **fields):
  config = dict(name='transformer', d_model=32, num_layers=2, num_heads=4,
                d_ff=96, max_len=32, weight_grad=weight_grad_value) | fields
  model = models.build_model(config)
  params = model.init(jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, 256)

  def loss(p):
    return models.lm_loss(model.apply(p, tokens[:, :-1]), tokens[:, 1:])

  return jax.jit(jax.value_and_grad(loss))(params)


_LAYOUTS = pytest.mark.parametrize('fields', [
    {}, {'remat': 'dots'}, {'scan_layers': True, 'remat': 'full'}],
    ids=['plain', 'remat_dots', 'scan_remat_full'])


@_LAYOUTS
def test_dense_gradients_match_jax_rule(fields):
  # Attention through jax.nn.dot_product_attention (JAX's rule either way),
  # so only the dense layers' and the embedding's gradients differ in how
  # they are computed. The narrow rule's matmuls contract in another
  # layout, so the reductions may sum in another order: the gradients agree
  # to float32 rounding (bit for bit on some CPUs, not on others).
  loss_xla, g_xla = _grads('xla', attention='xla', **fields)
  loss_narrow, g_narrow = _grads('narrow', attention='xla', **fields)
  # The same forward operations, compiled into two programs (fusion may
  # differ): a few float32 ulps.
  np.testing.assert_allclose(float(loss_narrow), float(loss_xla), rtol=1e-6)
  assert jax.tree.structure(g_xla) == jax.tree.structure(g_narrow)
  for a, b in zip(jax.tree.leaves(g_xla), jax.tree.leaves(g_narrow)):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(b, a, rtol=1e-5,
                               atol=1e-6 * float(np.max(np.abs(a))))
  # A wrong gradient (the two layers' down projections swapped) is far
  # off: the check bites.
  downs = [d for x in jax.tree.leaves(g_narrow) if x.shape[-2:] == (96, 32)
           for d in np.asarray(x).reshape(-1, 96, 32)]
  assert len(downs) == 2 and not np.allclose(downs[1], downs[0], rtol=1e-2)


@_LAYOUTS
def test_einsum_attention_gradients_match_jax_rule(fields):
  # The narrow attention backward sums the same terms in another order:
  # the loss is the same computation, the gradients agree to float32
  # rounding.
  loss_xla, g_xla = _grads('xla', **fields)
  loss_narrow, g_narrow = _grads('narrow', **fields)
  np.testing.assert_allclose(float(loss_narrow), float(loss_xla), rtol=1e-6)
  assert jax.tree.structure(g_xla) == jax.tree.structure(g_narrow)
  for a, b in zip(jax.tree.leaves(g_xla), jax.tree.leaves(g_narrow)):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(b, a, rtol=1e-5,
                               atol=1e-6 * float(np.max(np.abs(a))))


def _attention_inputs(dtype=jnp.float32, shape=(2, 16, 4, 8)):
  keys = jax.random.split(jax.random.key(7), 4)
  q, k, v, r = (jax.random.normal(key, shape).astype(dtype) for key in keys)
  return q, k, v, r


def _attention_grads(weight_grad_value, q, k, v, r):
  def loss(q, k, v):
    out = tfm.attend(q, k, v, 'einsum', weight_grad_value)
    return jnp.sum(out.astype(jnp.float32) * r.astype(jnp.float32))
  return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)


def test_narrow_attention_forward_and_gradients_close():
  inputs = _attention_inputs()
  (loss_xla, g_xla) = _attention_grads('xla', *inputs)
  (loss_narrow, g_narrow) = _attention_grads('narrow', *inputs)
  # The same forward operations, but the narrow program keeps the
  # probabilities as an array (another fusion): a few float32 ulps.
  np.testing.assert_allclose(float(loss_narrow), float(loss_xla), rtol=1e-6)
  for a, b in zip(g_xla, g_narrow):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
  # A wrong backward (keys and values swapped) is far off: the check bites.
  assert not np.allclose(g_narrow[1], g_xla[2], rtol=1e-2)


def test_narrow_attention_leaves_bfloat16_to_jax_rule():
  inputs = _attention_inputs(jnp.bfloat16)
  # The same program: narrow falls back to the einsum attention for
  # bfloat16, so the gradient jaxprs are equal and the values bit-identical.
  jaxprs = {value: str(jax.make_jaxpr(
      lambda *xs, value=value: _attention_grads(value, *xs))(*inputs))
            for value in ('xla', 'narrow')}
  assert jaxprs['xla'] == jaxprs['narrow']
  for a, b in zip(_attention_grads('xla', *inputs)[1],
                  _attention_grads('narrow', *inputs)[1]):
    assert a.dtype == b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(b, np.float32))


def _dots_contracting_a_leading_axis(compiled_text: str) -> list[str]:
  """The dots of a compiled program whose left operand is not contracted
  over its last axis (XLA:CPU hands those to Eigen, which packs the strided
  operand)."""
  ranks = {m.group(1): len(m.group(2).split(','))
           for m in re.finditer(r'%(\S+) = \w+\[([\d,]+)\]', compiled_text)}
  found = []
  for m in re.finditer(r'%(\S+) = \S+ dot\(%(\S+), %\S+\), '
                       r'lhs_batch_dims=\{[\d,]*\}, '
                       r'lhs_contracting_dims=\{(\d+)\}', compiled_text):
    if int(m.group(3)) != ranks[m.group(2)] - 1:
      found.append(m.group(0))
  return found


def _attention_backward_text(weight_grad_value) -> str:
  inputs = _attention_inputs(shape=(4, 128, 4, 32))

  def loss(q, k, v, r):
    return jnp.sum(tfm.attend(q, k, v, 'einsum', weight_grad_value) * r)

  return jax.jit(jax.grad(loss, (0, 1, 2))).lower(*inputs).compile().as_text()


def test_narrow_attention_contracts_last_axes_on_cpu():
  # JAX's rule: dS^T q, a contraction over the query axis of dS.
  assert _dots_contracting_a_leading_axis(_attention_backward_text('xla'))
  assert not _dots_contracting_a_leading_axis(
      _attention_backward_text('narrow'))


def test_bfloat16_gradients_as_close_to_float32_as_jax_rule():
  _, ref = _grads('xla')
  errors = {}
  for value in ('xla', 'narrow'):
    _, grads = _grads(value, dtype='bfloat16')
    errors[value] = max(
        float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r))
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)))
  assert errors['narrow'] < 0.05  # bfloat16 rounding, not a wrong gradient
  assert errors['narrow'] <= 1.5 * errors['xla']


@pytest.mark.parametrize('shape', [(3, 5, 8, 24), (7, 24, 8)],
                         ids=['wide_out', 'wide_in'])
def test_dense_vjp_matches_jax(shape):
  *lead, n_in, n_out = shape
  kx, kw, kg = jax.random.split(jax.random.key(2), 3)
  x = jax.random.normal(kx, (*lead, n_in))
  w = jax.random.normal(kw, (n_in, n_out))
  g = jax.random.normal(kg, (*lead, n_out))
  dims = (((x.ndim - 1,), (0,)), ((), ()))
  out, vjp = jax.vjp(lambda x, w: weight_grad.dot_general(x, w, dims), x, w)
  ref_out, ref_vjp = jax.vjp(lambda x, w: lax.dot_general(x, w, dims), x, w)
  np.testing.assert_allclose(out, ref_out, rtol=1e-6)
  for a, b in zip(vjp(g), ref_vjp(g)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_other_contractions_are_lax_dot_general():
  a = jax.random.normal(jax.random.key(3), (2, 4, 5))
  b = jax.random.normal(jax.random.key(4), (2, 5, 3))
  dims = (((2,), (1,)), ((0,), (0,)))  # batched: not a dense layer
  f = lambda a, b: weight_grad.dot_general(a, b, dims).sum()
  ref = lambda a, b: lax.dot_general(a, b, dims).sum()
  # The same operations: the gradient jaxprs are equal, so the values are
  # bit-identical.
  assert (str(jax.make_jaxpr(jax.grad(f, (0, 1)))(a, b))
          == str(jax.make_jaxpr(jax.grad(ref, (0, 1)))(a, b)))
  for x, y in zip(jax.grad(f, (0, 1))(a, b), jax.grad(ref, (0, 1))(a, b)):
    np.testing.assert_array_equal(x, y)
  # The jaxpr of a batched contraction holds no custom VJP.
  assert 'custom_vjp' not in str(jax.make_jaxpr(f)(a, b))


def _mlp_backward_text(weight_grad_value) -> str:
  """The compiled MLP backward of the 853k LM at batch 32 x 128."""
  x = jnp.ones((32, 128, 128))
  w_up, w_down = jnp.ones((128, 512)), jnp.ones((512, 128))

  def loss(w_up, w_down, x):
    mm = lambda a, b: weight_grad.matmul(a, b, weight_grad_value)
    return jnp.sum(mm(jax.nn.gelu(mm(x, w_up), approximate=True), w_down))

  grad = jax.jit(jax.grad(loss, (0, 1)))
  return grad.lower(w_up, w_down, x).compile().as_text()


def _largest_transpose(compiled_text: str) -> int:
  """Elements of the largest transposed array in a compiled program."""
  sizes = [int(np.prod([int(d) for d in m.group(1).split(',')]))
           for m in re.finditer(r'= f32\[([\d,]+)\]\{[\d,]+\} transpose\(',
                                compiled_text)]
  return max(sizes, default=0)


def test_narrow_transposes_the_narrow_operand_on_cpu():
  # JAX's rule has XLA:CPU transpose the [4096, 512] GELU derivative for
  # the up projection's weight gradient; the narrow VJP transposes the
  # [4096, 128] input instead (and the [128, 512] result of the down
  # projection's), and every weight gradient is a row-major matmul.
  xla, narrow = _mlp_backward_text('xla'), _mlp_backward_text('narrow')
  assert _largest_transpose(xla) == 4096 * 512
  assert _largest_transpose(narrow) <= 4096 * 128
  assert not _dots_contracting_a_leading_axis(narrow)


def test_config_values():
  assert weight_grad.resolve('auto') == 'narrow'  # the suite runs on CPU
  assert weight_grad.resolve('xla') == 'xla'
  with pytest.raises(ValueError, match='model.weight_grad'):
    models.TransformerConfig(weight_grad='fast')


def test_mixed_precision_cotangents_take_the_operands_dtypes():
  # bfloat16 operands with float32 accumulation (preferred_element_type):
  # the cotangents come back in bfloat16, equal to JAX's rule's.
  x = jax.random.normal(jax.random.key(5), (4, 8, 16)).astype(jnp.bfloat16)
  w = jax.random.normal(jax.random.key(6), (16, 32)).astype(jnp.bfloat16)
  dims = (((2,), (0,)), ((), ()))
  ours = jax.grad(lambda x, w: weight_grad.dot_general(
      x, w, dims, preferred_element_type=jnp.float32).sum(), (0, 1))(x, w)
  ref = jax.grad(lambda x, w: lax.dot_general(
      x, w, dims, preferred_element_type=jnp.float32).sum(), (0, 1))(x, w)
  for a, b in zip(ours, ref):
    assert a.dtype == b.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(a, np.float32),
                               np.asarray(b, np.float32), rtol=1e-2)
