import jax
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


@pytest.mark.parametrize('name', sorted(inner.OPTIMIZERS))
def test_every_registered_optimizer_steps_under_jit_and_diloco(name):
  """Each name builds through make_optimizer (injected hyperparameters,
  shape-setting ints kept static), jits, lowers the loss of a small least
  squares problem, and runs as DiLoCo's inner optimizer on 2 workers."""
  import loc_opt  # pylint: disable=g-import-not-at-top
  kwargs = {'rank': 4} if name in ('fira', 'dion') else {}
  lr = 0.05 if name not in ('sgd', 'momentum', 'schedule_free_sgd') else 0.01
  tx = inner.make_optimizer(name, lr, grad_clip_norm=1.0, **kwargs)
  a = jax.random.normal(jax.random.key(0), (32, 16))
  target = jax.random.normal(jax.random.key(1), (32, 8))

  def loss(p):
    return jnp.mean((a @ p['w'] + p['b'] - target) ** 2)

  params = {'w': jnp.zeros((16, 8)), 'b': jnp.zeros(8)}

  @jax.jit
  def step(p, s):
    g = jax.grad(loss)(p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  state = jax.jit(tx.init)(params)
  first = float(loss(params))
  for _ in range(30):
    params, state = step(params, state)
  assert float(loss(params)) < first, name

  outer = loc_opt.diloco(tx, sync_every=2)
  p2 = jax.tree.map(lambda x: jnp.stack([x, x]), params)
  s2 = jax.vmap(outer.init)(p2)
  g2 = jax.tree.map(lambda x: jnp.stack([x, -0.5 * x]), jax.grad(loss)(params))
  run = jax.jit(jax.vmap(outer.update, axis_name='worker'))
  for _ in range(2):
    u2, s2 = run(g2, s2, p2)
    p2 = optax.apply_updates(p2, u2)
  for x in jax.tree.leaves(s2.anchor):  # the sync gave one anchor
    np.testing.assert_array_equal(x[0], x[1])
