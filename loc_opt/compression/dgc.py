r"""Deep Gradient Compression: top-k sparsification with momentum correction.

Each worker accumulates its momentum-corrected gradient locally and sends
only the largest entries (values and int32 indices, all-gathered):

.. math::

  u &\leftarrow m u + g, \quad v \leftarrow v + u
  \qquad \text{(Nesterov: } u \leftarrow m (u + g),\
  v \leftarrow v + u + g\text{)}, \\
  I &= \operatorname{top-k}(|v|), \quad
  \hat g = \tfrac{1}{W} \textstyle\sum_w \operatorname{scatter}(I_w,
  v_w[I_w]), \quad v[I] \leftarrow 0, \quad u[I] \leftarrow 0
  \ \text{(momentum factor masking)}.

Because ``v`` keeps everything not yet sent, the scheme is its own error
feedback, and the result already includes momentum: follow it with plain
SGD (no momentum). Leaves with fewer than two dimensions are averaged in
fp32, and momentum is applied to them after the average (as the reference
does), so all leaves of the output carry momentum.

During an optional warmup the kept ratio decays exponentially over the first
epochs (:func:`dgc_warmup_ratio`).

Reference:
  Lin, Han, Mao, Wang, Dally, *Deep Gradient Compression: Reducing the
  Communication Bandwidth for Distributed Training*, ICLR 2018.
"""

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loc_opt import _checks
from loc_opt.compression import compressor as compressor_lib

Compressor = compressor_lib.Compressor


def dgc_warmup_ratio(epoch: int, density: float = 1e-3,
                     warmup_epochs: int = 5) -> float:
  r"""The kept ratio in ``epoch`` (0-based) of DGC's sparsity warmup.

  .. math::

    \rho_e = \max\big(c^{e + 1}, \rho\big), \quad c = \rho^{1/(W + 1)}
    \quad (e < W), \qquad \rho_e = \rho \quad (e \ge W),

  computed in the same order as the reference (so thresholds match it bit
  for bit). With ``rho = 1e-3`` and ``W = 5``: 0.31623, 0.1, 0.031623, 0.01,
  0.0031623, then 0.001.

  Args:
    epoch: the epoch (or warmup stage), a Python int.
    density: the final kept ratio ``rho``.
    warmup_epochs: ``W``; 0 disables the warmup.

  Returns:
    The kept ratio, a Python float.
  """
  if warmup_epochs <= 0 or epoch >= warmup_epochs:
    return density
  coeff = density ** (1.0 / (warmup_epochs + 1))
  return max(coeff ** (epoch + 1), density)


def num_selected(n: int, ratio: float) -> int:
  """``k = ceil(ratio * n)``, the entries kept of an ``n``-element leaf."""
  return max(1, min(n, int(math.ceil(n * ratio))))


def _sample_layout(n: int, ratio: float, sample_ratio: float):
  """The reference's strided-sample geometry: (stride, samples, top)."""
  pct = int(math.ceil(n * sample_ratio))
  cpr = int(math.ceil(2 / ratio))
  if sample_ratio >= 1.0 or n <= cpr:
    stride, samples = 1, n
  else:
    target = max(pct, cpr)
    stride = int(math.ceil(n / target / 32)) * 32 + 1
    samples = n // stride
    while samples < target:
      stride -= 8
      samples = n // stride
  return stride, samples, int(math.ceil(samples * ratio))


def exact_top_k(v: jax.Array, k: int) -> jax.Array:
  """Indices (int32 ``[k]``) of the ``k`` largest ``|v|``."""
  _, idx = jax.lax.top_k(jnp.abs(v), k)
  return idx.astype(jnp.int32)


def sampled_top_k(v: jax.Array, ratio: float, key: jax.Array, *,
                  sample_ratio: float = 0.01,
                  upper_bound: float = 1.3,
                  lower_bound: float = 0.8,
                  max_adaptation_iters: int = 10) -> jax.Array:
  """The reference implementation's selection, with static shapes.

  1. A threshold from a strided sample (about 1%, random offset): the least
     of the sample's top ``ceil(ratio * samples)`` magnitudes.
  2. Up to ``max_adaptation_iters`` rounds: more than ``upper_bound * k``
     selected entries -> exact top-k among them (which is the exact top-k)
     and stop; fewer than ``lower_bound * k`` -> threshold times
     ``lower_bound``; otherwise stop.
  3. Keep the first ``k`` selected entries **in index order** (not the
     largest; the reference's truncation quirk).

  This is the reference's default ``resample=True`` path (its
  ``resample=False`` alternative, raising the threshold, is not offered).

  The selected count varies; the result always has ``k`` slots and unused
  slots hold the out-of-range index ``n`` (scatters drop them, and they
  carry value 0 on the wire).

  Args:
    v: float32 ``[n]``.
    ratio: the kept ratio (``k = ceil(ratio * n)``).
    key: PRNG key for the sample offset.
    sample_ratio: fraction sampled (clipped to [0.01, 1] as the reference).
    upper_bound: ``1.3`` in the reference.
    lower_bound: ``0.8`` in the reference.
    max_adaptation_iters: ``10`` in the reference.

  Returns:
    int32 ``[k]`` indices, ``n`` for unused slots.
  """
  n = v.shape[0]
  k = num_selected(n, ratio)
  sample_ratio = min(max(sample_ratio, 0.01), 1.0)
  stride, samples, top = _sample_layout(n, ratio, sample_ratio)
  importance = jnp.abs(v)
  if samples == n:
    pool = importance
  else:
    rows = n // stride + 1
    padded = jnp.pad(importance, (0, rows * stride - n),
                     constant_values=-1.0).reshape(rows, stride)
    start = jax.random.randint(key, (), 0, stride)
    pool = jnp.take(padded, start, axis=1)
  threshold = jnp.min(jax.lax.top_k(pool, top)[0])
  count = jnp.sum(importance >= threshold, dtype=jnp.int32)
  resampled = jnp.asarray(False)
  if n > samples:
    above = int(math.floor(k * upper_bound))  # count > k * ub
    below = int(math.ceil(k * lower_bound))  # count < k * lb
    lb = jnp.float32(lower_bound)

    def body(_, carry):
      threshold, count, done, resampled = carry
      too_many = count > above
      too_few = count < below
      resample = ~done & too_many
      shrink = ~done & ~(count > k) & too_few
      resampled = resampled | resample
      done = done | resample | ~shrink
      threshold = jnp.where(shrink, threshold * lb, threshold)
      count = jnp.where(shrink, jnp.sum(importance >= threshold,
                                        dtype=jnp.int32), count)
      return threshold, count, done, resampled

    false = count < 0  # typed like the data (varying under shard_map)
    threshold, _, _, resampled = jax.lax.fori_loop(
        0, max_adaptation_iters, body, (threshold, count, false, false))
  in_order = jnp.nonzero(importance >= threshold, size=k, fill_value=n)[0]
  return jnp.where(resampled, exact_top_k(v, k),
                   in_order.astype(jnp.int32))


class DGCState(NamedTuple):
  """State of :func:`dgc` for one worker.

  Attributes:
    count: int32 scalar, calls so far (drives the sparsity warmup).
    momentum: per leaf, float32 like the leaf: ``u`` (per worker for
      compressed leaves; identical on all workers for the others, where it
      is applied after the average).
    velocity: per leaf, float32 like the leaf: ``v``, the accumulated
      momentum-corrected gradient not sent yet (compressed leaves), else
      ``()``.
  """

  count: jax.Array  # int32 []
  momentum: tuple[Any, ...]  # float32 leaf shape
  velocity: tuple[Any, ...]  # float32 leaf shape, or ()


def dgc(
    density: float = 1e-3,
    *,
    momentum: float = 0.9,
    nesterov: bool = False,
    momentum_masking: bool = True,
    warmup_epochs: int = 0,
    steps_per_epoch: int = 1,
    clip_norm: float | None = None,
    reference_compat: bool = False,
    sample_ratio: float = 0.01,
) -> Compressor:
  r"""Deep Gradient Compression mean over workers.

  Per leaf with two or more dimensions (``n`` elements): momentum
  correction into ``v``, selection of ``k = ceil(rho n)`` entries (exact
  top-k of ``|v|``; ``reference_compat=True`` emulates the reference's
  sampled threshold and index-order truncation, :func:`sampled_top_k`),
  an all-gather of ``(v[I] float32, I int32)``, scatter-add of every
  worker's pairs divided by ``W``, and ``v[I] = 0`` (and ``u[I] = 0`` with
  momentum factor masking). Other leaves: fp32 ``pmean`` ``ḡ`` and then
  ``u ← m u + ḡ`` (Nesterov ``u ← m (u + ḡ)``, output ``u + ḡ``) with ``u``
  identical on all workers.

  The output already includes momentum: chain plain SGD after it, and do not
  add error feedback (``v`` is the error feedback)::

    tx = optax.chain(compressed_all_reduce(dgc(1e-3, warmup_epochs=4,
                                               steps_per_epoch=390)),
                     optax.sgd(0.1))

  Sparsity warmup: in epoch ``e = count // steps_per_epoch`` the kept ratio
  is :func:`dgc_warmup_ratio` ``(e, density, warmup_epochs)``. Every warmup
  stage has its own static ``k``, so the step holds one branch per stage
  (``lax.switch``); under ``vmap`` all branches are evaluated.

  Args:
    density: the kept ratio ``rho`` (the reference's ``compress_ratio``).
    momentum: ``m``.
    nesterov: Nesterov momentum correction.
    momentum_masking: zero ``u`` at the sent entries.
    warmup_epochs: epochs of exponential sparsity warmup (0: none).
    steps_per_epoch: calls per warmup epoch.
    clip_norm: if set, each compressed leaf's local gradient is clipped to
      norm ``clip_norm / sqrt(W)`` before accumulation (the paper's local
      clipping; the reference instead uses a worker-averaged norm).
    reference_compat: use the reference's sampled-threshold selection.
    sample_ratio: sampled fraction in compat mode.

  Returns:
    The compressor; state :class:`DGCState`. Bytes per compressed leaf:
    ``8 k`` (fp32 values + int32 indices; the reference sends int64 indices,
    ``12 k``), at the final density.
  """
  _checks.in_interval(density, 'dgc density', 0, 1, closed='right')
  _checks.nonnegative_int(warmup_epochs, 'dgc warmup_epochs')
  _checks.positive_int(steps_per_epoch, 'dgc steps_per_epoch')
  ratios = [dgc_warmup_ratio(e, density, warmup_epochs)
            for e in range(warmup_epochs + 1)]
  if reference_compat:
    select = functools.partial(sampled_top_k, sample_ratio=sample_ratio)
  else:
    select = _exact_select
  stage_mean = functools.partial(_sparse_mean, select=select,
                                 momentum_masking=momentum_masking)
  accumulate = functools.partial(_accumulate, momentum=momentum,
                                 nesterov=nesterov, clip_norm=clip_norm)

  def init(tree):
    leaves = jax.tree.leaves(tree)
    zeros = [jnp.zeros(jnp.shape(x), jnp.float32) for x in leaves]
    return DGCState(
        jnp.zeros([], jnp.int32), tuple(zeros),
        tuple(z if _compressed(x) else () for z, x in zip(zeros, leaves)))

  def mean(tree, state, comm, key):
    def compressed_leaf(x, uv, key):
      shape = jnp.shape(x)
      u, v = accumulate(x, *uv, comm.size())
      key = jax.random.fold_in(key, comm.index())
      branches = [lambda v, u, r=r: stage_mean(v, u, r, comm, key)
                  for r in ratios]
      if len(branches) == 1:
        avg, own, v, u = branches[0](v, u)
      else:
        stage = jnp.minimum(state.count // steps_per_epoch, warmup_epochs)
        avg, own, v, u = jax.lax.switch(stage, branches, v, u)
      avg, own, u, v = (a.reshape(shape) for a in (avg, own, u, v))
      return avg, own, (u, v)

    def dense_leaf(g, uv):
      u, v = uv
      if nesterov:
        u = momentum * (u + g)
        return u + g, (u, v)
      u = momentum * u + g
      return u, (u, v)

    means, sent, new = compressor_lib.mean_leaves(
        tree, tuple(zip(state.momentum, state.velocity, strict=True)), comm,
        key, compressed_leaf, plain=lambda x: not _compressed(x),
        plain_leaf=dense_leaf)
    moms, vels = (tuple(parts) for parts in zip(*new)) if new else ((), ())
    return means, sent, DGCState(optax.safe_increment(state.count), moms,
                                 vels)

  def payload_bytes(tree):
    total = 0
    for x in jax.tree.leaves(tree):
      n = math.prod(x.shape)
      total += 8 * num_selected(n, density) if len(x.shape) > 1 else 4 * n
    return total

  name = f'dgc(density={density:g}{", compat" if reference_compat else ""})'
  return Compressor(name, init, mean, payload_bytes, feedback=True)


def _compressed(x) -> bool:
  """Whether DGC sparsifies a leaf (two or more dimensions)."""
  return len(jnp.shape(x)) > 1


def _exact_select(v, ratio, key):
  """The exact top-k of ``|v|`` at the kept ``ratio``."""
  del key
  return exact_top_k(v, num_selected(v.shape[0], ratio))


def _accumulate(g, u, v, workers, *, momentum, nesterov, clip_norm):
  """Local clipping and momentum correction of one leaf, flattened.

  Returns:
    ``(u, v)``: the new momentum and the new accumulated velocity, float32
    ``[n]``.
  """
  g = jnp.ravel(jnp.asarray(g, jnp.float32))
  u, v = jnp.ravel(u), jnp.ravel(v)
  if clip_norm is not None:
    limit = clip_norm / math.sqrt(workers)
    norm = jnp.linalg.norm(g)
    g = g * jnp.minimum(1.0, limit / jnp.maximum(norm, 1e-30))
  if nesterov:
    u = momentum * (u + g)
    v = v + u + g
  else:
    u = momentum * u + g
    v = v + u
  return u, v


def _sparse_mean(v, u, ratio, comm, key, *, select, momentum_masking):
  """One warmup stage: select, all-gather, scatter; dense ``[n]`` vectors.

  Returns:
    ``(mean, transmitted, v, u)`` with the sent entries of ``v`` (and of
    ``u``, with momentum factor masking) zeroed.
  """
  n = v.shape[0]
  idx = select(v, ratio, key)
  values = jnp.take(v, idx, mode='fill', fill_value=0.0)
  gathered = comm.all_gather({'values': values, 'indices': idx})
  total = jnp.zeros([n], jnp.float32).at[
      gathered['indices'].reshape(-1)].add(
          gathered['values'].reshape(-1), mode='drop')
  avg = total / comm.size()
  own = jnp.zeros([n], jnp.float32).at[idx].set(values, mode='drop')
  v = v.at[idx].set(0.0, mode='drop')
  if momentum_masking:
    u = u.at[idx].set(0.0, mode='drop')
  return avg, own, v, u
