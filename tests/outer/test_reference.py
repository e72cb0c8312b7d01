"""Every local-update method against an independent float64 reference.

Each test trains a method of :mod:`loc_opt.outer` (float32, four workers
under ``vmap``) on the small problem of :mod:`tests.outer._reference` for
several sync rounds with every feature of the method switched on, and
replays the same steps in NumPy float64 from the update rule of
``shared/specs/local-outer-optimizers.md``, written out here without calling
the library (only the problem's data is shared). The tolerance of each
comparison is stated at the assert: float32 rounding over a dozen steps of
a well-conditioned problem stays near 1e-6, so ``rtol=1e-5`` with a small
``atol`` separates a wrong rule (errors of 1e-2 and more) from rounding.
Also here: the reductions the spec lists that had no test (exact fp4 values
through Streaming DiLoCo, NoLoCo with no consensus term, DES-LOC with no
state sync is DiLoCo). DeMo, SparseLoCo, EDiT, CO2 and asynchronous local
SGD are in ``test_reference_more.py``.

References: the papers of each method, as cited in its module.
"""

import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import outer
from tests.outer import _reference as ref

M = ref.M
RTOL, ATOL = 1e-5, 1e-6  # float32 library vs float64 reference


def nesterov(v, d, lr, mu):
  """Outer Nesterov: ``v <- mu v + d``; returns ``(v, step)``, the step to
  add to ``phi`` (``-lr (d + mu v)``)."""
  v = mu * v + d
  return v, -lr * (d + mu * v)


def zeros(tree):
  return {k: np.zeros_like(x) for k, x in tree.items()}


# ---------------------------------------------------------------- DiLoCo ---
def test_diloco_matches_reference():
  """Inner SGD with momentum kept across syncs, outer Nesterov, 4 rounds."""
  lr, beta, eta, mu, h, steps = 0.1, 0.5, 0.7, 0.9, 3, 12
  tx = loc_opt.diloco(optax.sgd(lr, momentum=beta), sync_every=h,
                      outer=optax.sgd(eta, momentum=mu, nesterov=True))
  got, _ = ref.run(tx, steps)

  th = ref.stacked(ref.start())
  trace, phi, v = zeros(th), ref.start(), zeros(ref.start())
  for t in range(1, steps + 1):
    g = ref.grads(th, t - 1)
    for k in th:
      trace[k] = g[k] + beta * trace[k]
      th[k] = th[k] - lr * trace[k]
    if t % h == 0:
      for k in th:
        d = (phi[k] - th[k]).mean(0)
        v[k], step = nesterov(v[k], d, eta, mu)
        phi[k] = phi[k] + step
        th[k] = np.repeat(phi[k][None], M, 0)
  ref.assert_close(got, th, RTOL, ATOL)


# ------------------------------------------------------ Streaming DiLoCo ---
def test_streaming_diloco_matches_reference():
  """P = 2 fragments, tau = 1, alpha = 0.5, outer Nesterov, 3 rounds."""
  lr, eta, mu, h, p, tau, alpha, steps = 0.1, 0.7, 0.9, 4, 2, 1, 0.5, 14
  frags = {'b': 0, 'w': 1}
  tx = outer.streaming_diloco(
      optax.sgd(lr), sync_every=h, fragments=frags, overlap=tau,
      alpha=alpha, outer=optax.sgd(eta, momentum=mu, nesterov=True))
  got, state = ref.run(tx, steps)

  stride = h // p
  th, phi, v = ref.stacked(ref.start()), ref.start(), zeros(ref.start())
  flight = {}
  for t in range(1, steps + 1):
    g = ref.grads(th, t - 1)
    th = {k: th[k] - lr * g[k] for k in th}
    u = t - tau
    if u >= stride and u % stride == 0:  # fragment sent at u lands now
      q = (u % h) // stride
      for k in [k for k, f in frags.items() if f == q]:
        v[k], step = nesterov(v[k], flight[k], eta, mu)
        phi[k] = phi[k] + step
        th[k] = alpha * th[k] + (1 - alpha) * phi[k][None]
    if t % stride == 0:  # fragment (t mod H) / S sends
      q = (t % h) // stride
      for k in [k for k, f in frags.items() if f == q]:
        flight[k] = (phi[k] - th[k]).mean(0)
  ref.assert_close(got, th, RTOL, ATOL)
  ref.assert_close({k: np.asarray(x[0]) for k, x in state.anchor.items()},
                   phi, RTOL, ATOL)
  np.testing.assert_array_equal(state.applies[0], [3, 3])


E3M0 = np.array([0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0])


def fp4_e3m0(x):
  """Nearest-rounding fp4 e3m0 of ``x`` with its own absmax scale
  ``max|x| / 16`` (ties away from zero)."""
  s = np.abs(x).max() / 16.0
  if s == 0:
    return np.zeros_like(x)
  mids = (E3M0[:-1] + E3M0[1:]) / 2
  idx = (np.abs(x / s)[..., None] >= mids).sum(-1)
  return np.sign(x) * E3M0[idx] * s


def test_streaming_fp4_values_are_exact_per_tensor():
  """The fp4 e3m0 outer gradient with ``block_size=None`` is each worker's
  pseudo-gradient rounded with one scale per tensor, exactly: a tensor of
  values around 1e-3 that shares its fragment with an O(1) one is sent,
  not zeroed (one scale for the whole fragment zeroed it), and its anchor
  moves. Outer SGD lr 1: the anchor moves by the mean of the roundings."""
  lr, h, steps, small = 0.1, 2, 4, 1e-3
  inner = optax.chain(
      optax.masked(optax.scale(small), {'b': True, 'w': False}),
      optax.sgd(lr))
  tx = outer.streaming_diloco(
      inner, sync_every=h, fragments={'b': 0, 'w': 0}, overlap=0,
      outer=optax.sgd(1.0),
      codec=loc_opt.compression.fp4_codec('e3m0', block_size=None))
  got, state = ref.run(tx, steps)

  th, phi = ref.stacked(ref.start()), ref.start()
  for t in range(1, steps + 1):
    g = ref.grads(th, t - 1)
    g['b'] = small * g['b']
    th = {k: th[k] - lr * g[k] for k in th}
    if t % h == 0:
      for k in th:
        sent = [fp4_e3m0(phi[k] - th[k][m]) for m in range(M)]
        phi[k] = phi[k] - np.mean(sent, axis=0)
        th[k] = np.repeat(phi[k][None], M, 0)
  # Rounded values are exact up to float32 rounding of the scale.
  ref.assert_close(got, th, rtol=1e-6, atol=1e-7)
  moved = np.abs(np.asarray(state.anchor['b'][0]) - ref.start()['b'])
  assert moved.min() > 1e-5, moved


# ----------------------------------------------------------------- Eager ---
def test_eager_diloco_matches_reference():
  """Per-worker outer Nesterov on the eager proxy, 4 rounds (the first
  with no previous round)."""
  lr, eta, mu, h, steps = 0.1, 0.7, 0.9, 2, 8
  tx = outer.eager_diloco(optax.sgd(lr), sync_every=h,
                          outer=optax.sgd(eta, momentum=mu, nesterov=True))
  got, _ = ref.run(tx, steps)

  th = ref.stacked(ref.start())
  phi, v = ref.stacked(ref.start()), zeros(th)
  prev_mean = {k: np.zeros(x.shape[1:]) for k, x in th.items()}
  prev_own = zeros(th)
  for t in range(1, steps + 1):
    g = ref.grads(th, t - 1)
    th = {k: th[k] - lr * g[k] for k in th}
    if t % h == 0:
      for k in th:
        d = phi[k] - th[k]
        proxy = d / M + prev_mean[k][None] - prev_own[k] / M
        v[k], step = nesterov(v[k], proxy, eta, mu)
        phi[k] = phi[k] + step
        th[k] = phi[k].copy()
        prev_mean[k], prev_own[k] = d.mean(0), d
  ref.assert_close(got, th, RTOL, ATOL)


# ---------------------------------------------------------------- NoLoCo ---
GROUPS = (((0, 1), (2, 3)), ((0, 2), (1, 3)), ((0, 3), (1, 2)))


@pytest.mark.parametrize('consensus', [0.3, 0.0])
def test_noloco_matches_reference(consensus):
  """Pairs redrawn every round (given as static phases), heavy-ball
  momentum, consensus term (``gamma = 0``: the spec's reduction with no
  pull toward the group's outer parameters), 3 rounds."""
  lr, alpha, beta, h, steps = 0.1, 0.5, 0.7, 2, 6
  tx = outer.noloco(optax.sgd(lr), sync_every=h, learning_rate=beta,
                    momentum=alpha, consensus=consensus, group_size=2)

  def phase(step):
    t = step + 1
    return GROUPS[t // h - 1] if t % h == 0 else False

  got, _ = ref.run(tx, steps, phase=phase)

  th = ref.stacked(ref.start())
  phi, delta = ref.stacked(ref.start()), zeros(th)
  for t in range(1, steps + 1):
    g = ref.grads(th, t - 1)
    th = {k: th[k] - lr * g[k] for k in th}
    if t % h == 0:
      for k in th:
        d, new_phi = phi[k] - th[k], phi[k].copy()
        for group in GROUPS[t // h - 1]:
          members = list(group)
          d_bar = d[members].mean(0)
          phi_bar = phi[k][members].mean(0)
          for i in members:
            delta[k][i] = (alpha * delta[k][i] - beta * d_bar
                           - consensus * (phi[k][i] - phi_bar))
            new_phi[i] = phi[k][i] + delta[k][i]
        phi[k] = new_phi
        th[k] = new_phi.copy()
  ref.assert_close(got, th, RTOL, ATOL)


# --------------------------------------------------------------- DES-LOC ---
def _clip(g, rho):
  return {k: np.clip(x, -rho, rho) for k, x in g.items()}


def test_desloc_matches_reference():
  """The spec's (the paper's) order: clip the gradient coordinate-wise,
  average each due state before the moment update and the due parameters
  before the parameter update; K_x = 2, K_u = 4, K_v = 6 with an outer
  Nesterov step on the parameter sync, 12 steps. Default ``average_at``
  (the pre-fix code averaged after the update and did not clip)."""
  lr, b1, b2, eps, eta, mu, rho, steps = 0.05, 0.9, 0.99, 1e-8, 0.7, 0.9, \
      0.5, 12
  kx, ku, kv = 2, 4, 6
  tx = outer.desloc(optax.adam(lr, b1, b2, eps), sync_every=kx,
                    state_sync_every={'mu': ku, 'nu': kv},
                    outer=optax.sgd(eta, momentum=mu, nesterov=True),
                    clip_radius=rho)
  got, state = ref.run(tx, steps)

  x, phi, vout = ref.stacked(ref.start()), ref.start(), zeros(ref.start())
  u, v = zeros(x), zeros(x)
  clipped = False
  for t in range(1, steps + 1):
    raw = ref.grads(x, t - 1)
    g = _clip(raw, rho)
    clipped |= any((np.abs(r) > rho).any() for r in raw.values())
    if t % ku == 0:
      u = ref.mean(u)
    if t % kv == 0:
      v = ref.mean(v)
    if t % kx == 0:
      for k in x:
        vout[k], step = nesterov(vout[k], (phi[k] - x[k]).mean(0), eta, mu)
        phi[k] = phi[k] + step
        x[k] = np.repeat(phi[k][None], M, 0)
    for k in x:
      u[k] = b1 * u[k] + (1 - b1) * g[k]
      v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
      x[k] = x[k] - lr * (u[k] / (1 - b1**t)) / (
          np.sqrt(v[k] / (1 - b2**t)) + eps)
  assert clipped  # the clip binds on some coordinates
  ref.assert_close(got, x, RTOL, ATOL)
  adam = state.inner_state[0]
  ref.assert_close({k: np.asarray(m) for k, m in adam.mu.items()}, u,
                   RTOL, ATOL)
  ref.assert_close({k: np.asarray(m) for k, m in adam.nu.items()}, v,
                   RTOL, 1e-7)


def test_desloc_without_state_sync_is_diloco():
  """No state averaged, parameters synced after the update through DiLoCo's
  outer Nesterov step and no clip: the spec's reduction to DiLoCo (to
  float32 rounding of the same operations)."""
  inner = optax.adam(0.05)
  nest = optax.sgd(0.7, momentum=0.9, nesterov=True)
  des, _ = ref.run(outer.desloc(
      inner, sync_every=3, state_sync_every={}, outer=nest,
      average_at='after_update', clip_radius=None), 12)
  dil, _ = ref.run(loc_opt.diloco(inner, sync_every=3, outer=nest), 12)
  ref.assert_close(des, dil, rtol=1e-6, atol=1e-6)
  # The default order averages before the update: not DiLoCo.
  before, _ = ref.run(outer.desloc(
      inner, sync_every=3, state_sync_every={}, outer=nest,
      clip_radius=None), 12)
  assert not np.allclose(before['w'], dil['w'], atol=1e-3)


# ---------------------------------------------------------------- MT-DAO ---
def test_mt_dao_matches_reference():
  """One slow momentum mixed with the gradient, decoupled weight decay,
  coordinate-wise clip; parameters and ``nu`` synced every 2 steps, the
  slow momentum every 4 (before the update), plain averaging, 10 steps."""
  lr, beta, omega, b2, eps, wd, rho, steps = 0.05, 0.9, 0.7, 0.99, 1e-8, \
      0.1, 0.5, 10
  kx, ks = 2, 4
  tx = outer.mt_dao(lr, sync_every=kx, slow_sync_every=ks, nu_sync_every=kx,
                    slow_betas=(beta,), slow_weights=(omega,), b2=b2,
                    eps=eps, weight_decay=wd, clip_radius=rho)
  got, _ = ref.run(tx, steps)

  x = ref.stacked(ref.start())
  u, v = zeros(x), zeros(x)
  for t in range(1, steps + 1):
    g = _clip(ref.grads(x, t - 1), rho)
    if t % ks == 0:
      u = ref.mean(u)
    if t % kx == 0:
      v, x = ref.mean(v), ref.mean(x)
    for k in x:
      u[k] = beta * u[k] + (1 - beta) * g[k]
      v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
      d = ((1 - omega) * g[k] + omega * u[k] / (1 - beta**t)) / (
          np.sqrt(v[k] / (1 - b2**t)) + eps)
      x[k] = x[k] - lr * (d + wd * x[k])
  ref.assert_close(got, x, RTOL, ATOL)
