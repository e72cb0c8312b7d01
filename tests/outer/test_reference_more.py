"""DeMo, SparseLoCo, EDiT, CO2 and asynchronous local SGD against float64
references.

As ``test_reference.py`` (its docstring explains the approach): each method
of :mod:`loc_opt.outer` runs several sync rounds of the small problem of
:mod:`tests.outer._reference` with its features on, and a NumPy float64
replay of the spec's rule, written out here, must give the same parameters
to the tolerance stated at each assert. The tiles of DeMo and SparseLoCo
are whole tensors here (chunk / tile 4 on 4 x 4 and 4-long tensors), so
the reference's DCT is one orthonormal DCT-II matrix per axis.

References: the papers of each method, as cited in its module.
"""

import math

import numpy as np
import optax

from loc_opt import outer
from tests.outer import _reference as ref

M = ref.M
RTOL, ATOL = 1e-5, 1e-6  # float32 library vs float64 reference


def nesterov(v, d, lr, mu):
  v = mu * v + d
  return v, -lr * (d + mu * v)


def zeros(tree):
  return {k: np.zeros_like(x) for k, x in tree.items()}


def dct_matrix(n):
  """Orthonormal DCT-II: ``D[k, i] = a_k cos(pi (2 i + 1) k / (2 n))``."""
  k, i = np.arange(n)[:, None], np.arange(n)[None, :]
  d = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * i + 1) * k / (2 * n))
  d[0] /= np.sqrt(2.0)
  return d


def dct(x):
  d = [dct_matrix(n) for n in x.shape]
  return d[0] @ x @ d[1].T if x.ndim == 2 else d[0] @ x


def idct(c):
  d = [dct_matrix(n) for n in c.shape]
  return d[0].T @ c @ d[1] if c.ndim == 2 else d[0].T @ c


def top_k(x, k):
  """``x`` with all but its ``k`` largest-magnitude entries zeroed, and
  the mask of those kept."""
  flat = np.abs(x).ravel()
  keep = np.zeros(flat.size, bool)
  keep[np.argsort(-flat, kind='stable')[:k]] = True
  keep = keep.reshape(x.shape)
  return np.where(keep, x, 0.0), keep


def mean_of_selected(values, masks):
  """Per entry: the mean over the workers that selected it (0 if none)."""
  count = np.sum(masks, axis=0)
  return np.where(count > 0, np.sum(values, axis=0) / np.maximum(count, 1),
                  0.0)


# ------------------------------------------------------------------ DeMo ---
def test_demo_matches_reference():
  """LR-scaled momentum, top-3 DCT coefficients of every tile removed from
  it and averaged over the workers that picked them, sign step with
  decoupled weight decay; 5 steps (DeMo syncs every step)."""
  lr, beta, k, wd, steps = 0.05, 0.9, 3, 0.1, 5
  tx = outer.demo(lr, beta=beta, topk=k, chunk=4, weight_decay=wd)
  got, _ = ref.run(tx, steps)

  th, mom = ref.stacked(ref.start()), zeros(ref.stacked(ref.start()))
  for t in range(steps):
    g = ref.grads(th, t)
    for key in th:
      sent, masks = [], []
      for m in range(M):
        mom[key][m] = beta * mom[key][m] + lr * g[key][m]
        kept, mask = top_k(dct(mom[key][m]), k)
        mom[key][m] = mom[key][m] - idct(kept)
        sent.append(kept)
        masks.append(mask)
      u = idct(mean_of_selected(sent, masks))
      th[key] = th[key] - lr * (np.sign(u)[None] + wd * th[key])
  ref.assert_close(got, th, RTOL, ATOL)


# ------------------------------------------------------------ SparseLoCo ---
def two_bit(values):
  """SparseLoCo's 2-bit quantizer of a tensor's kept values (zero-padded to
  a multiple of 4, the padding in the statistics); returns the dequantized
  kept values."""
  n = len(values)
  x = np.concatenate([values, np.zeros((-n) % 4)])
  shift = x.mean()
  centered = x - shift
  width = 6.0 * np.sqrt((centered**2).sum() / (len(x) - 1)) / 4.0
  codes = np.clip(np.round(centered / (width if width > 0 else 1.0) + 2),
                  0, 3)
  table = [centered[codes == j].mean() if (codes == j).any() else 0.0
           for j in range(4)]
  return (np.array(table)[codes.astype(int)] + shift)[:n]


def test_sparseloco_matches_reference():
  """Error-feedback buffer with decay, per-tile top-k (3 of the 16 entries
  of the 4 x 4 tile, 1 of the 4-long segment), 2-bit values per tensor,
  mean over the workers that selected an entry, outer SGD lr 0.8; 3
  rounds."""
  lr, decay, eta, h, steps = 0.1, 0.9, 0.8, 2, 6
  tx = outer.sparseloco(optax.sgd(lr), sync_every=h, ef_decay=decay,
                        topk=768, tile=4, learning_rate=eta)
  got, state = ref.run(tx, steps)
  kept = {'b': round(768 * 4 / 4096), 'w': round(768 * 16 / 4096)}
  assert kept == {'b': 1, 'w': 3}

  th, phi = ref.stacked(ref.start()), ref.start()
  err = zeros(th)
  for t in range(1, steps + 1):
    g = ref.grads(th, t - 1)
    th = {key: th[key] - lr * g[key] for key in th}
    if t % h:
      continue
    for key in th:
      sent, masks = [], []
      for m in range(M):
        err[key][m] = decay * err[key][m] + (phi[key] - th[key][m])
        _, mask = top_k(err[key][m], kept[key])
        s = np.zeros_like(err[key][m])
        s[mask] = two_bit(err[key][m][mask])
        err[key][m] = err[key][m] - s
        sent.append(s)
        masks.append(mask)
      phi[key] = phi[key] - eta * mean_of_selected(sent, masks)
      th[key] = np.repeat(phi[key][None], M, 0)
  ref.assert_close(got, th, RTOL, ATOL)
  ref.assert_close({k: np.asarray(e) for k, e in state.error.items()}, err,
                   RTOL, ATOL)


# ------------------------------------------------------------------ EDiT ---
def test_edit_diloco_matches_reference():
  """Norm statistics per worker (exact mean / variance, then EWMA), a
  worker dropped once its norm's z-score passes the threshold after the
  warmup, softmax weights over the kept workers' norms, the aggregate
  clipped to a global norm, outer Nesterov; 6 rounds, worker 3's targets
  jump from round 5 on."""
  lr, eta, mu, h, steps = 0.1, 0.7, 0.9, 2, 12
  ewma, warmup, zthr, temp, clip = 0.5, 2, 2.0, 2.0, 1.0
  tx = outer.edit_diloco(
      optax.sgd(lr), sync_every=h,
      outer=optax.sgd(eta, momentum=mu, nesterov=True), ewma=ewma,
      warmup_syncs=warmup, z_threshold=zthr, temperature=temp,
      clip_norm=clip)
  jump = np.array([1.0, 1.0, 1.0, 30.0])[:, None]

  def targets_of(step):
    c = ref.targets(step)
    if step >= 8:
      c = {k: v * jump.reshape((M,) + (1,) * (v.ndim - 1))
           for k, v in c.items()}
    return c

  got, state = ref.run(tx, steps, targets_fn=targets_of)

  a = ref.curvature()
  th, phi, v = ref.stacked(ref.start()), ref.start(), zeros(ref.start())
  mean, var, num = np.zeros(M), np.zeros(M), np.zeros(M, int)
  dropped = 0
  for t in range(1, steps + 1):
    c = targets_of(t - 1)
    th = {k: th[k] - lr * a[k] * (th[k] - c[k]) for k in th}
    if t % h:
      continue
    d = {k: phi[k][None] - th[k] for k in th}
    norm = np.sqrt(sum((x**2).reshape(M, -1).sum(1) for x in d.values()))
    std = np.maximum(np.sqrt(var), 1e-3 * mean)
    z = (norm - mean) / np.maximum(std, 1e-30)
    keep = ~((num >= warmup) & (z > zthr))
    rate = np.maximum(ewma, 1.0 / (num + 1))
    diff = norm - mean
    mean = np.where(keep, mean + rate * diff, mean)
    var = np.where(keep, (1 - rate) * (var + rate * diff**2), var)
    num = np.where(keep, num + 1, num)
    if not keep.any():
      keep[:] = True
    dropped += M - keep.sum()
    w = np.where(keep, np.exp(-(norm - norm.min()) / temp), 0.0)
    w = w / w.sum()
    agg = {k: np.tensordot(w, x, axes=1) for k, x in d.items()}
    total = math.sqrt(sum((x**2).sum() for x in agg.values()))
    agg = {k: x * min(1.0, clip / total) for k, x in agg.items()}
    for k in th:
      v[k], step = nesterov(v[k], agg[k], eta, mu)
      phi[k] = phi[k] + step
      th[k] = np.repeat(phi[k][None], M, 0)
  assert dropped >= 1  # the jump was caught
  assert int(np.asarray(state.total_dropped)[0]) == dropped
  ref.assert_close(got, th, RTOL, ATOL)


# ------------------------------------------------------------------- CO2 ---
def test_co2_matches_reference():
  """One-round-stale average, staleness penalty, element-wise clip of the
  outer momentum (binding), outer momentum and lr; 4 rounds."""
  lr, eta, mu, lam, clip, h, steps = 0.1, 0.9, 0.5, 2.0, 0.05, 2, 8
  tx = outer.co2(optax.sgd(lr), sync_every=h, outer_lr=eta, momentum=mu,
                 staleness_penalty=lam, clip=clip)
  got, _ = ref.run(tx, steps)

  th, phi = ref.stacked(ref.start()), ref.start()
  mom, stale = zeros(phi), ref.start()
  bound = False
  for t in range(1, steps + 1):
    g = ref.grads(th, t - 1)
    th = {k: th[k] - lr * g[k] for k in th}
    if t % h:
      continue
    for k in th:
      fresh = th[k].mean(0)
      raw = mu * mom[k] + (phi[k] - stale[k]) / lam
      bound |= bool((np.abs(raw) > clip).any())
      mom[k] = np.clip(raw, -clip, clip)
      phi[k] = phi[k] - eta * mom[k]
      th[k] = np.repeat(phi[k][None], M, 0)
      stale[k] = fresh
  assert bound
  ref.assert_close(got, th, RTOL, ATOL)


# ----------------------------------------------------- async local SGD ---
def test_async_local_sgd_matches_reference():
  """Worker 3 at half speed with DyLU (2 inner steps per round vs 4), a
  server applying each push with Delayed Nesterov (buffer 4, activation
  0.1), pushes of a tick in worker order, each finisher pulling right after
  its push; 16 ticks."""
  lr, eta, beta, n, act, h, ticks = 0.1, 0.7, 0.9, 4, 0.1, 4, 16
  speeds = (1.0, 1.0, 1.0, 0.5)
  tx = outer.async_local_sgd(
      optax.sgd(lr), speeds=speeds, sync_every=h,
      outer=outer.delayed_nesterov(eta, momentum=beta, buffer_size=n,
                                   activation=act))
  got, _ = ref.run(tx, ticks)

  periods = [max(1, math.floor(s / max(speeds) * h)) for s in speeds]
  assert periods == [4, 4, 4, 2]
  th, phi = ref.stacked(ref.start()), ref.start()
  start = ref.stacked(ref.start())
  mom, acc, pushes = zeros(phi), zeros(phi), 0
  taken = [0] * M
  for tick in range(ticks):
    g = ref.grads(th, tick)
    finishing = []
    for w, s in enumerate(speeds):
      if math.floor((tick + 1) * s) > math.floor(tick * s):
        for k in th:
          th[k][w] = th[k][w] - lr * g[k][w]
        taken[w] += 1
        if taken[w] % periods[w] == 0:
          finishing.append(w)
    for w in finishing:
      for k in th:
        push = start[k][w] - th[k][w]
        acc[k] = acc[k] + push
        if (pushes + 1) % n == 0:
          mom[k] = beta * mom[k] + acc[k] / n
          phi[k] = phi[k] - eta * ((1 - act * n + act) * beta * mom[k]
                                   + push / n)
          acc[k] = np.zeros_like(acc[k])
        else:
          phi[k] = phi[k] - eta * (act * beta * mom[k] + push / n)
        th[k][w] = phi[k]
        start[k][w] = phi[k]
      pushes += 1
  assert pushes >= 2 * n  # the momentum was folded in at least twice
  ref.assert_close(got, th, RTOL, ATOL)
