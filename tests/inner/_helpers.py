"""Helpers shared by the tests of loc_opt.inner.

* SPAM family: random gradients with spikes, eager runs of a transform, and
  the gradient-spike scenario that SPAM and Stable-SPAM are compared in.
* Matrix optimizers: NumPy test data, a compiled scan of updates, the matrix
  transform's state inside ``split_by_kind``, and the checks that every
  matrix optimizer passes (injected hyperparameters, trees without one kind
  of leaf, descent on least squares, running inside DiLoCo).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import loc_opt
from loc_opt import parallel
from tests import optax_conformance as conf

# ---------------------------------------------------------------------------
# SPAM family.
# ---------------------------------------------------------------------------


def random_grads(params, steps, seed=0, spikes=()):
  """A list of random gradient trees; steps in ``spikes`` are scaled 30x."""
  out = []
  for i in range(steps):
    g = conf.example_grads(params, 1000 * seed + i)
    if i in spikes:
      g = jax.tree.map(lambda x: 30.0 * x, g)
    out.append(g)
  return out


def run_updates(tx, params, grads, state=None):
  """Applies ``tx`` to each gradient at fixed params; returns the updates.

  Runs eagerly: for a few steps that is cheaper than compiling each
  transform, and the conformance suite checks that jit agrees.
  """
  state = tx.init(params) if state is None else state
  step = tx.update
  out = []
  for g in grads:
    u, state = step(g, state, params)
    out.append(u)
  return out, state


def assert_updates_close(a, b, rtol=1e-5, atol=1e-6):
  for x, y in zip(a, b):
    conf.assert_trees_close(x, y, rtol=rtol, atol=atol)


def check_mu_dtype(tx):
  """A bfloat16 first moment; the second stays float32."""
  params = conf.example_params()
  _, state = run_updates(tx, params, random_grads(params, 2))
  assert state.mu['w'].dtype == jnp.bfloat16
  assert state.nu['w'].dtype == jnp.float32


def leaf_grads(steps, shape=(5, 4), spikes=(6, 13, 17)):
  """Gradients of one leaf, 30x larger on the steps in ``spikes``."""
  out = []
  for i in range(steps):
    g = jax.random.normal(jax.random.fold_in(jax.random.key(5), i), shape)
    out.append(30.0 * g if i in spikes else g)
  return out


SPIKE_AT = 200


def spike_trajectory(tx, scale, steps=230):
  """Updates and (pre-update) states of a run with one spiked gradient."""
  params = {'w': jnp.zeros(64)}

  def body(state, i):
    g = jax.random.normal(jax.random.fold_in(jax.random.key(3), i), (64,))
    g = jnp.where(i == SPIKE_AT, scale * g, g)
    u, new_state = tx.update({'w': g}, state, params)
    return new_state, (u['w'], state)

  _, (ups, states) = jax.lax.scan(body, tx.init(params), jnp.arange(steps))
  return ups, states[0]  # The direction's state in the chain.


def spike_runs(txs):
  """``{name: {scale: (updates, states)}}`` for spikes of 1, 1e3 and 1e6."""
  out = {}
  for name, tx in txs.items():
    run = jax.jit(functools.partial(spike_trajectory, tx))
    out[name] = {s: jax.tree.map(np.asarray, run(s)) for s in (1.0, 1e3, 1e6)}
  return out


def spike_entered(runs, name, scale, i=SPIKE_AT):
  """The gradient that reached the first moment on step ``i``."""
  mu = runs[name][scale][1].mu['w']  # mu[i]: before update i.
  return (mu[i + 1] - 0.9 * mu[i]) / 0.1


def spike_entered_norm(runs, name, scale, i=SPIKE_AT):
  return np.linalg.norm(spike_entered(runs, name, scale, i))


def spike_displacements(runs):
  """``{name: net displacement caused by a 1e3 spike after it}``."""
  out = {}
  for name, run in runs.items():
    spiked, _ = run[1e3]
    base, _ = run[1.0]
    out[name] = np.linalg.norm((spiked - base)[SPIKE_AT:].sum(0))
  return out


# ---------------------------------------------------------------------------
# Matrix optimizers. Test data come from NumPy: compiling JAX's PRNG for
# every test is slow.
# ---------------------------------------------------------------------------


def normal(shape, seed):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def tree(shapes, seed, lead=()):
  return {k: normal(lead + s, seed + i)
          for i, (k, s) in enumerate(sorted(shapes.items()))}


MANY = {'a': (5, 3), 'c': (3, 4), 'e': (2, 3, 2), 'b': (3,)}


def core(state):
  """The matrix transform's state inside ``split_by_kind(...)``'s state."""
  return state.inner_states['matrix'].inner_state


def inner(state):
  """The matrix transform's state inside an alias ``chain(scale_by_...)``."""
  return core(state[0])


def run(tx, params, grads):
  """Init and one update per gradient, in one compiled scan.

  Args:
    tx: the transform.
    params: initial parameters.
    grads: a tree of gradients stacked along a leading step axis, or a pair
      ``(fn, steps)`` with ``fn(params) -> grads``.

  Returns:
    Final params, final state, and the updates and states of every step
    (stacked along a leading axis).
  """
  if isinstance(grads, tuple):
    fn, steps = grads
    xs = jnp.arange(steps)
  else:
    fn, xs = None, grads

  @jax.jit
  def run_scan(params, xs):
    def body(carry, x):
      params, state = carry
      g = x if fn is None else fn(params)
      updates, state = tx.update(g, state, params)
      return (optax.apply_updates(params, updates), state), (updates, state)

    (params, state), (updates, states) = jax.lax.scan(
        body, (params, tx.init(params)), xs)
    return params, state, updates, states

  return run_scan(params, xs)


def check_injectable(factory, static=(), **kwargs):
  """Every numeric hyperparameter of ``factory`` can be injected.

  ``eval_shape`` traces init like ``jax.jit`` does: injected values are
  tracers.
  """
  params = tree({'w': (4, 3), 'b': (3,)}, 0)
  tx = optax.inject_hyperparams(factory, static_args=static)(
      learning_rate=0.1, **kwargs)
  state = jax.eval_shape(tx.init, params)
  jax.eval_shape(tx.update, params, state, params)


def check_trees_without_matrices_or_vectors(make):
  """``make(learning_rate)`` handles trees with only one kind of leaf."""
  tx = make(0.1)
  for params in ({'b': np.ones(3, np.float32)},
                 {'w': np.ones((3, 2), np.float32)}):
    state = jax.eval_shape(tx.init, params)
    updates, _ = jax.eval_shape(tx.update, params, state, params)
    assert jax.tree.map(lambda x: x.shape, updates) == jax.tree.map(
        np.shape, params)


def check_descent_on_least_squares(tx):
  """50 steps of ``tx`` cut a least-squares loss tenfold."""
  x = normal((32, 8), 11)
  y = x @ normal((8, 4), 12) + 0.5

  def loss(params):
    return jnp.mean((x @ params['w'] + params['b'] - y) ** 2)

  params = {'w': np.zeros((8, 4), np.float32), 'b': np.zeros(4, np.float32)}
  final, _, _, _ = run(tx, params, (jax.grad(loss), 50))
  assert loss(final) < 0.1 * loss(params), (loss(params), loss(final))


def check_inside_diloco(inner_tx):
  """``inner_tx`` inside DiLoCo, under vmap over two workers."""
  workers, steps = 2, 4
  tx = loc_opt.diloco(inner_tx, sync_every=2)

  def loss(params, batch):
    x, y = batch
    return jnp.mean((x @ params['w'] + params['b'] - y) ** 2)

  def step(params, state, batch):
    updates, state = tx.update(jax.grad(loss)(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  @jax.jit
  def run_workers(params, batches):
    state = jax.vmap(tx.init)(params)

    def body(carry, batch):
      params, state = parallel.vmap_workers(step)(*carry, batch)
      return (params, state), params

    return jax.lax.scan(body, (params, state), batches)[1]

  params = jax.tree.map(lambda x: np.broadcast_to(x, (workers,) + x.shape),
                        tree({'w': (4, 3), 'b': (3,)}, 0))
  batches = (normal((steps, workers, 8, 4), 13),
             normal((steps, workers, 8, 3), 14))
  history = run_workers(params, batches)
  for i in range(steps):
    leaves = [np.asarray(x[i]) for x in jax.tree.leaves(history)]
    assert all(np.all(np.isfinite(leaf)) for leaf in leaves)
    same = [np.allclose(leaf[0], leaf[1], atol=1e-6) for leaf in leaves]
    if i % 2 == 1:  # Workers agree right after each sync.
      assert all(same)
    else:
      assert not all(same)
