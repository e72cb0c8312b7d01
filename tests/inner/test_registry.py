import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loc_opt import inner


def test_make_optimizer_matches_optax_with_clipping():
  params = {'w': jnp.array([1.0, -2.0])}
  grads = {'w': jnp.array([30.0, 40.0])}  # norm 50 -> clipped to norm 1
  tx = inner.make_optimizer('sgd', 0.1, grad_clip_norm=1.0)
  u, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(u['w'], [-0.06, -0.08], rtol=1e-6)
  tx = inner.make_optimizer('adamw', 1e-3, b2=0.95, weight_decay=0.1)
  ref = optax.adamw(1e-3, b2=0.95, weight_decay=0.1)
  u, _ = tx.update(grads, tx.init(params), params)
  r, _ = ref.update(grads, ref.init(params), params)
  np.testing.assert_allclose(u['w'], r['w'], rtol=1e-6)


def test_unknown_optimizer_and_bad_fields():
  with pytest.raises(ValueError, match='optimizer.name'):
    inner.make_optimizer('adamz', 1e-3)
  with pytest.raises(ValueError, match='grad_clip_norm'):
    inner.make_optimizer('sgd', 1e-3, grad_clip_norm=-1.0)
  with pytest.raises(ValueError, match='bad hyperparameters'):
    inner.make_optimizer('sgd', 1e-3, beta=0.3)
