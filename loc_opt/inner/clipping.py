"""Composable pieces of the SPAM family: periodic resets and spike clipping.

Each piece is an Optax ``GradientTransformation`` usable on its own:

* :func:`reset_every` re-initializes a wrapped transform's state
  periodically (SPAM's and Stable-SPAM's momentum reset).
* :func:`clip_by_moment_ratio` shrinks coordinates whose squared gradient
  exceeds a multiple of a running second moment (SPAM's spike clipping).
* :func:`adaptive_max_clip` clips each tensor against a bias-corrected EMA of
  its largest magnitude (Stable-SPAM's AdaClip).
* :func:`adaptive_grad_norm` rescales each tensor to a norm predicted from
  EMAs of its past norms (Stable-SPAM's AdaGN).

The array-level rules (:func:`spike_clip`, :func:`max_ema_clip`,
:func:`norm_ema_rescale`) are shared with the fused optimizers in
:mod:`loc_opt.inner.spam` and :mod:`loc_opt.inner.stable_spam`.

References:
  Huang, Zhu, Jin, Liu, Wang, Liu, *SPAM: Spike-Aware Adam with Momentum
  Reset for Stable LLM Training*, ICLR 2025.

  Huang, Hu, Jaiswal, Wang, Liu, Liu, *Stable-SPAM: How to Train in 4-Bit
  More Stably than 16-Bit Adam*, 2025.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from loc_opt.inner import _sparse_momentum

ArrayLike = jax.typing.ArrayLike


def _zero_count() -> jax.Array:
  return jnp.zeros([], jnp.int32)


# ---------------------------------------------------------------------------
# Array-level rules. They are jitted so that eager updates reuse one compiled
# program per shape; under an outer jit they are inlined.
# ---------------------------------------------------------------------------


@jax.jit
def spike_clip(
    g: jax.Array, nu: jax.Array, threshold: ArrayLike, active: ArrayLike = True
) -> jax.Array:
  r"""Spike-aware elementwise clipping of one tensor against a second moment.

  .. math::

    g_i \leftarrow \operatorname{sign}(g_i)\sqrt{\theta \nu_i}
    \quad\text{where}\quad g_i^2 > \theta \nu_i ,

  and ``g`` unchanged elsewhere, or everywhere when ``active`` is false or
  ``threshold <= 0``. With a finite :math:`\theta > 0`, a nonzero
  :math:`g_i` where :math:`\nu_i = 0` is flagged and set to 0.

  Args:
    g: the gradient tensor.
    nu: the running second moment, same shape (not bias-corrected).
    threshold: the ratio ``theta``; ``0`` (or less) disables clipping and
      ``inf`` never clips.
    active: a boolean scalar that switches the clip on or off.

  Returns:
    The clipped tensor in float32.
  """
  g = jnp.asarray(g, jnp.float32)
  nu = jnp.asarray(nu, jnp.float32)
  threshold = jnp.asarray(threshold, jnp.float32)
  bound_sq = threshold * nu
  flagged = (
      jnp.asarray(active) & (threshold > 0) & (jnp.square(g) > bound_sq)
  )
  bound = jnp.sqrt(jnp.where(flagged, bound_sq, 0.0))
  return jnp.where(flagged, jnp.sign(g) * bound, g)


@jax.jit
def max_ema_clip(
    g: jax.Array, max_ema: jax.Array, decay: ArrayLike, count: ArrayLike
) -> tuple[jax.Array, jax.Array]:
  r"""AdaClip for one tensor: proportional clipping against an EMA of max|g|.

  With :math:`a = \max_i |g_i|`:

  .. math::

    M \leftarrow \gamma M + (1-\gamma) a, \qquad
    \hat M = M / (1-\gamma^{c}), \qquad
    g_i \leftarrow g_i \hat M / a \ \text{ where } |g_i| > \hat M .

  The EMA takes the current maximum before the threshold is formed; the
  clipped entries keep their order and the largest becomes exactly
  :math:`\pm\hat M`.

  Args:
    g: the gradient tensor.
    max_ema: the float32 scalar EMA :math:`M`.
    decay: :math:`\gamma` (Stable-SPAM's ``gamma3``).
    count: the bias-correction power :math:`c` (steps including this one).

  Returns:
    ``(clipped g in float32, new max_ema)``.
  """
  g = jnp.asarray(g, jnp.float32)
  decay = jnp.asarray(decay, jnp.float32)
  peak = jnp.max(jnp.abs(g)) if g.size else jnp.zeros([], jnp.float32)
  max_ema = decay * max_ema + (1.0 - decay) * peak
  bound = max_ema / _sparse_momentum.bias_correction(decay, count)
  ratio = bound / jnp.where(peak > 0, peak, 1.0)
  return jnp.where(jnp.abs(g) > bound, g * ratio, g), max_ema


@jax.jit
def norm_ema_rescale(
    g: jax.Array,
    norm_mu: jax.Array,
    norm_nu: jax.Array,
    b1: ArrayLike,
    b2: ArrayLike,
    eps: ArrayLike,
    count: ArrayLike,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  r"""AdaGN for one tensor: rescale to a norm predicted by EMAs of past norms.

  With :math:`n = \|g\|`:

  .. math::

    m \leftarrow \gamma_1 m + (1-\gamma_1) n, \quad
    v \leftarrow \gamma_2 v + (1-\gamma_2) n^2, \quad
    c = \frac{m/(1-\gamma_1^{k})}{\sqrt{v/(1-\gamma_2^{k})}+\epsilon}, \quad
    g \leftarrow g\, c / n \ \ (n > 0).

  Args:
    g: the gradient tensor.
    norm_mu: float32 scalar EMA of the norm.
    norm_nu: float32 scalar EMA of the squared norm.
    b1: :math:`\gamma_1`.
    b2: :math:`\gamma_2`.
    eps: :math:`\epsilon`.
    count: the bias-correction power :math:`k` (steps including this one).

  Returns:
    ``(rescaled g in float32, new norm_mu, new norm_nu)``.
  """
  g = jnp.asarray(g, jnp.float32)
  b1 = jnp.asarray(b1, jnp.float32)
  b2 = jnp.asarray(b2, jnp.float32)
  norm = jnp.sqrt(jnp.sum(jnp.square(g)))
  norm_mu = b1 * norm_mu + (1.0 - b1) * norm
  norm_nu = b2 * norm_nu + (1.0 - b2) * jnp.square(norm)
  target = (norm_mu / _sparse_momentum.bias_correction(b1, count)) / (
      jnp.sqrt(norm_nu / _sparse_momentum.bias_correction(b2, count)) + eps)
  scale = jnp.where(norm > 0, target / jnp.where(norm > 0, norm, 1.0), 1.0)
  return g * scale, norm_mu, norm_nu


# ---------------------------------------------------------------------------
# reset_every
# ---------------------------------------------------------------------------


class ResetEveryState(NamedTuple):
  """State of :func:`reset_every`.

  Attributes:
    inner_state: the wrapped transform's state (its own shapes and dtypes).
    count: int32 scalar, updates taken.
  """

  inner_state: optax.OptState
  count: jax.Array


def _cast_like(fresh, old):
  """Casts floating leaves of a fresh state to the dtypes of the old one."""

  def cast(f, o):
    if (hasattr(o, 'dtype') and f.dtype != o.dtype
        and jnp.issubdtype(o.dtype, jnp.inexact)):
      return f.astype(o.dtype)
    return f

  return jax.tree.map(cast, fresh, old)


@functools.partial(jax.jit, static_argnums=0)
def _reset_if(init, due, like, state):
  """``init(like)`` (in ``state``'s dtypes) when ``due``, else ``state``.

  Jitted so that eager updates reuse one compiled program per ``init``.
  """
  return jax.lax.cond(due, lambda: _cast_like(init(like), state),
                      lambda: state)


def reset_every(
    inner: optax.GradientTransformation, period: ArrayLike
) -> optax.GradientTransformationExtraArgs:
  r"""Re-initializes ``inner``'s state every ``period`` updates.

  On update number :math:`k = 1, 2, \dots` with :math:`k \bmod P = 0` the
  wrapped state is replaced by ``inner.init(params)`` *before* ``inner``
  sees the gradient, so the ``P``-th, ``2P``-th, ... updates are the first
  updates of a fresh optimizer. This is the momentum reset of SPAM and
  Stable-SPAM (both moments and the bias-correction counter restart). The
  choice between the fresh and the running state is a ``lax.cond`` on the
  traced counter.

  ``inner.init`` is called on ``params`` (or on the updates when ``params``
  is None), so anything ``inner`` injects at init time (e.g. the
  hyperparameters of ``optax.inject_hyperparams``) is reset too: wrap the
  injection around :func:`reset_every`, not inside it.

  Args:
    inner: the transform whose state is reset; may take extra args.
    period: the reset period :math:`P` (a positive int; ``<= 0`` never
      resets).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import optax
    >>> from loc_opt.inner.clipping import reset_every
    >>> tx = reset_every(optax.adam(1e-3), period=500)

  References:
    Huang et al., *SPAM: Spike-Aware Adam with Momentum Reset for Stable LLM
    Training*, ICLR 2025.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return ResetEveryState(inner_state=inner.init(params),
                           count=_zero_count())

  def update_fn(updates, state, params=None, **extra_args):
    period_ = jnp.asarray(period, jnp.int32)
    count = optax.safe_increment(state.count)
    due = (period_ > 0) & (count % jnp.maximum(period_, 1) == 0)
    like = updates if params is None else params

    inner_state = _reset_if(inner.init, due, like, state.inner_state)
    updates, inner_state = inner.update(updates, inner_state, params,
                                        **extra_args)
    return updates, ResetEveryState(inner_state=inner_state, count=count)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ---------------------------------------------------------------------------
# clip_by_moment_ratio
# ---------------------------------------------------------------------------


class ClipByMomentRatioState(NamedTuple):
  """State of :func:`clip_by_moment_ratio`.

  Attributes:
    count: int32 scalar, updates taken.
    nu: float32 tree like the params: EMA of the squared *clipped* gradient,
      without bias correction.
  """

  count: jax.Array
  nu: optax.Updates


@jax.jit
def _moment_ratio_leaf(g, nu, threshold, b2, active):
  clipped = spike_clip(g, nu, threshold, active)
  b2 = jnp.asarray(b2, jnp.float32)
  nu = b2 * nu + (1.0 - b2) * jnp.square(clipped)
  return clipped.astype(g.dtype), nu


def clip_by_moment_ratio(
    threshold: ArrayLike = 5000.0,
    b2: ArrayLike = 0.999,
    delay: ArrayLike = 20,
) -> optax.GradientTransformation:
  r"""Spike-aware clipping against a running second moment (SPAM).

  Keeps :math:`\nu \leftarrow \beta_2 \nu + (1-\beta_2) \tilde g^2` of the
  clipped gradient :math:`\tilde g` and, before the update of :math:`\nu`,

  .. math::

    \tilde g_i = \begin{cases}
      \operatorname{sign}(g_i)\sqrt{\theta \nu_i} & g_i^2 > \theta \nu_i \\
      g_i & \text{otherwise.}
    \end{cases}

  :math:`\nu` is not bias-corrected, so shortly after initialization (or a
  reset, see :func:`reset_every`) the effective threshold relative to the
  true second moment is only :math:`\theta (1 - \beta_2^j)`. Chained before
  ``optax.scale_by_adam(b2=b2)`` the piece's :math:`\nu` equals Adam's, as in
  SPAM.

  Args:
    threshold: the ratio :math:`\theta`; ``0`` disables clipping.
    b2: the decay of the second moment.
    delay: clip only once ``delay`` updates have been taken (the first
      ``delay`` updates pass unclipped while :math:`\nu` warms up; with 0 the
      first update, against :math:`\nu = 0`, would be zeroed).

  Returns:
    An ``optax.GradientTransformation``; updates keep their dtype.

  Example:
    >>> import optax
    >>> from loc_opt.inner.clipping import clip_by_moment_ratio
    >>> tx = optax.chain(clip_by_moment_ratio(5000.0, b2=0.999, delay=20),
    ...                  optax.scale_by_adam(), optax.scale(-1e-3))

  References:
    Huang et al., *SPAM: Spike-Aware Adam with Momentum Reset for Stable LLM
    Training*, ICLR 2025.
  """

  def init_fn(params):
    return ClipByMomentRatioState(
        count=_zero_count(),
        nu=jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params))

  def update_fn(updates, state, params=None):
    del params
    active = state.count >= jnp.asarray(delay, jnp.int32)
    pairs = jax.tree.map(
        lambda g, v: _moment_ratio_leaf(g, v, threshold, b2, active),
        updates, state.nu)
    out, nu = _unzip(pairs, updates, 2)
    return out, ClipByMomentRatioState(
        count=optax.safe_increment(state.count), nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)


# ---------------------------------------------------------------------------
# adaptive_max_clip (AdaClip) and adaptive_grad_norm (AdaGN)
# ---------------------------------------------------------------------------


class AdaptiveMaxClipState(NamedTuple):
  """State of :func:`adaptive_max_clip`.

  Attributes:
    count: int32 scalar, updates taken (the bias-correction power).
    max_ema: tree of float32 scalars, one per leaf: EMA of ``max |g|``.
  """

  count: jax.Array
  max_ema: optax.Updates


def adaptive_max_clip(decay: ArrayLike = 0.999) -> optax.GradientTransformation:
  r"""Stable-SPAM's AdaClip: per-tensor clipping at an adaptive maximum.

  Per leaf, with :math:`a = \max_i |g_i|` and :math:`k` the 1-based step,

  .. math::

    M \leftarrow \gamma M + (1-\gamma) a, \qquad
    \hat M = \frac{M}{1-\gamma^k}, \qquad
    g_i \leftarrow g_i\,\frac{\hat M}{a}\ \text{ where } |g_i| > \hat M .

  Entries above the threshold are scaled by one common factor, so their
  order is kept and the largest becomes :math:`\pm \hat M`. See
  :func:`max_ema_clip` for the array-level rule.

  Args:
    decay: :math:`\gamma` (Stable-SPAM's ``gamma3``).

  Returns:
    An ``optax.GradientTransformation``; updates keep their dtype.

  Example:
    >>> import optax
    >>> from loc_opt.inner.clipping import adaptive_max_clip
    >>> tx = optax.chain(adaptive_max_clip(0.999), optax.adam(1e-3))

  References:
    Huang et al., *Stable-SPAM: How to Train in 4-Bit More Stably than 16-Bit
    Adam*, 2025.
  """

  def init_fn(params):
    return AdaptiveMaxClipState(
        count=_zero_count(),
        max_ema=jax.tree.map(lambda _: jnp.zeros([], jnp.float32), params))

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    pairs = jax.tree.map(
        lambda g, m: _cast_first(g.dtype, *max_ema_clip(g, m, decay, count)),
        updates, state.max_ema)
    out, max_ema = _unzip(pairs, updates, 2)
    return out, AdaptiveMaxClipState(count=count, max_ema=max_ema)

  return optax.GradientTransformation(init_fn, update_fn)


class AdaptiveGradNormState(NamedTuple):
  """State of :func:`adaptive_grad_norm`.

  Attributes:
    count: int32 scalar, updates taken (the bias-correction power).
    norm_mu: tree of float32 scalars, one per leaf: EMA of ``||g||``.
    norm_nu: tree of float32 scalars, one per leaf: EMA of ``||g||^2``.
  """

  count: jax.Array
  norm_mu: optax.Updates
  norm_nu: optax.Updates


def adaptive_grad_norm(
    b1: ArrayLike = 0.7, b2: ArrayLike = 0.9, eps: ArrayLike = 1e-8
) -> optax.GradientTransformation:
  r"""Stable-SPAM's AdaGN: rescale each tensor to an EMA-predicted norm.

  Per leaf, with :math:`n = \|g\|` and :math:`k` the 1-based step,

  .. math::

    m \leftarrow \gamma_1 m + (1-\gamma_1) n, \quad
    v \leftarrow \gamma_2 v + (1-\gamma_2) n^2, \quad
    g \leftarrow g \cdot \frac{m/(1-\gamma_1^k)}
      {n\,(\sqrt{v/(1-\gamma_2^k)}+\epsilon)} ,

  so the tensor's norm becomes the bias-corrected ratio of the two EMAs (at
  most about one). Zero tensors pass unchanged. See :func:`norm_ema_rescale`.

  Args:
    b1: :math:`\gamma_1`, the decay of the norm EMA.
    b2: :math:`\gamma_2`, the decay of the squared-norm EMA.
    eps: :math:`\epsilon`.

  Returns:
    An ``optax.GradientTransformation``; updates keep their dtype.

  Example:
    >>> import optax
    >>> from loc_opt.inner.clipping import adaptive_grad_norm
    >>> tx = optax.chain(adaptive_grad_norm(0.7, 0.9), optax.adam(1e-3))

  References:
    Huang et al., *Stable-SPAM: How to Train in 4-Bit More Stably than 16-Bit
    Adam*, 2025.
  """

  def init_fn(params):
    zeros = jax.tree.map(lambda _: jnp.zeros([], jnp.float32), params)
    return AdaptiveGradNormState(count=_zero_count(), norm_mu=zeros,
                                 norm_nu=zeros)

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    triples = jax.tree.map(
        lambda g, m, v: _cast_first(
            g.dtype, *norm_ema_rescale(g, m, v, b1, b2, eps, count)),
        updates, state.norm_mu, state.norm_nu)
    out, norm_mu, norm_nu = _unzip(triples, updates, 3)
    return out, AdaptiveGradNormState(count=count, norm_mu=norm_mu,
                                      norm_nu=norm_nu)

  return optax.GradientTransformation(init_fn, update_fn)


def _cast_first(dtype, first, *rest) -> tuple:
  return (first.astype(dtype), *rest)


def _unzip(tuples, like, n: int) -> tuple:
  """Splits a tree of n-tuples (with the structure of ``like``) into n trees."""
  treedef = jax.tree.structure(like)
  flat = treedef.flatten_up_to(tuples)
  return tuple(treedef.unflatten([t[i] for t in flat]) for i in range(n))
