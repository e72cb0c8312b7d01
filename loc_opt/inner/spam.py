"""SPAM and Stable-SPAM: Adam with spike clipping and momentum resets.

SPAM adds to Adam a periodic reset of both moments, spike-aware elementwise
clipping against the second moment, a cosine re-warmup of the update after
each reset and, optionally, momentum kept only on a random subset of the
entries of 2-D weights. Stable-SPAM replaces the spike clip by an adaptive
per-tensor max clip (AdaClip) and a per-tensor norm rescaling (AdaGN), resets
the bias correction along with the moments (MoRet) and can anneal β₁.

Both are fused transforms (one state, one pass over the moments); the same
rules are available as separate pieces in :mod:`loc_opt.inner.clipping`.
``reference_compat=True`` reproduces the quirks of the authors' PyTorch code
(listed in each docstring); the default follows the documented math.

References:
  Huang, Zhu, Jin, Liu, Wang, Liu, *SPAM: Spike-Aware Adam with Momentum
  Reset for Stable LLM Training*, ICLR 2025.

  Huang, Hu, Jaiswal, Wang, Liu, Liu, *Stable-SPAM: How to Train in 4-Bit
  More Stably than 16-Bit Adam*, 2025.
"""

from collections.abc import Callable
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loc_opt.inner import clipping

ArrayLike = jax.typing.ArrayLike

_NO_PARAMS = 'weight decay needs params: call update(updates, state, params)'

# SPAM's re-warmup starts the update at this fraction of its full size.
_WARMUP_FLOOR = 0.01


def _moment_dtype(param_dtype, mu_dtype):
  if mu_dtype is not None:
    return jnp.dtype(mu_dtype)
  return jnp.promote_types(param_dtype, jnp.float32)


def _bias_correction(decay: ArrayLike, count: ArrayLike) -> jax.Array:
  decay = jnp.asarray(decay, jnp.float32)
  return 1.0 - decay ** jnp.asarray(count, jnp.float32)


def _leaf_flags(mask: Any, tree: Any) -> list[bool]:
  """Static per-leaf booleans from an Optax-style mask (None: all True)."""
  n = len(jax.tree.leaves(tree))
  if mask is None:
    return [True] * n
  if callable(mask):
    mask = mask(tree)
  flags = jax.tree.leaves(mask)
  if len(flags) != n:
    raise ValueError(f'mask has {len(flags)} leaves, params have {n}')
  return [bool(f) for f in flags]


# ---------------------------------------------------------------------------
# SPAM
# ---------------------------------------------------------------------------


def spam_warmup_factor(
    steps_since_reset: ArrayLike, warmup_steps: ArrayLike
) -> jax.Array:
  r"""SPAM's cosine re-warmup factor after a momentum reset.

  .. math::

    \phi(j) = 1 - 0.99\,\frac{1 + \cos(\pi j / (N + 1))}{2}
    \quad (j < N), \qquad \phi(j) = 1 \quad (j \ge N),

  where :math:`j` counts steps since the reset (0 on the reset step) and
  :math:`N` is ``warmup_steps``. So :math:`\phi(0) = 0.01` and
  ``warmup_steps=0`` means no warmup.

  Args:
    steps_since_reset: :math:`j` (scalar or array, int or float).
    warmup_steps: :math:`N`.

  Returns:
    :math:`\phi(j)` in float32.
  """
  j = jnp.asarray(steps_since_reset, jnp.float32)
  n = jnp.asarray(warmup_steps, jnp.float32)
  ramp = 1.0 - (1.0 - _WARMUP_FLOOR) * 0.5 * (
      1.0 + jnp.cos(jnp.pi * j / (n + 1.0)))
  return jnp.where(j < n, ramp, 1.0)


class ScaleBySpamState(NamedTuple):
  """State of :func:`scale_by_spam`.

  Attributes:
    count: int32 scalar, updates taken (``k``). Also the Adam
      bias-correction power less one: SPAM never resets it.
    mu: first moment, a tree like the params. Dense leaves: the param shape
      in ``mu_dtype`` (float32 by default). Sparse leaves: float32 ``(K,)``,
      the moments of the ``K`` masked entries; with ``reference_compat`` the
      param shape instead (zero off the mask).
    nu: second moment, float32, shapes as ``mu``.
    masks: one entry per sparse leaf in tree-flatten order; empty when
      ``density`` is None. Default: int32 ``(K,)`` sorted flat indices of the
      entries that keep moments. ``reference_compat``: a bool array of the
      param's shape.
    key: uint32 ``(2,)`` PRNG key data for the mask draws.
  """

  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  masks: tuple[jax.Array, ...]
  key: jax.Array


def _check_density(density):
  if density is None:
    return None
  if isinstance(density, jax.core.Tracer):
    raise TypeError(
        'density sets the static size of the sparse momentum and cannot be '
        'traced: with optax.inject_hyperparams pass static_args=("density",)')
  density = float(density)
  if not 0.0 < density <= 1.0:
    raise ValueError(f'density must lie in (0, 1], got {density}')
  return None if density == 1.0 else density


def _sparse_flags(tree, density, density_group) -> list[bool]:
  """Which leaves keep sparse momentum: 2-D leaves of the density group."""
  leaves = jax.tree.leaves(tree)
  if density is None:
    return [False] * len(leaves)
  group = _leaf_flags(density_group, tree)
  return [g and x.ndim == 2 for g, x in zip(group, leaves)]


def _num_kept(size: int, density: float) -> int:
  k = int(np.floor(density * size))
  if k < 1:
    raise ValueError(f'density {density} keeps no entry of a leaf with '
                     f'{size} entries')
  return k


def _draw_indices(key, size: int, k: int) -> jax.Array:
  """``k`` distinct flat indices in ``[0, size)``, sorted (int32)."""
  return jnp.sort(jax.random.permutation(key, size)[:k]).astype(jnp.int32)


def _draw_exact_mask(key, shape, k: int) -> jax.Array:
  """A bool mask of ``shape`` with exactly ``k`` True entries."""
  size = int(np.prod(shape))
  flat = jnp.zeros([size], bool).at[_draw_indices(key, size, k)].set(True)
  return flat.reshape(shape)


def _explicit_sharding(x):
  """The explicit mesh sharding of ``x``'s type, or None when it has none."""
  sharding = jax.typeof(x).sharding
  if sharding.mesh.empty or all(p is None for p in sharding.spec):
    return None
  return sharding


def _gather(x: jax.Array, idx: jax.Array) -> jax.Array:
  """``x[idx]``, replicated when ``x`` is sharded on an explicit mesh."""
  sharding = _explicit_sharding(x)
  if sharding is None:
    return x[idx]
  return x.at[idx].get(
      out_sharding=jax.NamedSharding(sharding.mesh, jax.P()))


def _scatter(values: jax.Array, idx: jax.Array, like: jax.Array) -> jax.Array:
  """Zeros shaped like ``like`` with ``values`` at flat positions ``idx``."""
  out = jnp.zeros([like.size], values.dtype).at[idx].set(values)
  out = out.reshape(like.shape)
  sharding = _explicit_sharding(like)
  if sharding is not None:
    out = jax.reshard(out, sharding.spec)
  return out


def _leaf_key(key_data, leaf: int, count) -> jax.Array:
  key = jax.random.wrap_key_data(key_data)
  return jax.random.fold_in(jax.random.fold_in(key, leaf), count)


@jax.jit
def _decay_updated(u, p, rate):
  """``u - rate (p + u)``: decay of the updated parameter ``p + u``."""
  return (u - rate * (p + u)).astype(u.dtype)


@jax.jit
def _decay_kept(u, p, weight_decay, kept):
  """``u + wd p`` on the kept entries (flat indices; None: all)."""
  d = weight_decay * p
  if kept is not None:
    d = jnp.where(_scatter(jnp.ones(kept.shape, bool), kept, p), d, 0.0)
  return (u + d).astype(u.dtype)


# Per-step kernels. They are jitted at module level so that eager updates
# reuse one compiled program per shape instead of compiling op by op; under
# an outer jit they are inlined.


@jax.jit
def _spam_schedule(count, reset_interval, warmup_steps, clip_delay, b1, b2):
  """``(k + 1, reset?, clip on?, phi * sqrt(bc2) / bc1)`` for update k."""
  interval = jnp.asarray(reset_interval, jnp.int32)
  resets = interval > 0
  step = optax.safe_increment(count)  # k + 1
  pos = jnp.where(resets, step % jnp.maximum(interval, 1), step)
  reset = resets & (pos == 0)
  delay = jnp.asarray(clip_delay, jnp.int32)
  clip_on = (step >= delay) & (pos >= delay)
  before_first_reset = ~resets | (step < interval)
  phi = spam_warmup_factor(
      jnp.where(before_first_reset, warmup_steps, pos), warmup_steps)
  scale = phi * jnp.sqrt(_bias_correction(b2, step)) / _bias_correction(
      b1, step)
  return step, reset, clip_on, scale


def _spam_moments(g, m, v, reset, clip_on, scale, threshold, b1, b2, eps):
  """Reset, clip, EMA updates and direction; all float32."""
  b1 = jnp.asarray(b1, jnp.float32)
  b2 = jnp.asarray(b2, jnp.float32)
  m = jnp.where(reset, 0.0, m.astype(jnp.float32))
  v = jnp.where(reset, 0.0, v)
  g = clipping.spike_clip(g, v, threshold, clip_on)
  m = b1 * m + (1.0 - b1) * g
  v = b2 * v + (1.0 - b2) * jnp.square(g)
  return m, v, scale * m / (jnp.sqrt(v) + eps)


@jax.jit
def _spam_dense_leaf(g, m, v, *hps):
  m_new, v_new, u = _spam_moments(g, m, v, *hps)
  return u.astype(g.dtype), m_new.astype(m.dtype), v_new


@jax.jit
def _spam_indexed_leaf(g, m, v, idx, key_data, leaf, step, reset, *hps):
  """Sparse leaf with compact moments at the flat indices ``idx``."""
  key = _leaf_key(key_data, leaf, step)
  idx = jax.lax.cond(reset, lambda k: _draw_indices(k, g.size, idx.shape[0]),
                     lambda _: idx, key)
  m_new, v_new, u = _spam_moments(_gather(g.reshape(-1), idx), m, v, reset,
                                  *hps)
  return _scatter(u, idx, g).astype(g.dtype), m_new, v_new, idx


@functools.partial(jax.jit, static_argnames=('density',))
def _spam_bernoulli_leaf(g, m, v, mask, key_data, leaf, step, reset, *hps,
                         density):
  """Sparse leaf with dense moments and a bool mask (reference_compat)."""
  key = _leaf_key(key_data, leaf, step)
  mask = jax.lax.cond(
      reset, lambda k: jax.random.bernoulli(k, density, mask.shape),
      lambda _: mask, key)
  g_kept = jnp.where(mask, g.astype(jnp.float32), 0.0)
  m_new, v_new, u = _spam_moments(g_kept, m, v, reset, *hps)
  return jnp.where(mask, u, 0.0).astype(g.dtype), m_new, v_new, mask


def scale_by_spam(
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-6,
    threshold: ArrayLike = 5000.0,
    reset_interval: ArrayLike = 500,
    warmup_steps: ArrayLike = 150,
    clip_delay: ArrayLike = 20,
    *,
    density: float | None = None,
    density_group: Any = None,
    seed: int = 0,
    mu_dtype: Any = None,
    reference_compat: bool = False,
) -> optax.GradientTransformation:
  r"""The update direction of SPAM (spike-aware Adam with momentum reset).

  On update :math:`k = 0, 1, \dots` (:math:`k` updates taken before it, Adam
  power :math:`s = k+1`, reset period :math:`\Delta T`, position in the
  window :math:`p = (k+1) \bmod \Delta T`):

  1. *Reset*: if :math:`p = 0`, :math:`m \leftarrow 0, v \leftarrow 0`
     (:math:`s` is not reset). The first reset is the :math:`\Delta T`-th
     update.
  2. *Spike clip* (see :func:`~loc_opt.inner.clipping.spike_clip`): if
     :math:`\theta > 0`, :math:`k+1 \ge A` and :math:`p \ge A`,
     :math:`g_i \leftarrow \operatorname{sign}(g_i)\sqrt{\theta v_i}` where
     :math:`g_i^2 > \theta v_i`, against the stored (not bias-corrected,
     just reset) :math:`v`.
  3. *Moments*: :math:`m \leftarrow \beta_1 m + (1-\beta_1) g`,
     :math:`v \leftarrow \beta_2 v + (1-\beta_2) g^2`.
  4. *Direction*:

     .. math::

       u = \phi(j)\,\frac{\sqrt{1-\beta_2^s}}{1-\beta_1^s}\,
           \frac{m}{\sqrt{v} + \epsilon},

     with the re-warmup :func:`spam_warmup_factor` at :math:`j = p` after the
     first reset (:math:`\phi = 1` before it). Epsilon is added to the
     uncorrected :math:`\sqrt v` (the Hugging Face AdamW convention).

  A coordinate whose :math:`v` is still 0 when the clip is on (its gradient
  was exactly zero since the reset) has bound 0 and is zeroed, as in the
  reference; ``clip_delay >= 1`` keeps the reset step itself unclipped.

  *Sparse momentum* (``density`` :math:`d < 1`): on the 2-D leaves of
  ``density_group`` only :math:`K = \lfloor d \cdot \mathrm{size} \rfloor`
  entries keep moments and receive updates; the others get a zero update.
  The kept set is drawn uniformly without replacement at init and redrawn on
  every reset step (moments there start from zero anyway). Mask draws use
  ``fold_in(key(seed), leaf index, step)``, so workers initialized from the
  same seed share masks.

  ``reference_compat=True`` reproduces the reference code: redrawn masks
  are Bernoulli(:math:`d`) with a random count (the initial one has exactly
  :math:`K` entries), which needs dense moments for sparse leaves. With
  ``density=None`` the two modes are identical.

  Args:
    b1: the first-moment decay :math:`\beta_1`.
    b2: the second-moment decay :math:`\beta_2`.
    eps: :math:`\epsilon`, added to :math:`\sqrt v`.
    threshold: the spike ratio :math:`\theta`; ``0`` disables clipping,
      ``inf`` never clips.
    reset_interval: :math:`\Delta T`; ``<= 0`` never resets (and never warms
      up).
    warmup_steps: :math:`N`, the re-warmup length after each reset; ``0`` for
      none. (The reference training script passes its LR warmup, 1000, here;
      use ``warmup_steps=1000`` to reproduce that run.)
    clip_delay: :math:`A`, the steps at the start of training and of every
      window during which clipping is off (the reference's
      ``grad_accu_steps``).
    density: the fraction :math:`d` of entries of sparse leaves that keep
      momentum; None (or 1) for dense Adam moments everywhere. Static: pass
      it in ``static_args`` under ``optax.inject_hyperparams``.
    density_group: which leaves may be sparse, a tree of bools or a callable
      ``params -> tree of bools`` (default: all); only 2-D leaves ever are.
    seed: the seed of the mask draws.
    mu_dtype: dtype of dense first moments (default float32).
    reference_compat: reproduce the reference code's Bernoulli mask redraw.

  Returns:
    An ``optax.GradientTransformation``; updates keep the gradients' dtype.

  Example:
    >>> import optax
    >>> from loc_opt.inner import scale_by_spam
    >>> tx = optax.chain(scale_by_spam(), optax.scale_by_learning_rate(1e-3))

  References:
    Huang, Zhu, Jin, Liu, Wang, Liu, *SPAM: Spike-Aware Adam with Momentum
    Reset for Stable LLM Training*, ICLR 2025.
  """
  density = _check_density(density)

  def init_fn(params):
    leaves, treedef = jax.tree.flatten(params)
    flags = _sparse_flags(params, density, density_group)
    key_data = jax.random.key_data(jax.random.key(seed))
    mu, nu, masks = [], [], []
    for i, (p, sparse) in enumerate(zip(leaves, flags)):
      if not sparse:
        mu.append(jnp.zeros_like(p, _moment_dtype(p.dtype, mu_dtype)))
        nu.append(jnp.zeros_like(p, jnp.float32))
        continue
      k = _num_kept(p.size, density)
      key = _leaf_key(key_data, i, 0)
      if reference_compat:
        masks.append(_draw_exact_mask(key, p.shape, k))
        mu.append(jnp.zeros_like(p, jnp.float32))
        nu.append(jnp.zeros_like(p, jnp.float32))
      else:
        masks.append(_draw_indices(key, p.size, k))
        mu.append(jnp.zeros([k], jnp.float32))
        nu.append(jnp.zeros([k], jnp.float32))
    return ScaleBySpamState(
        count=jnp.zeros([], jnp.int32),
        mu=treedef.unflatten(mu),
        nu=treedef.unflatten(nu),
        masks=tuple(masks),
        key=key_data,
    )

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    flags = _sparse_flags(updates, density, density_group)
    mu_leaves = treedef.flatten_up_to(state.mu)
    nu_leaves = treedef.flatten_up_to(state.nu)
    step, *sched = _spam_schedule(state.count, reset_interval, warmup_steps,
                                  clip_delay, b1, b2)
    hps = (*sched, threshold, b1, b2, eps)

    out, new_mu, new_nu, new_masks = [], [], [], []
    masks = iter(state.masks)
    for i, (g, m, v, sparse) in enumerate(
        zip(leaves, mu_leaves, nu_leaves, flags)):
      if not sparse:
        u, m, v = _spam_dense_leaf(g, m, v, *hps)
      elif reference_compat:
        u, m, v, mask = _spam_bernoulli_leaf(
            g, m, v, next(masks), state.key, i, step, *hps, density=density)
        new_masks.append(mask)
      else:
        u, m, v, mask = _spam_indexed_leaf(g, m, v, next(masks), state.key,
                                           i, step, *hps)
        new_masks.append(mask)
      out.append(u)
      new_mu.append(m)
      new_nu.append(v)

    return treedef.unflatten(out), ScaleBySpamState(
        count=step,
        mu=treedef.unflatten(new_mu),
        nu=treedef.unflatten(new_nu),
        masks=tuple(new_masks),
        key=state.key,
    )

  return optax.GradientTransformation(init_fn, update_fn)


class _CountState(NamedTuple):
  """State of the private decay transforms below.

  Attributes:
    count: int32 scalar, updates taken (indexes a learning-rate schedule).
  """

  count: jax.Array


def _decay_after_step(
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: ArrayLike,
    flags_fn: Callable[[Any], list[bool]],
) -> optax.GradientTransformation:
  """Decoupled decay of the *updated* params: ``u - lr wd (p + u)``.

  Goes after ``scale_by_learning_rate``; ``u`` is already scaled.
  """

  def init_fn(params):
    del params
    return _CountState(jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(_NO_PARAMS)
    lr = (learning_rate(state.count) if callable(learning_rate)
          else learning_rate)
    rate = jnp.asarray(lr, jnp.float32) * weight_decay
    leaves, treedef = jax.tree.flatten(updates)
    out = []
    for u, p, on in zip(leaves, treedef.flatten_up_to(params),
                        flags_fn(params)):
      out.append(_decay_updated(u, p, rate) if on else u)
    return treedef.unflatten(out), _CountState(
        optax.safe_increment(state.count))

  return optax.GradientTransformation(init_fn, update_fn)


def _with_decay_on_active(
    direction: optax.GradientTransformation,
    weight_decay: ArrayLike,
    mask: Any,
    sparse_fn: Callable[[Any], list[bool]],
) -> optax.GradientTransformation:
  """``direction`` plus ``wd * p`` on the entries it updated this step."""

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(_NO_PARAMS)
    out, new_state = direction.update(updates, state, params)
    leaves, treedef = jax.tree.flatten(out)
    masks = iter(new_state.masks)
    decayed = []
    for u, p, on, sparse in zip(leaves, treedef.flatten_up_to(params),
                                _leaf_flags(mask, params), sparse_fn(out)):
      kept = next(masks) if sparse else None
      decayed.append(_decay_kept(u, p, weight_decay, kept) if on else u)
    return treedef.unflatten(decayed), new_state

  return optax.GradientTransformation(direction.init, update_fn)


def spam(
    learning_rate: optax.ScalarOrSchedule = 1e-3,
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-6,
    threshold: ArrayLike = 5000.0,
    reset_interval: ArrayLike = 500,
    warmup_steps: ArrayLike = 150,
    clip_delay: ArrayLike = 20,
    weight_decay: ArrayLike = 0.0,
    mask: Any = None,
    *,
    density: float | None = None,
    density_group: Any = None,
    seed: int = 0,
    mu_dtype: Any = None,
    reference_compat: bool = False,
) -> optax.GradientTransformation:
  r"""SPAM: spike-aware Adam with momentum reset and decoupled weight decay.

  ``optax.chain(scale_by_spam(...), optax.add_decayed_weights(weight_decay,
  mask), optax.scale_by_learning_rate(learning_rate))``: the parameter step
  is :math:`-\eta_t (u + \lambda \theta)`, with the decay not scaled by the
  re-warmup. See :func:`scale_by_spam` for :math:`u`.

  With sparse momentum (``density < 1``) the decay touches only the entries
  updated this step (their mask is read from the state), so frozen entries
  stay frozen.

  ``reference_compat=True`` also reproduces the reference code's decay: it
  acts on the *updated* parameters, :math:`\theta \leftarrow (\theta -
  \eta_t u)(1 - \eta_t \lambda)`, and is a no-op on the sparse leaves (the
  reference decays an indexing copy).

  Args:
    learning_rate: :math:`\eta`, a float or a schedule.
    b1: see :func:`scale_by_spam`.
    b2: see :func:`scale_by_spam`.
    eps: see :func:`scale_by_spam`.
    threshold: see :func:`scale_by_spam`.
    reset_interval: see :func:`scale_by_spam`.
    warmup_steps: see :func:`scale_by_spam`.
    clip_delay: see :func:`scale_by_spam`.
    weight_decay: :math:`\lambda`.
    mask: which leaves decay, as in ``optax.add_decayed_weights``, given as a
      full tree of bools or a callable returning one.
    density: see :func:`scale_by_spam`.
    density_group: see :func:`scale_by_spam`.
    seed: see :func:`scale_by_spam`.
    mu_dtype: see :func:`scale_by_spam`.
    reference_compat: reproduce the reference code (mask redraw and decay).

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> from loc_opt.inner import spam
    >>> tx = spam(8e-4, threshold=5000.0, reset_interval=500)

  References:
    Huang, Zhu, Jin, Liu, Wang, Liu, *SPAM: Spike-Aware Adam with Momentum
    Reset for Stable LLM Training*, ICLR 2025.
  """
  direction = scale_by_spam(
      b1, b2, eps, threshold, reset_interval, warmup_steps, clip_delay,
      density=density, density_group=density_group, seed=seed,
      mu_dtype=mu_dtype, reference_compat=reference_compat)
  density = _check_density(density)

  def sparse_fn(tree):
    return _sparse_flags(tree, density, density_group)

  if reference_compat:

    def decay_flags(params):
      return [on and not sparse for on, sparse in zip(
          _leaf_flags(mask, params), sparse_fn(params))]

    return optax.chain(
        direction,
        optax.scale_by_learning_rate(learning_rate),
        _decay_after_step(learning_rate, weight_decay, decay_flags),
    )
  if density is not None:
    return optax.chain(
        _with_decay_on_active(direction, weight_decay, mask, sparse_fn),
        optax.scale_by_learning_rate(learning_rate),
    )
  return optax.chain(
      direction,
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )


# ---------------------------------------------------------------------------
# Stable-SPAM
# ---------------------------------------------------------------------------


def stable_spam_kappa(
    count: ArrayLike,
    total_steps: ArrayLike,
    kappa_min: ArrayLike = 0.5,
    *,
    clamp: bool = True,
) -> jax.Array:
  r"""Stable-SPAM's annealing factor for :math:`\beta_1` and :math:`\gamma_1`.

  .. math::

    \kappa_t = \kappa_{min} + (1 - \kappa_{min})
      \frac{1 + \cos(\pi t / (T + 1))}{2},

  falling from about 1 at :math:`t = 1` to :math:`\kappa_{min}` at
  :math:`t = T + 1`. With ``clamp`` it stays there for :math:`t > T`; without
  it (the reference code) the cosine rises again.

  Args:
    count: the 1-based step :math:`t`.
    total_steps: :math:`T`.
    kappa_min: the final value (the reference's ``eta_min``).
    clamp: hold :math:`\kappa_{min}` after :math:`T + 1` steps.

  Returns:
    :math:`\kappa_t` in float32.
  """
  t = jnp.asarray(count, jnp.float32)
  total = jnp.asarray(total_steps, jnp.float32)
  if clamp:
    t = jnp.minimum(t, total + 1.0)
  kappa_min = jnp.asarray(kappa_min, jnp.float32)
  return kappa_min + (1.0 - kappa_min) * 0.5 * (
      1.0 + jnp.cos(jnp.pi * t / (total + 1.0)))


class ScaleByStableSpamState(NamedTuple):
  """State of :func:`scale_by_stable_spam`.

  Attributes:
    count: int32 scalar, updates taken (``t``); never reset. Indexes the
      annealing and, by default, the AdaClip/AdaGN bias corrections.
    adam_count: int32 scalar, the Adam bias-correction power ``s``; set to 1
      by every momentum reset.
    mu: first moment, a tree like the params in ``mu_dtype`` (float32 by
      default).
    nu: second moment, a float32 tree like the params.
    max_ema: tree of float32 scalars, one per leaf: AdaClip's EMA of
      ``max |g|``.
    norm_mu: tree of float32 scalars, one per leaf: AdaGN's EMA of ``||g||``.
    norm_nu: tree of float32 scalars, one per leaf: AdaGN's EMA of
      ``||g||^2``.
  """

  count: jax.Array
  adam_count: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  max_ema: optax.Updates
  norm_mu: optax.Updates
  norm_nu: optax.Updates


@functools.partial(jax.jit, static_argnames=('anneal', 'compat'))
def _stable_spam_schedule(count, adam_count, reset_interval, total_steps,
                          kappa_min, b1, b2, gamma1, *, anneal, compat):
  """Counters and per-step scalars of update ``count + 1``."""
  t = optax.safe_increment(count)
  s = optax.safe_increment(adam_count)
  if anneal:
    kappa = stable_spam_kappa(t, total_steps, kappa_min, clamp=not compat)
  else:
    kappa = jnp.ones([], jnp.float32)
  interval = jnp.asarray(reset_interval, jnp.int32)
  reset = (interval > 0) & (t % jnp.maximum(interval, 1) == 0)
  adam_count = jnp.where(reset, 1, s).astype(jnp.int32)
  b1_t = jnp.asarray(b1, jnp.float32) * kappa
  return (t, adam_count, reset, s if compat else t,
          jnp.asarray(gamma1, jnp.float32) * kappa, b1_t,
          _bias_correction(b1_t, adam_count), _bias_correction(b2, adam_count))


@functools.partial(jax.jit, static_argnames=('ada_clip', 'ada_gn', 'compat'))
def _stable_spam_leaf(g, m, v, mx, nm, nv, reset, ema_count, g1, b1_t, bc1,
                      bc2, gamma2, gamma3, b2, eps, *, ada_clip, ada_gn,
                      compat):
  """AdaClip, AdaGN, MoRet and Adam for one leaf."""
  dtype = g.dtype
  g = g.astype(jnp.float32)
  if ada_clip:
    g, mx = clipping.max_ema_clip(g, mx, gamma3, ema_count)
  if ada_gn:
    g, nm, nv = clipping.norm_ema_rescale(g, nm, nv, g1, gamma2, eps,
                                          ema_count)
  b2 = jnp.asarray(b2, jnp.float32)
  m32 = m.astype(jnp.float32)
  if not compat:
    m32 = jnp.where(reset, 0.0, m32)
    v = jnp.where(reset, 0.0, v)
  m32 = b1_t * m32 + (1.0 - b1_t) * g
  v = b2 * v + (1.0 - b2) * jnp.square(g)
  u = (m32 / bc1) / (jnp.sqrt(v / bc2) + eps)
  if compat:  # The fresh zeros take effect from the next step.
    m32 = jnp.where(reset, 0.0, m32)
    v = jnp.where(reset, 0.0, v)
  return u.astype(dtype), m32.astype(m.dtype), v, mx, nm, nv


def scale_by_stable_spam(
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-8,
    gamma1: ArrayLike | None = 0.7,
    gamma2: ArrayLike = 0.9,
    gamma3: ArrayLike = 0.999,
    reset_interval: ArrayLike = 1000,
    total_steps: ArrayLike | None = None,
    kappa_min: ArrayLike = 0.5,
    *,
    ada_clip: bool = True,
    ada_gn: bool = True,
    mu_dtype: Any = None,
    reference_compat: bool = False,
) -> optax.GradientTransformation:
  r"""The update direction of Stable-SPAM.

  On update :math:`t = 1, 2, \dots` with Adam power :math:`s` (since the last
  reset) and :math:`\kappa_t` from :func:`stable_spam_kappa` (1 when
  ``total_steps`` is None), per leaf:

  1. *AdaClip* (:func:`~loc_opt.inner.clipping.max_ema_clip`, decay
     :math:`\gamma_3`): entries above the bias-corrected EMA of
     :math:`\max|g|` are scaled down proportionally.
  2. *AdaGN* (:func:`~loc_opt.inner.clipping.norm_ema_rescale`, decays
     :math:`\gamma_1\kappa_t, \gamma_2`): the tensor is rescaled to the
     EMA-predicted norm.
  3. *MoRet*: if :math:`t \bmod \Delta T = 0`, :math:`m, v \leftarrow 0` and
     :math:`s \leftarrow 1`.
  4. *Adam* with :math:`\beta_1' = \beta_1\kappa_t`:
     :math:`m \leftarrow \beta_1' m + (1-\beta_1') g`,
     :math:`v \leftarrow \beta_2 v + (1-\beta_2) g^2`,

     .. math::

       u = \frac{m / (1 - \beta_1'^{\,s})}{\sqrt{v / (1-\beta_2^s)} +
           \epsilon}.

  By default the AdaClip/AdaGN bias corrections use the never-reset step
  :math:`t` and :math:`\kappa` is held at ``kappa_min`` after
  ``total_steps``. ``reference_compat=True`` reproduces the reference code:

  * the AdaClip/AdaGN bias corrections use :math:`s`, so they restart at
    every reset (inflating the clip threshold by :math:`1/(1-\gamma_3^s)`);
  * the reset step still updates and uses the old moments (with :math:`s =
    1` bias corrections); the zeros take effect on the next step;
  * :math:`\kappa_t` is not clamped after ``total_steps``.

  Args:
    b1: :math:`\beta_1`.
    b2: :math:`\beta_2`.
    eps: :math:`\epsilon` of Adam and AdaGN.
    gamma1: AdaGN's norm-EMA decay :math:`\gamma_1`; None uses ``b1``.
    gamma2: AdaGN's squared-norm-EMA decay :math:`\gamma_2`.
    gamma3: AdaClip's decay :math:`\gamma_3`.
    reset_interval: :math:`\Delta T`; ``<= 0`` never resets.
    total_steps: :math:`T` of the :math:`\kappa` annealing; None: no
      annealing.
    kappa_min: the final :math:`\kappa`.
    ada_clip: apply AdaClip.
    ada_gn: apply AdaGN.
    mu_dtype: dtype of the first moment (default float32).
    reference_compat: reproduce the reference code (see above).

  Returns:
    An ``optax.GradientTransformation``; updates keep the gradients' dtype.

  Example:
    >>> import optax
    >>> from loc_opt.inner import scale_by_stable_spam
    >>> tx = optax.chain(scale_by_stable_spam(total_steps=20_000),
    ...                  optax.scale_by_learning_rate(4e-4))

  References:
    Huang, Hu, Jaiswal, Wang, Liu, Liu, *Stable-SPAM: How to Train in 4-Bit
    More Stably than 16-Bit Adam*, 2025.
  """

  def init_fn(params):
    scalars = jax.tree.map(lambda _: jnp.zeros([], jnp.float32), params)
    zero = jnp.zeros([], jnp.int32)
    return ScaleByStableSpamState(
        count=zero,
        adam_count=zero,
        mu=jax.tree.map(
            lambda p: jnp.zeros_like(p, _moment_dtype(p.dtype, mu_dtype)),
            params),
        nu=jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params),
        max_ema=scalars,
        norm_mu=scalars,
        norm_nu=scalars,
    )

  def update_fn(updates, state, params=None):
    del params
    t, adam_count, reset, *sched = _stable_spam_schedule(
        state.count, state.adam_count, reset_interval,
        0 if total_steps is None else total_steps, kappa_min, b1, b2,
        b1 if gamma1 is None else gamma1, anneal=total_steps is not None,
        compat=reference_compat)
    hps = (reset, *sched, gamma2, gamma3, b2, eps)
    treedef = jax.tree.structure(updates)
    flat = [treedef.flatten_up_to(x) for x in (
        updates, state.mu, state.nu, state.max_ema, state.norm_mu,
        state.norm_nu)]
    results = [
        _stable_spam_leaf(*leaf, *hps, ada_clip=ada_clip, ada_gn=ada_gn,
                          compat=reference_compat)
        for leaf in zip(*flat)]
    u, mu, nu, max_ema, norm_mu, norm_nu = (
        treedef.unflatten(list(col)) for col in zip(*results))
    return u, ScaleByStableSpamState(
        count=t, adam_count=adam_count, mu=mu, nu=nu, max_ema=max_ema,
        norm_mu=norm_mu, norm_nu=norm_nu)

  return optax.GradientTransformation(init_fn, update_fn)


def stable_spam(
    learning_rate: optax.ScalarOrSchedule = 1e-3,
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-8,
    gamma1: ArrayLike | None = 0.7,
    gamma2: ArrayLike = 0.9,
    gamma3: ArrayLike = 0.999,
    reset_interval: ArrayLike = 1000,
    total_steps: ArrayLike | None = None,
    kappa_min: ArrayLike = 0.5,
    weight_decay: ArrayLike = 0.0,
    mask: Any = None,
    *,
    ada_clip: bool = True,
    ada_gn: bool = True,
    mu_dtype: Any = None,
    reference_compat: bool = False,
) -> optax.GradientTransformation:
  r"""Stable-SPAM with decoupled weight decay.

  ``optax.chain(scale_by_stable_spam(...), optax.add_decayed_weights(
  weight_decay, mask), optax.scale_by_learning_rate(learning_rate))``. The
  decay acts on the pre-update parameters, which is the reference's order
  (decay first, then the Adam step), so both modes share it.

  Args:
    learning_rate: :math:`\eta`, a float or a schedule.
    b1: see :func:`scale_by_stable_spam`.
    b2: see :func:`scale_by_stable_spam`.
    eps: see :func:`scale_by_stable_spam`.
    gamma1: see :func:`scale_by_stable_spam`.
    gamma2: see :func:`scale_by_stable_spam`.
    gamma3: see :func:`scale_by_stable_spam`.
    reset_interval: see :func:`scale_by_stable_spam`.
    total_steps: see :func:`scale_by_stable_spam`.
    kappa_min: see :func:`scale_by_stable_spam`.
    weight_decay: :math:`\lambda`.
    mask: which leaves decay, as in ``optax.add_decayed_weights``.
    ada_clip: see :func:`scale_by_stable_spam`.
    ada_gn: see :func:`scale_by_stable_spam`.
    mu_dtype: see :func:`scale_by_stable_spam`.
    reference_compat: see :func:`scale_by_stable_spam`.

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> from loc_opt.inner import stable_spam
    >>> tx = stable_spam(4e-4, gamma1=0.7, gamma2=0.9, reset_interval=500,
    ...                  total_steps=20_000)

  References:
    Huang, Hu, Jaiswal, Wang, Liu, Liu, *Stable-SPAM: How to Train in 4-Bit
    More Stably than 16-Bit Adam*, 2025.
  """
  return optax.chain(
      scale_by_stable_spam(
          b1, b2, eps, gamma1, gamma2, gamma3, reset_interval, total_steps,
          kappa_min, ada_clip=ada_clip, ada_gn=ada_gn, mu_dtype=mu_dtype,
          reference_compat=reference_compat),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
