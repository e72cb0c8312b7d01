"""WSM merge coefficients and checkpoint merging."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loc_opt import schedules


def test_linear_is_uniform_over_last_k():
  np.testing.assert_allclose(schedules.wsm_coefficients(4),
                             [0, .25, .25, .25, .25], atol=1e-15)
  for k in (1, 3, 10):
    c = schedules.wsm_coefficients(k, 'linear', 'endpoint')
    np.testing.assert_allclose(c, [0] + [1 / k] * k, atol=1e-15)


def test_spec_vectors():
  # Spec §5: cosine "endpoint" reads psi(i / k), the 'right' rule here.
  np.testing.assert_allclose(
      schedules.wsm_coefficients(4, 'cosine', 'right'),
      [0.1464, 0.3536, 0.3536, 0.1464, 0], atol=5e-5)
  np.testing.assert_allclose(
      schedules.wsm_coefficients(4, 'cosine', 'midpoint'),
      [0.0381, 0.2706, 0.3827, 0.2706, 0.0381], atol=5e-5)
  # The start-of-interval rule is the same vector shifted by one checkpoint.
  np.testing.assert_allclose(
      schedules.wsm_coefficients(4, 'cosine', 'left'),
      [0, 0.1464, 0.3536, 0.3536, 0.1464], atol=5e-5)


@pytest.mark.parametrize('shape', sorted(schedules.DECAY_SHAPES))
@pytest.mark.parametrize('sampling', ['endpoint', 'midpoint', 'right'])
def test_sum_to_one_and_nonnegative(shape, sampling):
  c = schedules.wsm_coefficients(7, shape, sampling)
  assert c.shape == (8,)
  assert np.all(c >= 0)
  np.testing.assert_allclose(c.sum(), 1.0, atol=1e-14)


def test_errors():
  with pytest.raises(ValueError, match='unknown sampling'):
    schedules.wsm_coefficients(4, sampling='trapezoid')
  with pytest.raises(ValueError, match='decay_shape'):
    schedules.wsm_coefficients(4, 'step')
  with pytest.raises(ValueError, match='k must be >= 1'):
    schedules.wsm_coefficients(0)
  with pytest.raises(ValueError, match='coefficients'):
    schedules.merge_params([{'w': jnp.ones(2)}] * 3, [0.5, 0.5])
  with pytest.raises(ValueError, match='does not fit'):
    schedules.wsm_checkpoint_steps(10, 4, 3)


def test_merge_equals_wsd_decay_for_fixed_gradients():
  """Per-step checkpoints at constant LR, merged with 'endpoint' weights,
  equal a WSD run decaying over the same k steps (exact for gradients that
  do not depend on the weights)."""
  n, k, lr = 6, 8, 0.1
  total = n + k
  grads = jax.random.normal(jax.random.key(0), (total, 5))
  theta0 = jnp.arange(5.0)

  @jax.jit
  def run(rates):
    """SGD with per-step rates; row t - 1 is the model after t updates."""
    return theta0 - jnp.cumsum(rates[:, None] * grads, axis=0)

  constant = np.asarray(run(jnp.full(total, lr)))
  ckpts = [{'w': constant[t - 1]} for t in range(n, total + 1)]
  merge = jax.jit(schedules.merge_params)
  for shape in ('linear', 'cosine', '1-sqrt'):
    wsd = schedules.wsd_schedule(lr, total, decay_steps=k, decay_shape=shape)
    # optax.sgd reads count t for the (t + 1)-th update.
    decayed = run(jax.jit(wsd)(jnp.arange(total)))
    merged = merge(ckpts, schedules.wsm_coefficients(k, shape))
    np.testing.assert_allclose(merged['w'], decayed[-1], rtol=1e-5,
                               atol=1e-6)


def test_merge_dtypes_and_streaming():
  trees = [{'w': jnp.full((3,), i, jnp.bfloat16), 'n': jnp.int32(7),
            'v': jnp.full((2,), 2.0 * i)} for i in range(4)]
  c = schedules.wsm_coefficients(3, 'cosine', 'midpoint')
  merged = jax.jit(schedules.merge_params)(trees, c)
  assert merged['w'].dtype == jnp.bfloat16 and merged['n'] == 7
  expect = float(np.dot(c, np.arange(4)))
  np.testing.assert_allclose(merged['v'], 2 * expect, rtol=1e-6)
  np.testing.assert_allclose(np.float32(merged['w']), expect, rtol=1e-2)
  acc = None
  for tree, cj in zip(trees, c):
    acc = schedules.accumulate_params(acc, {'v': tree['v']}, cj)
  assert acc['v'].dtype == jnp.float32
  np.testing.assert_allclose(acc['v'], merged['v'], rtol=1e-6)


def test_checkpoint_steps():
  assert schedules.wsm_checkpoint_steps(1000, 4, 50) == [800, 850, 900, 950,
                                                         1000]
