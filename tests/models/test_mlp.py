"""Tests for the MLP and its functional interface."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loc_opt import models

CONFIG = models.MLPConfig(in_dim=16, hidden=32, out_dim=16, num_layers=3)


@pytest.fixture(scope='module')
def model():
  return models.build_mlp(CONFIG)


@pytest.fixture(scope='module')
def params(model):
  return jax.jit(model.init)(jax.random.key(0))


def test_structure_specs_and_count(model, params):
  assert sorted(params) == ['dense_0', 'dense_1', 'dense_2']
  shapes = jax.tree.map(lambda x: x.shape, params)
  assert shapes == {
      'dense_0': {'kernel': (16, 32), 'bias': (32,)},
      'dense_1': {'kernel': (32, 32), 'bias': (32,)},
      'dense_2': {'kernel': (32, 16), 'bias': (16,)},
  }
  assert jax.tree.structure(params) == jax.tree.structure(model.specs)
  assert model.specs['dense_0']['kernel'] == jax.P('fsdp', 'tensor')
  assert model.specs['dense_1']['kernel'] == jax.P('tensor', 'fsdp')
  assert model.specs['dense_2']['bias'] == jax.P(None)
  assert model.num_params == 16 * 32 + 32 + 32 * 32 + 32 + 32 * 16 + 16
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))


def test_float_and_integer_inputs(model, params):
  apply = jax.jit(model.apply)
  x = np.random.default_rng(0).normal(size=(5, 16)).astype(np.float32)
  out = apply(params, x)
  assert out.shape == (5, 16) and out.dtype == jnp.float32
  tokens = np.array([[0, 3, 15], [1, 2, 3]], np.int32)
  logits = apply(params, tokens)
  assert logits.shape == (2, 3, 16)
  # Integer inputs are one-hot rows of the identity.
  np.testing.assert_allclose(
      logits[0, 1], apply(params, np.eye(16, dtype=np.float32)[3]),
      rtol=1e-5,  # a gather and a one-hot matmul: fp32 rounding apart
  )
  with pytest.raises(ValueError, match='in_dim'):
    model.apply(params, jnp.ones((2, 7)))


def test_bigram_lm_learns_and_vmaps():
  model = models.build_model({'name': 'mlp', 'num_layers': 2})
  params = jax.jit(model.init)(jax.random.key(1))
  tokens = np.random.default_rng(1).integers(0, 256, (4, 33), dtype=np.int32)

  def loss_fn(p):
    return models.lm_loss(model.apply(p, tokens[:, :-1]), tokens[:, 1:])

  tx = optax.adam(1e-2)

  @jax.jit
  def step(p, s):
    loss, grads = jax.value_and_grad(loss_fn)(p)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, loss

  state, losses = tx.init(params), []
  p = params
  for _ in range(10):
    p, state, loss = step(p, state)
    losses.append(float(loss))
  assert abs(losses[0] - math.log(256)) < 0.1
  assert losses[-1] < losses[0] - 0.5, losses

  stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), params, p)
  out = jax.jit(jax.vmap(model.apply, in_axes=(0, None)))(stacked, tokens)
  np.testing.assert_allclose(
      out[1], model.apply(p, tokens), rtol=1e-5, atol=1e-5
  )
  assert not np.allclose(out[0], out[1])
