"""Tests of SWAN, FRUGAL, Fira, Dion and Drop-Muon (loc_opt.inner)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import parallel
from loc_opt import inner
from loc_opt.inner import _matrix
from tests import optax_conformance as conf

# Small variants that exercise the low-rank and periodic paths on the
# conformance tree ({'w': (4, 3), 'b': (3,)}).
MAKERS = {
    'swan': inner.swan,
    'frugal': functools.partial(inner.frugal, update_gap=2,
                                projector='columns', rank=2),
    'fira': functools.partial(inner.fira, update_proj_gap=2, rank=2),
    'dion': functools.partial(inner.dion, rank=2),
    'drop_muon': inner.drop_muon,
}

# Test data come from NumPy: compiling JAX's PRNG for every test is slow.


def _normal(shape, seed):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _tree(shapes, seed, lead=()):
  return {k: _normal(lead + s, seed + i)
          for i, (k, s) in enumerate(sorted(shapes.items()))}


MANY = {'a': (5, 3), 'c': (3, 4), 'e': (2, 3, 2), 'b': (3,)}


def _core(state):
  """The matrix transform's state inside ``split_by_kind(...)``'s state."""
  return state.inner_states['matrix'].inner_state


def _inner(state):
  """The matrix transform's state inside an alias ``chain(scale_by_...)``."""
  return _core(state[0])


def _run(tx, params, grads):
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
  def run(params, xs):
    def body(carry, x):
      params, state = carry
      g = x if fn is None else fn(params)
      updates, state = tx.update(g, state, params)
      return (optax.apply_updates(params, updates), state), (updates, state)

    (params, state), (updates, states) = jax.lax.scan(
        body, (params, tx.init(params)), xs)
    return params, state, updates, states

  return run(params, xs)


@pytest.mark.parametrize('name', sorted(MAKERS))
def test_conformance(name, tmp_path):
  make = MAKERS[name]
  conf.check_all(lambda learning_rate: make(learning_rate), tmp_path)


def test_every_numeric_hyperparameter_can_be_injected():
  # eval_shape traces init like jax.jit does: injected values are tracers.
  params = _tree({'w': (4, 3), 'b': (3,)}, 0)
  cases = [(inner.swan, {}, ()),
           (inner.frugal, {}, ()),
           (inner.frugal, dict(projector='svd', rank=2), ('rank',)),
           (inner.fira, dict(rank=2), ('rank',)),
           (inner.dion, dict(rank=2), ('rank',)),
           (inner.drop_muon, {}, ())]
  for factory, kw, static in cases:
    tx = optax.inject_hyperparams(factory, static_args=static)(
        learning_rate=0.1, **kw)
    state = jax.eval_shape(tx.init, params)
    jax.eval_shape(tx.update, params, state, params)
  tx = optax.inject_hyperparams(inner.fira)(learning_rate=0.1, rank=2)
  with pytest.raises(ValueError, match=r"static_args=\('rank',\)"):
    jax.eval_shape(tx.init, params)


@pytest.mark.parametrize('name', sorted(MAKERS))
def test_trees_without_matrices_or_without_vectors(name):
  tx = MAKERS[name](0.1)
  for params in ({'b': np.ones(3, np.float32)},
                 {'w': np.ones((3, 2), np.float32)}):
    state = jax.eval_shape(tx.init, params)
    updates, _ = jax.eval_shape(tx.update, params, state, params)
    assert jax.tree.map(lambda x: x.shape, updates) == jax.tree.map(
        np.shape, params)


# SWAN.


def _swan(g, **kw):
  tx = inner.scale_by_swan(**kw)
  return jax.jit(tx.update)({'w': g}, tx.init({'w': g}))[0]['w']


@pytest.mark.parametrize('whitening,tol', [('newton_schulz', 1e-3),
                                           ('exact', 1e-5)])
def test_swan_update_is_orthogonal(whitening, tol):
  # fan_in 8 > fan_out 4: the centered gradient keeps full column rank, so
  # the update has orthonormal columns.
  u = _swan(_normal((8, 4), 0), whitening=whitening)
  np.testing.assert_allclose(u.T @ u, np.eye(4), atol=tol)


def test_swan_wide_update_is_orthogonal_off_the_mean_direction():
  # fan_in 4 < fan_out 8: centering each column over the 4 inputs removes
  # the all-ones input direction, so U U^T = I - 11^T/4.
  u = _swan(_normal((4, 8), 1), whitening='exact')
  np.testing.assert_allclose(u @ u.T, np.eye(4) - np.ones((4, 4)) / 4,
                             atol=1e-4)


def test_swan_is_polar_factor_of_standardized_gradient():
  g = _normal((8, 4), 2)
  scale = np.array([0.5, 2.0, 3.0, 7.0], np.float32)
  shift = np.array([1.0, -2.0, 0.0, 4.0], np.float32)
  u1 = _swan(g, whitening='exact')
  np.testing.assert_allclose(_swan(g * scale + shift, whitening='exact'), u1,
                             atol=1e-5)
  x = g.astype(np.float64)
  x = (x - x.mean(0)) / x.std(0)
  uu, _, vt = np.linalg.svd(x, full_matrices=False)
  np.testing.assert_allclose(u1, uu @ vt, atol=1e-5)
  # 'fan_out' standardizes each row; that leaves rank 3 here.
  u3 = _swan(g + np.arange(8.0, dtype=np.float32)[:, None],
             whitening='exact', norm_over='fan_out')
  x = g.astype(np.float64)
  x = (x - x.mean(1, keepdims=True)) / x.std(1, keepdims=True)
  uu, _, vt = np.linalg.svd(x, full_matrices=False)
  np.testing.assert_allclose(u3, uu[:, :3] @ vt[:3], atol=1e-4)


def test_swan_fallback_and_quintic():
  params = {'w': np.ones((6, 3), np.float32), 'b': np.ones(3, np.float32)}
  grads = {'w': _normal((6, 3), 3), 'b': np.array([1.0, -2.0, 0.5])}
  tx = inner.scale_by_swan(whitening='quintic',
                              fallback=optax.scale_by_sign())
  u, _ = jax.jit(tx.update)(grads, tx.init(params))
  np.testing.assert_array_equal(u['b'], [1.0, -1.0, 1.0])
  s = np.linalg.svd(np.asarray(u['w']), compute_uv=False)
  assert 0.6 < s.min() and s.max() < 1.3, s


# FRUGAL.


def test_frugal_full_subspace_is_adam():
  params, grads = _tree(MANY, 0), _tree(MANY, 10, (7,))
  tx = inner.frugal(1e-2, density=1.0, update_gap=3)
  got, state, _, _ = _run(tx, params, grads)
  want, _, _, _ = _run(optax.adam(1e-2), params, grads)
  conf.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
  assert all(jax.tree.leaves(_inner(state).active))


def test_frugal_empty_subspace_is_sign_sgd():
  # (The SGD state-free rule is checked in the SVD test below.)
  params, grads = _tree(MANY, 0), _tree(MANY, 10, (3,))
  tx = inner.frugal(0.1, density=0.0, free_scale=0.5)
  _, state, updates, _ = _run(tx, params, grads)
  for k in ('a', 'c', 'e'):
    np.testing.assert_allclose(updates[k], -0.05 * np.sign(grads[k]))
  assert not any(jax.tree.leaves(_inner(state).active))


def test_frugal_blockwise_picks_density_of_leaves_per_period():
  params, grads = _tree(MANY, 0), _tree(MANY, 10, (9,))
  tx = inner.scale_by_frugal(density=0.5, update_gap=3)
  _, _, _, states = _run(tx, params, grads)
  active = np.stack(jax.tree.leaves(_core(states).active), axis=1)  # (9, 3)
  picks = [tuple(row) for row in active]
  assert all(sum(p) == 2 for p in picks)  # round(0.5 * 3) of 3 leaves.
  assert picks[0] == picks[1] == picks[2] and picks[3] == picks[5]
  assert len(set(picks)) > 1


def test_frugal_svd_splits_subspace_and_residual():
  # The (5, 3) leaf is tall: the basis spans r directions of the 3 columns.
  params, grads = {'w': np.zeros((5, 3), np.float32)}, _tree({'w': (5, 3)},
                                                               1, (4,))
  tx = inner.scale_by_frugal(projector='svd', rank=1, free_scale=0.3,
                                  free_update='sgd', update_gap=2)
  _, state, updates, states = _run(tx, params, grads)
  bases = np.asarray(_core(states).basis['w'])  # (4, 3, 1)
  for i in range(4):
    complement = np.eye(3) - bases[i] @ bases[i].T
    # Outside the subspace: the state-free SGD step, scaled.
    np.testing.assert_allclose(np.asarray(updates['w'][i]) @ complement,
                               0.3 * grads['w'][i] @ complement, atol=1e-6)
  assert _core(state).mu['w'].shape == (5, 1)
  # Refreshed on steps 0 and 2 (an SVD of that step's gradient), kept else.
  np.testing.assert_array_equal(bases[0], bases[1])
  np.testing.assert_array_equal(bases[2], bases[3])
  top = np.linalg.svd(grads['w'][2])[2][0]
  np.testing.assert_allclose(np.abs(bases[2][:, 0] @ top), 1.0, atol=1e-5)
  # Moments reset at the refresh on step 2.
  np.testing.assert_array_equal(_core(states).moment_count['w'], [1, 2, 1, 2])


# Fira.


def test_fira_full_rank_is_adam_in_rotated_coordinates():
  # A tall leaf (projected on the right) and a wide one (on the left).
  shapes = {'t': (4, 3), 'w': (3, 5), 'b': (3,)}
  params, grads = _tree(shapes, 0), _tree(shapes, 2, (5,))
  tx = inner.scale_by_fira(update_proj_gap=1000, scale=1.0, eps=1e-12,
                              rank=8)
  _, _, updates, states = _run(tx, params, grads)
  core = _core(states)
  for k in ('t', 'w'):
    shape = shapes[k]
    q = np.asarray(core.basis[k][0])  # Fixed after the first step.
    assert q.shape == (min(shape), min(shape))
    np.testing.assert_allclose(q.T @ q, np.eye(min(shape)), atol=1e-5)
    np.testing.assert_array_equal(core.basis[k][-1], q)
    tall = shape[0] >= shape[1]
    rotated = (grads[k] if tall else grads[k].transpose(0, 2, 1)) @ q
    _, _, want, _ = _run(optax.scale_by_adam(eps=1e-12),
                         np.zeros(rotated.shape[1:], np.float32), rotated)
    want = np.asarray(want) @ q.T
    np.testing.assert_allclose(updates[k],
                               want if tall else want.transpose(0, 2, 1),
                               atol=1e-5)
    assert np.all(core.residual_norm[k] < 1e-4)


def test_fira_low_rank_residual_and_compat_mode():
  params, g = {'w': np.zeros((6, 4), np.float32)}, {'w': _normal((6, 4), 4)}

  def first_update(**kw):
    tx = inner.scale_by_fira(update_proj_gap=10, rank=1, **kw)
    return jax.jit(tx.update)(g, tx.init(params))

  u_clean, state = first_update(scale=0.25)
  u_compat, _ = first_update(scale=0.25, reference_compat=True)
  q = np.asarray(_core(state).basis['w'], np.float64)
  gw = g['w'].astype(np.float64)
  # First step: m = (1-b1) R, v = (1-b2) R^2, N = m / (sqrt(v) + eps),
  # phi_i = ||N_i|| / ||R_i|| (rank 1: absolute values).
  low = gw @ q
  n = 0.1 * low / (np.sqrt(0.001) * np.abs(low) + 1e-6)
  phi = np.abs(n) / (np.abs(low) + 1e-8)
  factor = np.sqrt(0.001) / 0.1  # sqrt(1 - b2) / (1 - b1).
  want = factor * (0.25 * n @ q.T + (gw - low @ q.T) * phi)
  np.testing.assert_allclose(u_clean['w'], want, rtol=1e-4, atol=1e-6)
  # Compat leaks (1 - alpha) of the in-subspace gradient into the residual.
  leak = factor * (1 - 0.25) * (low @ q.T) * phi
  np.testing.assert_allclose(u_compat['w'], want + leak, rtol=1e-4,
                             atol=1e-6)
  # With alpha = 1 the two modes agree.
  np.testing.assert_allclose(
      first_update(scale=1.0)[0]['w'],
      first_update(scale=1.0, reference_compat=True)[0]['w'])


def test_fira_limiter_caps_residual_growth():
  params = {'w': np.zeros((6, 4), np.float32)}
  g0 = _normal((6, 4), 5)
  q = np.asarray(_matrix.top_right_singular_vectors(g0, 1))  # Step 0 basis.
  # Grow only the part outside the (fixed) subspace: R, N and phi stay put
  # while the raw residual grows tenfold per step.
  e = _normal((6, 4), 6)
  e = e - e @ q @ q.T
  grads = {'w': np.stack([g0 + (10.0 ** i if i else 0.0) * e
                          for i in range(4)])}
  tx = inner.scale_by_fira(update_proj_gap=1000, rank=1,
                              limiter_gamma=1.01)
  _, _, _, states = _run(tx, params, grads)
  norms = np.asarray(_core(states).residual_norm['w'])
  np.testing.assert_allclose(norms[1:] / norms[:-1], 1.01, rtol=1e-4)


# Dion.


def test_dion_rank_r_gradient_gives_orthonormal_basis_of_its_spaces():
  left = np.linalg.qr(_normal((8, 2), 7))[0]
  right = np.linalg.qr(_normal((6, 2), 8))[0]
  g = (left @ np.diag([3.0, 1.0]) @ right.T).astype(np.float32)  # Rank 2.
  params = {'w': np.zeros((8, 6), np.float32)}
  tx = inner.scale_by_dion(rank=2)
  _, state, updates, _ = _run(tx, params, {'w': np.stack([g] * 8)})
  core = _core(state)
  assert core.basis['w'].shape == (8, 2) and core.momentum['w'].shape == (8, 6)
  scale = np.sqrt(6 / 8)  # sqrt(fan_out / fan_in).
  for w in np.asarray(updates['w'], np.float64) / scale:
    # Column space of g on the left, row space of g on the right; rank 2.
    np.testing.assert_allclose(left @ left.T @ w @ right @ right.T, w,
                               atol=1e-5)
    s = np.linalg.svd(w, compute_uv=False)
    assert s[1] > 0.1 and s[2] < 1e-5
  # Warm-started power iteration: orthonormal, the polar factor of g.
  np.testing.assert_allclose(w.T @ w, right @ right.T, atol=1e-5)
  np.testing.assert_allclose(w, left @ right.T, atol=1e-5)
  # Error feedback keeps mu of the captured part: M_t = mu (M_{t-1} + G).
  np.testing.assert_allclose(core.momentum['w'], 0.95 / 0.05 * g * (
      1 - 0.95 ** 8), rtol=1e-4, atol=1e-5)


def test_dion_rank_and_orientation():
  shapes = {'a': (3, 7), 'c': (2, 3, 5), 'b': (3,)}
  params = _tree(shapes, 0)
  core = _core(inner.scale_by_dion(rank=2).init(params))
  assert core.basis['a'].shape == (3, 2)
  assert core.basis['c'].shape == (6, 2)
  tx = inner.scale_by_dion(rank_fraction=0.5)
  core = _core(tx.init(params))
  assert core.basis['a'].shape == (3, 2) and core.basis['c'].shape == (6, 3)
  updates, _ = jax.jit(tx.update)(_tree(shapes, 1), tx.init(params))
  assert jax.tree.map(np.shape, updates) == shapes


# Drop-Muon.


def test_drop_muon_without_drops_is_muon():
  shapes = {k: v for k, v in MANY.items() if k != 'e'}  # Muon: 2-D only.
  params, grads = _tree(shapes, 0), _tree(shapes, 10, (5,))
  tx = inner.drop_muon(0.02, drop_prob=0.0, sampler='bernoulli')
  got, _, _, _ = _run(tx, params, grads)
  want, _, _, _ = _run(optax.contrib.muon(0.02), params, grads)
  conf.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


def test_drop_muon_bernoulli_fraction_and_frozen_layers():
  params, grads = _tree(MANY, 0), _tree(MANY, 10)
  tx = inner.scale_by_drop_muon(drop_prob=0.3, sampler='bernoulli')

  @jax.jit
  def run(params, grads):
    def body(state, _):
      updates, new = tx.update(grads, state, params)
      zero = jnp.stack([jnp.all(u == 0) for u in jax.tree.leaves(updates)])
      same = jnp.stack([
          jnp.all(jnp.stack([jnp.all(a == b) for a, b in zip(
              jax.tree.leaves(s_new), jax.tree.leaves(s_old))]))
          for s_new, s_old in zip(new.inner_states, state.inner_states)])
      return new, (new.active, zero, same)

    _, out = jax.lax.scan(body, tx.init(params), length=300)
    return out

  active, zero, same = (np.asarray(x) for x in run(params, grads))
  # Each leaf is its own layer: inactive ones emit zeros and keep state.
  assert np.all(zero[~active]) and np.all(same[~active])
  assert not np.any(zero[active])
  assert abs(active.mean() - 0.7) < 0.05, active.mean()


def test_drop_muon_progressive_activates_suffixes():
  shapes = {'l0': (3, 3), 'l1': (3, 3), 'l2': (3, 3), 'l2_bias': (3,)}
  layers = {'l0': 0, 'l1': 1, 'l2': 2, 'l2_bias': 2}
  tx = inner.scale_by_drop_muon(layers=layers)
  grads = jax.tree.map(lambda x: np.broadcast_to(x, (300,) + x.shape),
                       _tree(shapes, 1))
  _, _, _, states = _run(tx, _tree(shapes, 0), grads)
  active = np.asarray(states.active)  # (300, 3)
  assert np.all(np.diff(active.astype(int), axis=1) >= 0)  # Suffixes.
  # P(layer i active) = P(start <= i) = (i + 1) / 3.
  np.testing.assert_allclose(active.mean(0), [1 / 3, 2 / 3, 1.0], atol=0.07)


# Descent on least squares.

DESCENT = {
    'swan': functools.partial(inner.swan, 0.1),
    'frugal': functools.partial(inner.frugal, 0.1, density=0.5,
                                update_gap=10, projector='svd'),
    'fira': functools.partial(inner.fira, 0.2, rank=2,
                              update_proj_gap=10),
    'dion': functools.partial(inner.dion, 0.1, rank=2),
    'drop_muon': functools.partial(inner.drop_muon, 0.1),
}


@pytest.mark.parametrize('name', sorted(DESCENT))
def test_descent_on_least_squares(name):
  x = _normal((32, 8), 11)
  y = x @ _normal((8, 4), 12) + 0.5

  def loss(params):
    return jnp.mean((x @ params['w'] + params['b'] - y) ** 2)

  params = {'w': np.zeros((8, 4), np.float32), 'b': np.zeros(4, np.float32)}
  final, _, _, _ = _run(DESCENT[name](), params, (jax.grad(loss), 50))
  assert loss(final) < 0.1 * loss(params), (loss(params), loss(final))


# Inside DiLoCo, under vmap over workers.


@pytest.mark.parametrize('name', ['dion', 'drop_muon'])
def test_inside_diloco(name):
  workers, steps = 2, 4
  tx = loc_opt.diloco(MAKERS[name](1e-2), sync_every=2)

  def loss(params, batch):
    x, y = batch
    return jnp.mean((x @ params['w'] + params['b'] - y) ** 2)

  def step(params, state, batch):
    updates, state = tx.update(jax.grad(loss)(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  @jax.jit
  def run(params, batches):
    state = jax.vmap(tx.init)(params)

    def body(carry, batch):
      params, state = parallel.vmap_workers(step)(*carry, batch)
      return (params, state), params

    return jax.lax.scan(body, (params, state), batches)[1]

  params = jax.tree.map(lambda x: np.broadcast_to(x, (workers,) + x.shape),
                        _tree({'w': (4, 3), 'b': (3,)}, 0))
  batches = (_normal((steps, workers, 8, 4), 13),
             _normal((steps, workers, 8, 3), 14))
  history = run(params, batches)
  for i in range(steps):
    leaves = [np.asarray(x[i]) for x in jax.tree.leaves(history)]
    assert all(np.all(np.isfinite(leaf)) for leaf in leaves)
    same = [np.allclose(leaf[0], leaf[1], atol=1e-6) for leaf in leaves]
    if i % 2 == 1:  # Workers agree right after each sync.
      assert all(same)
    else:
      assert not all(same)


def test_swan_newton_schulz_runs_inside_the_worker_shard_map():
  """The Newton-Schulz loop carries an identity that must be typed as
  varying over the worker axis like the gradient it multiplies."""
  mesh = parallel.make_worker_mesh(4, data=2)
  tx = loc_opt.diloco(inner.swan(1e-2), sync_every=2)
  params = {'w': jnp.ones((4, 16, 8)), 'b': jnp.zeros((4, 8))}
  sharding = jax.NamedSharding(mesh, jax.P('worker'))
  params = jax.device_put(params, sharding)
  grads = jax.device_put(jax.tree.map(
      lambda p: jax.random.normal(jax.random.key(0), p.shape), params),
      sharding)
  state = jax.jit(jax.vmap(tx.init))(params)
  step = jax.jit(parallel.shard_map_workers(tx.update, mesh))
  updates, _ = step(grads, state, params)
  want, _ = jax.jit(jax.vmap(tx.update, axis_name='worker'))(
      grads, state, params)
  np.testing.assert_allclose(updates['w'], want['w'], rtol=1e-4, atol=1e-6)
