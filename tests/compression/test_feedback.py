"""Error feedback: EF, EF21 and EControl around any compressor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loc_opt import compression
from tests.compression._helpers import one_mean
from tests.compression._helpers import W


def test_error_feedback_invariant():
  ef = compression.error_feedback(compression.from_codec(
      compression.int8(block_size=16)))
  x = {'w': jnp.zeros((W, 64))}
  state = jax.vmap(ef.init)(x)
  for t in range(5):
    g = {'w': jax.random.normal(jax.random.key(t), (W, 64))}
    old = state.error['w']
    _, sent, state = one_mean(ef, g, state)
    # old buffer + new input == transmitted + new buffer
    np.testing.assert_allclose(old + g['w'], sent['w'] + state.error['w'],
                               rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(state.error['w']).max()) > 0


def test_error_feedback_sends_what_round_to_nearest_drops():
  """With EF, the running sum of transmitted values tracks the running sum
  of inputs to within one buffer, while plain RTN drifts."""
  codec = compression.int8(block_size=64)
  ef = compression.error_feedback(compression.from_codec(codec))
  x = jnp.full((W, 64), 1e-3).at[:, 0].set(1.0)  # 1e-3 rounds to zero
  state = jax.vmap(ef.init)({'w': x})
  total_sent = 0.
  for _ in range(20):
    _, sent, state = one_mean(ef, {'w': x}, state)
    total_sent = total_sent + sent['w']
  np.testing.assert_allclose(total_sent + state.error['w'], 20 * x,
                             rtol=1e-5)
  assert float(total_sent[0, 1]) > 0.5 * 20e-3  # the small entries got sent
  plain = compression.from_codec(codec)
  _, sent, _ = one_mean(plain, {'w': x}, jax.vmap(plain.init)({'w': x}))
  assert float(sent['w'][0, 1]) == 0.0


def test_econtrol_with_eta_zero_is_ef21():
  base = compression.from_codec(compression.int8(block_size=8))
  a, b = compression.ef21(base), compression.econtrol(base, eta=0.0)
  x = {'w': jnp.zeros((W, 32))}
  sa, sb = jax.vmap(a.init)(x), jax.vmap(b.init)(x)
  for t in range(4):
    g = {'w': jax.random.normal(jax.random.key(t), (W, 32))}
    ma, _, sa = one_mean(a, g, sa)
    mb, _, sb = one_mean(b, g, sb)
    # Two transforms' operations (eta = 0 zeroes a term): equal to float32
    # rounding.
    np.testing.assert_allclose(mb['w'], ma['w'], rtol=1e-6, atol=1e-7)
  with pytest.raises(ValueError, match='eta'):
    compression.econtrol(base, eta=2.0)


def test_ef21_estimate_converges_on_a_fixed_gradient():
  """EF21's shared estimate h approaches the true mean of a fixed gradient
  (it sends compressed *differences*, which shrink)."""
  ef21 = compression.ef21(compression.from_codec(
      compression.int8(block_size=8)))
  g = {'w': jax.random.normal(jax.random.key(0), (W, 32))}
  state = jax.vmap(ef21.init)(g)
  errs = []
  for _ in range(6):
    h, _, state = one_mean(ef21, g, state)
    errs.append(float(jnp.abs(h['w'][0] - g['w'].mean(0)).max()))
  assert errs[-1] < 1e-3 * errs[0] + 1e-6
