"""Tests of Stable-SPAM (loc_opt.inner.stable_spam).

Conformance, equivalences with SPAM and with the chain of its pieces, a
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

from loc_opt.inner import clipping
from loc_opt.inner.spam import scale_by_spam
from loc_opt.inner.stable_spam import scale_by_stable_spam
from loc_opt.inner.stable_spam import stable_spam
from loc_opt.inner.stable_spam import stable_spam_kappa
from tests import optax_conformance as conf
from tests.inner import _helpers as helpers


def test_conformance(tmp_path):
  conf.check_all(functools.partial(stable_spam, reset_interval=3,
                                   total_steps=4, weight_decay=0.1), tmp_path)


# ---------------------------------------------------------------------------
# Equivalences.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('compat', [False, True])
def test_stable_spam_without_extras_is_spam(compat):
  params = conf.example_params()
  grads = helpers.random_grads(params, 8, spikes=(5,))
  got, _ = helpers.run_updates(
      scale_by_stable_spam(eps=1e-10, reset_interval=0, ada_clip=False,
                           ada_gn=False, reference_compat=compat),
      params, grads)
  want, _ = helpers.run_updates(
      scale_by_spam(eps=1e-10, threshold=0.0, reset_interval=0,
                    reference_compat=compat), params, grads)
  helpers.assert_updates_close(got, want, rtol=1e-6, atol=1e-6)


def test_stable_spam_is_the_chain_of_its_pieces():
  """Clean mode, no annealing: AdaClip -> AdaGN -> reset_every(Adam)."""
  params = conf.example_params()
  grads = helpers.random_grads(params, 14, spikes=(3, 9))
  got, _ = helpers.run_updates(
      scale_by_stable_spam(gamma1=0.8, gamma2=0.95, gamma3=0.9,
                           reset_interval=4), params, grads)
  want, _ = helpers.run_updates(optax.chain(
      clipping.adaptive_max_clip(0.9),
      clipping.adaptive_grad_norm(0.8, 0.95, eps=1e-8),
      clipping.reset_every(optax.scale_by_adam(0.9, 0.999, eps=1e-8), 4),
  ), params, grads)
  helpers.assert_updates_close(got, want)


# ---------------------------------------------------------------------------
# A literal NumPy transcription of the reference algorithm (spec §A2).
# ---------------------------------------------------------------------------


def stable_spam_reference(grads, *, b1, b2, eps, gamma1, gamma2, gamma3,
                          interval, total, kappa_min, compat):
  """Stable-SPAM in the reference's order, with or without its quirks."""
  m = v = np.zeros_like(grads[0], np.float64)
  t = s = 0
  mx = mn = vn = 0.0
  out = []
  for g in grads:
    g = np.asarray(g, np.float64)
    t += 1
    tc = t if compat else min(t, total + 1)
    kappa = kappa_min + (1 - kappa_min) * (
        1 + math.cos(math.pi * tc / (total + 1))) / 2
    s += 1
    c = s if compat else t
    a = np.abs(g).max()
    mx = gamma3 * mx + (1 - gamma3) * a
    bound = mx / (1 - gamma3**c)
    g = np.where(np.abs(g) > bound, g * bound / a, g)
    n = np.linalg.norm(g)
    g1 = gamma1 * kappa
    mn = g1 * mn + (1 - g1) * n
    vn = gamma2 * vn + (1 - gamma2) * n**2
    target = (mn / (1 - g1**c)) / (math.sqrt(vn / (1 - gamma2**c)) + eps)
    g = g * target / n
    m_loc, v_loc = m, v
    reset = t % interval == 0
    if reset:
      if not compat:
        m_loc, v_loc = 0 * m, 0 * v
      m, v, s = 0 * m, 0 * v, 1
    b1k = b1 * kappa
    m_loc = b1k * m_loc + (1 - b1k) * g
    v_loc = b2 * v_loc + (1 - b2) * g**2
    out.append((m_loc / (1 - b1k**s))
               / (np.sqrt(v_loc) / math.sqrt(1 - b2**s) + eps))
    if not (compat and reset):
      m, v = m_loc, v_loc
  return out


@pytest.mark.parametrize('compat', [False, True])
def test_stable_spam_matches_reference_transcription(compat):
  hp = dict(b1=0.9, b2=0.999, eps=1e-8, gamma1=0.7, gamma2=0.9, gamma3=0.9)
  grads = helpers.leaf_grads(20)
  want = stable_spam_reference([np.asarray(g) for g in grads], interval=5,
                               total=8, kappa_min=0.5, compat=compat, **hp)
  got, _ = helpers.run_updates(
      scale_by_stable_spam(**hp, reset_interval=5, total_steps=8,
                           kappa_min=0.5, reference_compat=compat),
      {'w': grads[0]}, [{'w': g} for g in grads])
  for i, (u, w) in enumerate(zip(got, want)):
    np.testing.assert_allclose(u['w'], w, rtol=1e-4, atol=1e-6,
                               err_msg=f'step {i}')
  # The two modes differ (stale reset step, EMA counters, kappa clamp).
  other = stable_spam_reference([np.asarray(g) for g in grads], interval=5,
                                total=8, kappa_min=0.5, compat=not compat,
                                **hp)
  assert not np.allclose(want[4], other[4], rtol=1e-2)
  assert not np.allclose(want[15], other[15], rtol=1e-2)


# ---------------------------------------------------------------------------
# Spec §5 test vectors.
# ---------------------------------------------------------------------------


def test_kappa_values():
  k = functools.partial(stable_spam_kappa, total_steps=20000)
  np.testing.assert_allclose(
      [k(1, clamp=False), k(10000, clamp=False), k(20000, clamp=False),
       k(30000, clamp=False)], [1.0, 0.75002, 0.5, 0.74994], atol=1e-5)
  np.testing.assert_allclose(jax.jit(k)(30000), 0.5, atol=1e-7)
  np.testing.assert_allclose(k(20001), 0.5, atol=1e-7)


@pytest.mark.parametrize('compat,kappa,want', [
    (True, 1.0, 0.31623), (True, 0.5, 0.0575), (False, 1.0, 1.0),
    (False, 0.5, 1.0)])
def test_stable_spam_reset_step_factor(compat, kappa, want):
  """Converged moments, then a reset: stale (compat) or fresh moments."""
  total = None
  if kappa != 1.0:
    total = 20000  # kappa(T + 1) = 0.5 exactly; pick t = T + 1 below.
  tx = scale_by_stable_spam(reset_interval=20001, total_steps=total,
                            ada_clip=False, ada_gn=False,
                            reference_compat=compat)
  g = {'w': jnp.array([0.5, -3.0])}
  state = tx.init(g)._replace(
      count=jnp.asarray(20000, jnp.int32),
      adam_count=jnp.asarray(10**6, jnp.int32),
      mu=g, nu=jax.tree.map(jnp.square, g))
  if total is not None and compat:
    # Unclamped, kappa(T + 1) is also 0.5.
    np.testing.assert_allclose(
        stable_spam_kappa(20001, total, clamp=False), 0.5)
  u, new_state = tx.update(g, state)
  np.testing.assert_allclose(u['w'], want * np.sign(g['w']), rtol=2e-3)
  assert int(new_state.adam_count) == 1
  if compat:  # The zeros are stored for the next step.
    np.testing.assert_array_equal(new_state.mu['w'], 0.0)


@pytest.mark.parametrize('compat,want', [(True, 500.25), (False, 1.58)])
def test_stable_spam_clip_counter_after_reset(compat, want):
  """After a reset the compat AdaClip bias correction restarts (s = 2)."""
  tx = scale_by_stable_spam(reset_interval=0, ada_gn=False,
                            reference_compat=compat)
  g = {'w': jnp.array([1e6, -5.0, 2.0])}
  state = tx.init(g)._replace(count=jnp.asarray(1000, jnp.int32),
                              adam_count=jnp.asarray(1, jnp.int32),
                              max_ema={'w': jnp.asarray(1.0)})
  _, new_state = tx.update(g, state)
  clipped = new_state.mu['w'][0] / 0.1  # From zero moments.
  np.testing.assert_allclose(clipped / new_state.max_ema['w'],
                             1 / (1 - 0.999 ** (2 if compat else 1001)),
                             rtol=1e-4)
  np.testing.assert_allclose(clipped / new_state.max_ema['w'], want,
                             rtol=2e-3)


def test_mu_dtype():
  helpers.check_mu_dtype(scale_by_stable_spam(mu_dtype=jnp.bfloat16))


# ---------------------------------------------------------------------------
# A gradient spike.
# ---------------------------------------------------------------------------


@pytest.fixture(scope='module')
def spike_runs():
  return helpers.spike_runs({'adam': optax.adam(1.0),
                             'stable_spam': stable_spam(1.0)})


def test_spike_enters_the_moments_bounded(spike_runs):
  """AdaClip + AdaGN keep the norm of the spike step at its usual size."""
  norm = functools.partial(helpers.spike_entered_norm, spike_runs)
  for scale in (1e3, 1e6):
    assert norm('stable_spam', scale) < 1.5 * norm('stable_spam', 1.0,
                                                   helpers.SPIKE_AT - 1)


def test_spike_barely_moves_the_trajectory(spike_runs):
  """Net displacement caused by the spike over the next 30 updates."""
  moved = helpers.spike_displacements(spike_runs)
  assert moved['adam'] > 50.0
  assert moved['stable_spam'] < 0.2 * moved['adam']
