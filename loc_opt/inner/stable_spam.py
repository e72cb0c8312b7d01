"""Stable-SPAM: SPAM with adaptive clipping, norm rescaling and annealing.

Stable-SPAM replaces SPAM's spike clip by an adaptive per-tensor max clip
(AdaClip) and a per-tensor norm rescaling (AdaGN), resets the bias
correction along with the moments (MoRet) and can anneal β₁.

:func:`scale_by_stable_spam` is a fused transform (one state, one pass over
the moments); the same rules are available as separate pieces in
:mod:`loc_opt.inner.clipping`. ``reference_compat=True`` reproduces the
quirks of the authors' PyTorch code (listed in the docstring); the default
follows the documented math.

References:
  Huang, Hu, Jaiswal, Wang, Liu, Liu, *Stable-SPAM: How to Train in 4-Bit
  More Stably than 16-Bit Adam*, 2025.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loc_opt.inner import _sparse_momentum
from loc_opt.inner import clipping

ArrayLike = jax.typing.ArrayLike


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
  bc1 = _sparse_momentum.bias_correction(b1_t, adam_count)
  bc2 = _sparse_momentum.bias_correction(b2, adam_count)
  return (t, adam_count, reset, s if compat else t,
          jnp.asarray(gamma1, jnp.float32) * kappa, b1_t, bc1, bc2)


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
    dtype = lambda p: _sparse_momentum.moment_dtype(p.dtype, mu_dtype)
    return ScaleByStableSpamState(
        count=zero,
        adam_count=zero,
        mu=jax.tree.map(lambda p: jnp.zeros_like(p, dtype(p)), params),
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

  The arguments not listed below are those of :func:`scale_by_stable_spam`.

  Args:
    learning_rate: :math:`\eta`, a float or a schedule.
    weight_decay: :math:`\lambda`.
    mask: which leaves decay, as in ``optax.add_decayed_weights``.

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
