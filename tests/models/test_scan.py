"""Tests for scanned (stacked) Transformer blocks and rematerialization."""

import dataclasses
import re

import jax
import numpy as np
import pytest

from loc_opt import models
from loc_opt import outer

TINY = models.TransformerConfig(
    d_model=32, num_layers=3, num_heads=4, d_ff=64, max_len=32
)
TOKENS = np.random.default_rng(0).integers(0, 256, (4, 17), dtype=np.int32)


def _value_and_grad(model):
  def loss_fn(params, tokens):
    return models.lm_loss(model.apply(params, tokens[:, :-1]), tokens[:, 1:])
  return jax.jit(jax.value_and_grad(loss_fn))


@pytest.fixture(scope='module')
def unrolled():
  model = models.build_transformer(TINY)
  params = jax.jit(model.init)(jax.random.key(0))
  return model, params, _value_and_grad(model)(params, TOKENS)


@pytest.mark.parametrize('scan, remat', [(True, 'none'), (True, 'full'),
                                         (False, 'dots'),
                                         (True, 'dots_no_batch')])
def test_scanned_and_rematerialized_blocks_match_unrolled(unrolled, scan,
                                                          remat):
  model, params, (ref_loss, ref_grads) = unrolled
  config = dataclasses.replace(TINY, scan_layers=scan, remat=remat)
  other = models.build_transformer(config)
  assert other.num_params == model.num_params
  other_params = jax.jit(other.init)(jax.random.key(0))
  if scan:
    # Same initial values: layers[i] is layer_i (drawn from the same keys
    # by another program, the scanned init: to float32 rounding).
    for i in range(TINY.num_layers):
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6,
                                                           atol=1e-7),
                   jax.tree.map(lambda x, i=i: x[i], other_params['layers']),
                   params[f'layer_{i}'])
    # Another layer's values are far off: the check bites.
    assert not np.allclose(other_params['layers']['mlp']['up']['kernel'][0],
                           params['layer_1']['mlp']['up']['kernel'],
                           rtol=1e-2)
    assert other.specs['layers']['attn']['query']['kernel'] == jax.P(
        None, 'fsdp', 'tensor')
    unstack = lambda g: {
        **{k: v for k, v in g.items() if k != 'layers'},
        **{f'layer_{i}': jax.tree.map(lambda x, i=i: x[i], g['layers'])
           for i in range(TINY.num_layers)}}
  else:
    unstack = lambda g: g
  loss, grads = _value_and_grad(other)(other_params, TOKENS)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=1e-4,
                                                       atol=1e-7),
               unstack(grads), ref_grads)


def _program(num_layers, scan_layers=True, compile_=True):
  """The loss-and-gradients program of the model at ``num_layers``: the
  compiled HLO text (scanned, remat full) or, for ``compile_=False``, the
  lowered StableHLO text."""
  config = dataclasses.replace(TINY, num_layers=num_layers,
                               scan_layers=scan_layers, remat='full')
  model = models.build_transformer(config)
  params = jax.eval_shape(model.init, jax.random.key(0))
  lowered = _value_and_grad(model).lower(params, TOKENS)
  return lowered.compile().as_text() if compile_ else lowered.as_text()


def _count(pattern, text):
  return len(re.findall(pattern, text))


def test_compiled_program_is_flat_in_depth():
  # What makes compile time flat in depth, checked on the program rather
  # than with a clock (a timing is not portable across machines or load):
  # the scanned blocks compile to one loop body, so the optimized program
  # holds the same instructions, loops and matmuls at 8 layers as at 32.
  shallow, deep = _program(8), _program(32)
  instructions = r'(?m)^\s*(?:ROOT )?%\S+ = '
  assert _count(instructions, deep) <= 1.05 * _count(instructions, shallow)
  for op in (r' while\(', r' dot\(', r' custom-call\('):
    assert _count(op, deep) == _count(op, shallow), op
  assert _count(r' while\(', deep) >= 1  # a loop, not unrolled
  assert len(deep) < 1.1 * len(shallow)
  # Unrolled blocks grow with depth: the check bites.
  dots = r'stablehlo\.dot_general'
  assert (_count(dots, _program(4, scan_layers=False, compile_=False)) >
          1.5 * _count(dots, _program(2, scan_layers=False, compile_=False)))


@pytest.mark.parametrize('pattern', ['strided', 'sequential'])
def test_streaming_fragments_split_stacked_blocks_by_layer(pattern):
  """Each row of a stacked leaf goes to the fragment of its unrolled block."""
  shapes = {}
  for scan in (False, True):
    config = dataclasses.replace(TINY, scan_layers=scan)
    shapes[scan] = jax.eval_shape(models.build_transformer(config).init,
                                  jax.random.key(0))
  unrolled = outer.fragment_ids(shapes[False], 3, pattern=pattern)
  stacked = outer.fragment_ids(shapes[True], 3, pattern=pattern)
  for name in ('attn', 'mlp_norm'):
    want = tuple(jax.tree.leaves(unrolled[f'layer_{i}'][name])[0]
                 for i in range(TINY.num_layers))
    assert set(map(tuple, jax.tree.leaves(
        stacked['layers'][name], is_leaf=lambda x: isinstance(x, tuple)))
               ) == {want}
  assert outer.fragment_bytes(shapes[True], stacked) == \
      outer.fragment_bytes(shapes[False], unrolled)


def test_bad_remat_or_scan_values_raise():
  with pytest.raises(ValueError, match='model.remat'):
    dataclasses.replace(TINY, remat='some')
  with pytest.raises(ValueError, match='model.scan_layers'):
    dataclasses.replace(TINY, scan_layers='yes')
