"""Tests of SPAM (loc_opt.inner.spam) and its sparse momentum.

Conformance, equivalences with simpler methods when features are off, a
literal NumPy transcription of the reference algorithm, the spec's test
vectors (spec §5) and a gradient-spike scenario.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import parallel
from loc_opt.inner import clipping
from loc_opt.inner.spam import scale_by_spam
from loc_opt.inner.spam import spam
from loc_opt.inner.spam import spam_warmup_factor
from tests import optax_conformance as conf
from tests.inner import _helpers as helpers

INF = float('inf')

# ---------------------------------------------------------------------------
# Conformance.
# ---------------------------------------------------------------------------

SMALL_SPAM = dict(threshold=2.0, reset_interval=3, warmup_steps=2,
                  clip_delay=1)


# The example params have a 2-D leaf (sparse momentum at density 0.5) and a
# 1-D leaf (dense), so the case covers both kinds of leaf. Resets and
# re-warmups fall inside the conformance suite's few steps.
def test_conformance(tmp_path):
  conf.check_all(functools.partial(spam, **SMALL_SPAM, weight_decay=0.1,
                                   density=0.5), tmp_path)


def test_conformance_spam_compat():
  """The compat paths (Bernoulli masks, post-update decay) under jit."""
  make = functools.partial(spam, **SMALL_SPAM, density=0.5,
                           weight_decay=0.1, reference_compat=True)
  conf.check_no_recompile(make)
  conf.check_dtypes(make)
  conf.check_sharding_stable(make)


def test_spam_inside_diloco_under_vmap():
  """SPAM as DiLoCo's inner optimizer, two workers simulated by vmap."""
  inner = spam(1e-2, **SMALL_SPAM)
  tx = loc_opt.diloco(inner, sync_every=2, outer=optax.sgd(1.0))
  m, steps = 2, 4

  def loss(params, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params['w']) + params['b'] - y) ** 2)

  def batches(step):
    kx, ky = jax.random.split(jax.random.fold_in(jax.random.key(7), step))
    return jax.random.normal(kx, (m, 8, 4)), jax.random.normal(ky, (m, 8, 3))

  def step(params, state, batch):
    updates, state = tx.update(jax.grad(loss)(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  start = jax.tree.map(lambda x: jnp.broadcast_to(x, (m,) + x.shape),
                       conf.example_params())
  params, state = start, jax.vmap(tx.init)(start)
  fn = jax.jit(parallel.vmap_workers(step))
  for i in range(steps):
    params, state = fn(params, state, batches(i))
  assert int(state.num_syncs[0]) == 2

  # By hand: SPAM per worker; an identity outer step makes the anchor the
  # workers' mean, which the workers restart from (inner state kept).
  def local(params, state, batch):
    updates, state = inner.update(jax.grad(loss)(params, batch), state,
                                  params)
    return optax.apply_updates(params, updates), state

  local = jax.jit(jax.vmap(local))
  want, inner_state = start, jax.vmap(inner.init)(start)
  for i in range(steps):
    want, inner_state = local(want, inner_state, batches(i))
    if i % 2 == 1:
      want = jax.tree.map(
          lambda x: jnp.broadcast_to(x.mean(0), x.shape), want)
  conf.assert_trees_close(params, want)
  conf.assert_trees_close(state.anchor, want)


# ---------------------------------------------------------------------------
# Equivalences.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('compat', [False, True])
def test_spam_without_resets_or_clipping_is_adam(compat):
  params = conf.example_params()
  grads = helpers.random_grads(params, 8)
  got, _ = helpers.run_updates(
      spam(1e-2, eps=1e-12, threshold=INF, reset_interval=10**9,
           reference_compat=compat), params, grads)
  # Epsilon enters differently (added to the uncorrected sqrt(v) in SPAM),
  # so compare at a negligible epsilon.
  want, _ = helpers.run_updates(optax.adam(1e-2, eps=1e-12), params, grads)
  helpers.assert_updates_close(got, want, rtol=2e-5, atol=1e-7)
  # threshold 0 also switches the clip off, and the decay is AdamW's.
  got, _ = helpers.run_updates(
      spam(1e-2, eps=1e-12, threshold=0.0, reset_interval=0,
           weight_decay=0.1), params, grads)
  want, _ = helpers.run_updates(
      optax.adamw(1e-2, eps=1e-12, weight_decay=0.1), params, grads)
  helpers.assert_updates_close(got, want, rtol=2e-5, atol=1e-7)


def test_spam_clip_equals_clip_piece_then_adam():
  params = conf.example_params()
  grads = helpers.random_grads(params, 10, spikes=(4, 7))
  got, _ = helpers.run_updates(
      scale_by_spam(eps=1e-10, threshold=3.0, reset_interval=0,
                    clip_delay=3), params, grads)
  want, _ = helpers.run_updates(optax.chain(
      clipping.clip_by_moment_ratio(3.0, b2=0.999, delay=2),
      optax.scale_by_adam(eps=1e-10)), params, grads)
  helpers.assert_updates_close(got, want)
  # The spikes were clipped, so this test is not about plain Adam.
  adam, _ = helpers.run_updates(optax.scale_by_adam(eps=1e-10), params, grads)
  assert not np.allclose(got[4]['w'], adam[4]['w'], rtol=1e-3)


# ---------------------------------------------------------------------------
# A literal NumPy transcription of the reference algorithm (spec §A1).
# ---------------------------------------------------------------------------


def spam_reference(grads, *, b1, b2, eps, theta, interval, warmup, delay):
  """SPAM as the reference steps it, with its own warmup counter j."""
  m = v = np.zeros_like(grads[0], np.float64)
  k, s, j, out = 0, 0, warmup + 1, []
  for g in grads:
    g = np.asarray(g, np.float64)
    if (k + 1) % interval == 0:
      m, v = 0 * m, 0 * v
    s += 1
    if theta > 0 and k + 1 >= delay and (k + 1) % interval >= delay:
      flag = g**2 > theta * v
      g = np.where(flag, np.sign(g) * np.sqrt(theta * v), g)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g**2
    step_size = math.sqrt(1 - b2**s) / (1 - b1**s)
    phi = (1 - 0.99 * (1 + math.cos(math.pi * j / (warmup + 1))) / 2
           if j < warmup else 1.0)
    out.append(phi * step_size * m / (np.sqrt(v) + eps))
    j = 0 if (k + 2) % interval == 0 else j + 1
    k += 1
  return out


@pytest.mark.parametrize('compat', [False, True])
def test_spam_matches_reference_transcription(compat):
  hp = dict(b1=0.9, b2=0.99, eps=1e-6)
  ours = dict(threshold=3.0, reset_interval=7, warmup_steps=4, clip_delay=2)
  grads = helpers.leaf_grads(24)
  want = spam_reference([np.asarray(g) for g in grads], theta=3.0,
                        interval=7, warmup=4, delay=2, **hp)
  got, _ = helpers.run_updates(
      scale_by_spam(**hp, **ours, reference_compat=compat),
      {'w': grads[0]}, [{'w': g} for g in grads])
  for i, (u, w) in enumerate(zip(got, want)):
    np.testing.assert_allclose(u['w'], w, rtol=2e-5, atol=1e-7,
                               err_msg=f'step {i}')
  # The run did clip and warm up: a plain Adam trajectory differs.
  plain = spam_reference([np.asarray(g) for g in grads], theta=0.0,
                         interval=10**9, warmup=0, delay=0, **hp)
  assert not np.allclose(want[8], plain[8], rtol=1e-2)


# ---------------------------------------------------------------------------
# Spec §5 test vectors.
# ---------------------------------------------------------------------------


def test_warmup_factor_values():
  phi = spam_warmup_factor(jnp.array([0, 1, 10, 75, 149, 150, 400]), 150)
  np.testing.assert_allclose(
      phi, [0.01000, 0.01011, 0.02067, 0.49985, 0.99957, 1.0, 1.0], atol=1e-5)
  assert float(spam_warmup_factor(0, 0)) == 1.0
  # The reference script's wiring: N = 1000 with a 500-step window.
  window = spam_warmup_factor(jnp.arange(500), 1000)
  np.testing.assert_allclose(window.max(), 0.5027, atol=1e-4)
  np.testing.assert_allclose(window.mean(), 0.1891, atol=1e-4)


def spam_step_at(count, grads, **kwargs):
  """One scale_by_spam update taken after ``count`` earlier updates."""
  tx = scale_by_spam(**kwargs)
  state = tx.init(grads)._replace(
      count=jnp.asarray(count, jnp.int32),
      mu=jax.tree.map(lambda g: 5.0 * g, grads),
      nu=jax.tree.map(lambda g: 7.0 * g**2, grads))
  return tx.update(grads, state)


@pytest.mark.parametrize('s,want', [(500, 1.98399), (1000, 2.51457),
                                    (5000, 3.15163)])
def test_first_update_after_reset(s, want):
  g = {'w': jnp.array([0.3, -2.0, 7.0])}
  u, state = spam_step_at(s - 1, g, eps=0.0, reset_interval=500,
                          warmup_steps=0)
  np.testing.assert_allclose(u['w'], want * np.sign(g['w']), rtol=1e-5)
  # The reset happened even though the state was not zero before.
  np.testing.assert_allclose(state.mu['w'], 0.1 * g['w'], rtol=1e-6)
  # With the re-warmup the step is cut to 1%.
  u, _ = spam_step_at(s - 1, g, eps=0.0, reset_interval=500,
                      warmup_steps=150)
  np.testing.assert_allclose(u['w'], 0.01 * want * np.sign(g['w']),
                             rtol=1e-5)


def test_warmup_follows_each_reset():
  tx = scale_by_spam(eps=0.0, reset_interval=500, warmup_steps=150)
  g = {'w': jnp.ones(2)}
  step = jax.jit(tx.update)
  for count, j in [(0, None), (498, None), (499, 0), (510, 11), (649, 150),
                   (999, 0)]:
    state = tx.init(g)._replace(count=jnp.asarray(count, jnp.int32),
                                mu=g, nu=g)
    u, _ = step(g, state)
    s = count + 1
    adam = math.sqrt(1 - 0.999**s) / (1 - 0.9**s)
    if j == 0:  # The reset step starts from zero moments.
      adam *= 0.1 / math.sqrt(0.001)
    phi = 1.0 if j is None else float(spam_warmup_factor(j, 150))
    np.testing.assert_allclose(u['w'], phi * adam, rtol=1e-5,
                               err_msg=f'count {count}')


def test_effective_threshold_after_reset():
  """The clip compares against the uncorrected v: theta (1 - b2^j)."""
  tx = scale_by_spam(threshold=5000.0, reset_interval=500, clip_delay=1)
  ones = {'w': jnp.ones(1)}
  spike = {'w': jnp.full(1, 1e4)}
  step = jax.jit(tx.update)
  # Start at the reset step (count 499) with a state full of old history.
  state = tx.init(ones)._replace(count=jnp.asarray(499, jnp.int32),
                                 nu={'w': jnp.full(1, 1e6)})
  got = {}
  for j in range(500):
    if j in (20, 100, 250, 499):
      _, probe = step(spike, state)
      clipped = (probe.mu['w'] - 0.9 * state.mu['w']) / 0.1
      got[j] = float(clipped[0]) ** 2  # The true second moment is 1.
    _, state = step(ones, state)
  np.testing.assert_allclose(
      [got[j] for j in (20, 100, 250, 499)], [99.06, 476.0, 1106.5, 1965.1],
      rtol=2e-4)


# ---------------------------------------------------------------------------
# Sparse momentum.
# ---------------------------------------------------------------------------


# The conformance suite's params ('w' 4x3 is sparse at density 0.5, 'b' stays
# dense), so the compiled kernels are shared with it.
sparse_params = conf.example_params


def test_sparse_momentum_updates_exactly_k_entries():
  params = sparse_params()
  tx = scale_by_spam(reset_interval=4, warmup_steps=0, density=0.5)
  grads = helpers.random_grads(params, 9)
  ups, state = helpers.run_updates(tx, params, grads)
  assert state.mu['w'].shape == (6,) and state.mu['b'].shape == (3,)
  supports = [np.flatnonzero(u['w']) for u in ups]
  assert all(len(s) == 6 for s in supports)
  assert all(np.count_nonzero(u['b']) == 3 for u in ups)
  # Fixed within a window, redrawn on the reset steps (updates 4 and 8).
  np.testing.assert_array_equal(supports[0], supports[2])
  np.testing.assert_array_equal(supports[3], supports[6])
  assert not np.array_equal(supports[2], supports[3])
  assert not np.array_equal(supports[6], supports[7])
  np.testing.assert_array_equal(supports[7], np.asarray(state.masks[0]))


def test_sparse_entries_follow_dense_spam():
  """The kept entries evolve like dense SPAM on the gathered gradient."""
  params = sparse_params()
  kw = dict(threshold=2.0, reset_interval=50, warmup_steps=3, clip_delay=1)
  tx = scale_by_spam(**kw, density=0.5)
  grads = helpers.random_grads(params, 6, spikes=(3,))
  ups, state = helpers.run_updates(tx, params, grads)
  idx = np.asarray(state.masks[0])
  dense, _ = helpers.run_updates(
      scale_by_spam(**kw), {'w': jnp.zeros(len(idx))},
      [{'w': g['w'].reshape(-1)[idx]} for g in grads])
  for u, d in zip(ups, dense):
    np.testing.assert_allclose(u['w'].reshape(-1)[idx], d['w'], rtol=1e-6)


def test_sparse_compat_bernoulli_redraw():
  params = sparse_params()
  tx = scale_by_spam(reset_interval=2, density=0.5, reference_compat=True)
  state = tx.init(params)
  assert state.mu['w'].shape == (4, 3)
  counts = [int(state.masks[0].sum())]
  g = jax.tree.map(jnp.ones_like, params)
  for _ in range(8):
    u, state = tx.update(g, state)
    np.testing.assert_array_equal(u['w'] != 0, state.masks[0])
    assert np.all(u['b'] != 0)
    counts.append(int(state.masks[0].sum()))
  assert counts[0] == 6  # The initial mask is exact; ...
  assert len(set(counts[1:])) > 1  # ... redraws have random sizes.


@pytest.mark.parametrize('compat', [False, True])
def test_sparse_weight_decay(compat):
  params = sparse_params()
  lr, wd = 0.1, 0.5
  kw = dict(reset_interval=10, density=0.5, reference_compat=compat)
  grads = helpers.random_grads(params, 1)
  u_wd, _ = helpers.run_updates(spam(lr, weight_decay=wd, **kw), params,
                                grads)
  u0, state = helpers.run_updates(spam(lr, **kw), params, grads)
  u_wd, u0 = u_wd[0], u0[0]
  if compat:
    # No decay in the density group; post-update decay elsewhere.
    np.testing.assert_array_equal(u_wd['w'], u0['w'])
    want_b = u0['b'] - lr * wd * (params['b'] + u0['b'])
  else:
    mask = np.zeros(12, bool)
    mask[np.asarray(state[0].masks[0])] = True
    mask = mask.reshape(4, 3)
    want_w = u0['w'] - lr * wd * np.where(mask, params['w'], 0.0)
    np.testing.assert_allclose(u_wd['w'], want_w, rtol=1e-6, atol=1e-8)
    want_b = u0['b'] - lr * wd * params['b']
  np.testing.assert_allclose(u_wd['b'], want_b, rtol=1e-6, atol=1e-8)


def test_bad_density():
  with pytest.raises(ValueError, match='density'):
    spam(1e-3, density=1.5)
  with pytest.raises(ValueError, match='keeps no entry'):
    scale_by_spam(density=0.01).init({'w': jnp.zeros((3, 3))})
  params = sparse_params()
  tx = optax.inject_hyperparams(spam)(learning_rate=1e-3, density=0.5)
  with pytest.raises(TypeError, match='static_args'):
    jax.jit(tx.update)(params, tx.init(params), params)
  tx = optax.inject_hyperparams(spam, static_args=('density',))(
      learning_rate=1e-3, density=0.5)
  grads = jax.tree.map(jnp.ones_like, params)
  u, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  assert np.count_nonzero(u['w']) == 6


def test_mu_dtype():
  helpers.check_mu_dtype(scale_by_spam(mu_dtype=jnp.bfloat16))


# ---------------------------------------------------------------------------
# A gradient spike.
# ---------------------------------------------------------------------------


@pytest.fixture(scope='module')
def spike_runs():
  return helpers.spike_runs({'adam': optax.adam(1.0), 'spam': spam(1.0),
                             'spam50': spam(1.0, threshold=50.0)})


def test_spike_enters_the_moments_bounded(spike_runs):
  """The gradient that reaches the first moment on the spike step."""
  entered = functools.partial(helpers.spike_entered, spike_runs)
  norm = functools.partial(helpers.spike_entered_norm, spike_runs)
  usual = norm('adam', 1.0)
  # Adam takes the spike whole: 1000x, then 10^6x the usual norm.
  np.testing.assert_allclose(norm('adam', 1e3), 1e3 * usual, rtol=1e-4)
  np.testing.assert_allclose(norm('adam', 1e6), 1e6 * usual, rtol=1e-4)
  # SPAM clips each coordinate to sqrt(theta v): about 27x the usual norm
  # here, whatever the spike's size.
  bound = np.sqrt(5000.0 * spike_runs['spam'][1e3][1].nu['w'][
      helpers.SPIKE_AT])
  for scale in (1e3, 1e6):
    assert np.all(np.abs(entered('spam', scale)) <= bound * (1 + 1e-5))
    assert norm('spam', scale) < 30 * usual
  np.testing.assert_allclose(norm('spam', 1e6), norm('spam', 1e3), rtol=1e-3)


def test_spike_barely_moves_the_trajectory(spike_runs):
  """Net displacement caused by the spike over the next 30 updates."""
  moved = helpers.spike_displacements(spike_runs)
  assert moved['adam'] > 50.0
  assert moved['spam50'] < 0.2 * moved['adam']
  # At its default theta = 5000 SPAM clips to ~30x the gradient RMS here.
  assert moved['spam'] < moved['adam']
