"""Hand-written backward rules for the Transformer's elementwise layers.

JAX differentiates RMSNorm and the tanh GELU op by op. The linearized
program keeps intermediate products of the forward (for GELU, the
derivative's pieces ``0.5 * (1 + tanh(u))`` and the like, each an array the
size of the MLP's hidden layer) and the backward reads them back, several
passes over ``[tokens, width]`` arrays that the forward already made once.
On a CPU, where these layers are bound by memory traffic, those passes are
a tenth of the reference LM's step (issue 20: removing the norms or GELU
outright made the 1.48M-parameter step 5% faster each).

The rules here save only their inputs (RMSNorm also its ``[tokens, 1]``
inverse root mean square) and compute each gradient in one fused pass,
recomputing ``tanh`` rather than storing it. The forwards are the same
operations as Flax's ``nnx.RMSNorm`` and ``jax.nn.gelu(approximate=True)``
(bit-identical where XLA fuses them alike, ``tests/models``); the gradients
agree with JAX's rules to float32 rounding: they sum the same terms in
another order.

The model picks them with ``model.backward`` (:data:`BACKWARD`): ``'fused'``
these rules, ``'xla'`` JAX's, ``'auto'`` (the default) ``'fused'`` on CPU
backends. Only float32 activations take them; other dtypes keep JAX's
rules.

References: Zhang & Sennrich, "Root Mean Square Layer Normalization"
(NeurIPS 2019); Hendrycks & Gimpel, "Gaussian Error Linear Units" (2016),
for the tanh approximation.
"""

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp

from loc_opt.models import core

# Model config values: 'auto' picks 'fused' on CPU backends, 'xla' elsewhere.
BACKWARD = ('auto', 'xla', 'fused')


def check(backward: str) -> None:
  """Raises ``ValueError`` naming the field unless ``backward`` is valid."""
  core.check_choice(backward, BACKWARD, 'backward')


def resolve(backward: str) -> str:
  """``'xla'`` or ``'fused'`` for a config value of :data:`BACKWARD`
  (``'auto'`` asks for the default backend: :func:`core.resolve_auto`)."""
  return core.resolve_auto(backward, BACKWARD, 'backward', 'fused')


def _rms_forward(x, scale, epsilon):
  # nnx.RMSNorm's operations in its order: the mean square over the last
  # axis, then x * (rsqrt(mean + eps) * scale).
  inv_rms = lax.rsqrt(jnp.mean(lax.square(x), axis=-1, keepdims=True)
                      + epsilon)
  return x * (inv_rms * scale), inv_rms


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x, scale, epsilon):
  return _rms_forward(x, scale, epsilon)[0]


def _rms_norm_fwd(x, scale, epsilon):
  y, inv_rms = _rms_forward(x, scale, epsilon)
  return y, (x, inv_rms, scale)


def _rms_norm_bwd(epsilon, residuals, g):
  del epsilon
  x, inv_rms, scale = residuals
  x_hat = x * inv_rms
  g_scaled = g * scale
  # y_i = x_i r s_i with r = (mean_j x_j^2 + eps)^(-1/2), dr/dx_i = -r^3 x_i / n.
  # The per-row mean is kept as an array of its own: otherwise XLA:CPU puts
  # the whole dx into YNNPACK's reduction fusion, which takes no broadcast
  # inside, and writes out r and the scale broadcast to x's full shape to
  # feed it (two extra arrays per norm; same values either way).
  mean = lax.optimization_barrier(
      jnp.mean(g_scaled * x_hat, axis=-1, keepdims=True))
  dx = inv_rms * (g_scaled - x_hat * mean)
  d_scale = jnp.sum(g * x_hat, axis=tuple(range(x.ndim - 1)))
  return dx, d_scale


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rms_norm(x: jax.Array, scale: jax.Array, epsilon: float) -> jax.Array:
  """RMSNorm of ``x`` over its last axis, times ``scale`` (float32).

  The forward is ``nnx.RMSNorm``'s; the backward is one pass over ``x`` and
  the cotangent (see the module docstring).
  """
  if x.dtype != jnp.float32 or scale.dtype != jnp.float32:
    raise ValueError(f'rms_norm takes float32 operands, got {x.dtype} and '
                     f'{scale.dtype}')
  return _rms_norm(x, scale, epsilon)


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@jax.custom_vjp
def gelu_tanh(x: jax.Array) -> jax.Array:
  """``jax.nn.gelu(x, approximate=True)`` whose backward saves only ``x``
  and recomputes ``tanh`` in its one pass (float32)."""
  return jax.nn.gelu(x, approximate=True)


def _gelu_fwd(x):
  return jax.nn.gelu(x, approximate=True), x


def _gelu_bwd(x, g):
  # gelu(x) = x/2 (1 + tanh(u)), u = c (x + 0.044715 x^3):
  # gelu'(x) = (1 + t)/2 + x/2 (1 - t^2) c (1 + 3 * 0.044715 x^2).
  x2 = x * x
  t = jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x2 * x))
  du = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x2)
  return (g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du),)


gelu_tanh.defvjp(_gelu_fwd, _gelu_bwd)
