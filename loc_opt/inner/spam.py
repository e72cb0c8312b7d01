"""SPAM: Adam with spike-aware clipping and periodic momentum resets.

SPAM adds to Adam a periodic reset of both moments, spike-aware elementwise
clipping against the second moment, a cosine re-warmup of the update after
each reset and, optionally, momentum kept only on a random subset of the
entries of 2-D weights (the machinery is in
:mod:`loc_opt.inner._sparse_momentum`).

:func:`scale_by_spam` is a fused transform (one state, one pass over the
moments); the same rules are available as separate pieces in
:mod:`loc_opt.inner.clipping`. ``reference_compat=True`` reproduces the
quirks of the authors' PyTorch code (listed in each docstring); the default
follows the documented math.

References:
  Huang, Zhu, Jin, Liu, Wang, Liu, *SPAM: Spike-Aware Adam with Momentum
  Reset for Stable LLM Training*, ICLR 2025.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loc_opt.inner import _sparse_momentum
from loc_opt.inner import clipping

ArrayLike = jax.typing.ArrayLike

# SPAM's re-warmup starts the update at this fraction of its full size.
_WARMUP_FLOOR = 0.01


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
  bc1 = _sparse_momentum.bias_correction(b1, step)
  bc2 = _sparse_momentum.bias_correction(b2, step)
  scale = phi * jnp.sqrt(bc2) / bc1
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
  key = _sparse_momentum.leaf_key(key_data, leaf, step)
  idx = jax.lax.cond(
      reset, lambda k: _sparse_momentum.draw_indices(k, g.size, idx.shape[0]),
      lambda _: idx, key)
  g_kept = _sparse_momentum.gather(g.reshape(-1), idx)
  m_new, v_new, u = _spam_moments(g_kept, m, v, reset, *hps)
  u = _sparse_momentum.scatter(u, idx, g)
  return u.astype(g.dtype), m_new, v_new, idx


@functools.partial(jax.jit, static_argnames=('density',))
def _spam_bernoulli_leaf(g, m, v, mask, key_data, leaf, step, reset, *hps,
                         density):
  """Sparse leaf with dense moments and a bool mask (reference_compat)."""
  key = _sparse_momentum.leaf_key(key_data, leaf, step)
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
  density = _sparse_momentum.check_density(density)

  def init_fn(params):
    key_data = jax.random.key_data(jax.random.key(seed))
    mu, nu, masks = _sparse_momentum.init_moments(
        params, key_data, density=density, density_group=density_group,
        mu_dtype=mu_dtype, reference_compat=reference_compat)
    return ScaleBySpamState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu,
                            masks=masks, key=key_data)

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    flags = _sparse_momentum.sparse_flags(updates, density, density_group)
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

  The arguments not listed below are those of :func:`scale_by_spam`.

  Args:
    learning_rate: :math:`\eta`, a float or a schedule.
    weight_decay: :math:`\lambda`.
    mask: which leaves decay, as in ``optax.add_decayed_weights``, given as a
      full tree of bools or a callable returning one.
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
  density = _sparse_momentum.check_density(density)

  def sparse_fn(tree):
    return _sparse_momentum.sparse_flags(tree, density, density_group)

  if reference_compat:

    def decay_flags(params):
      return [on and not sparse for on, sparse in zip(
          _sparse_momentum.leaf_flags(mask, params), sparse_fn(params))]

    return optax.chain(
        direction,
        optax.scale_by_learning_rate(learning_rate),
        _sparse_momentum.decay_after_step(learning_rate, weight_decay,
                                          decay_flags),
    )
  if density is not None:
    return optax.chain(
        _sparse_momentum.with_decay_on_active(direction, weight_decay, mask,
                                              sparse_fn),
        optax.scale_by_learning_rate(learning_rate),
    )
  return optax.chain(
      direction,
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
