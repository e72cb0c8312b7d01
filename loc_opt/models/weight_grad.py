"""A dense matmul whose weight gradient transposes the narrower operand.

For ``y = x @ w`` with ``x`` of shape ``[..., n_in]`` and ``w`` of shape
``[n_in, n_out]``, the weight gradient ``dw = x^T g`` contracts over the
tokens, the leading dimension of both ``x`` and ``g``. A row-major matmul
kernel wants that dimension last in its left operand, so the compiler
materializes a transpose of one of them. JAX's transpose rule for
``dot_general`` computes ``(g^T x)^T``, so XLA:CPU transposes ``g``, and on
the GELU side of an MLP it fuses that transpose into the elementwise
derivative, where the strided write is slow: in the 853k-parameter reference
LM at batch 32 x 128 the four ``[4096, 512]`` transposing fusions took 10 ms
each, a sixth of the step (issue 20, ``docs/benchmarks.md``).

:func:`dot_general` computes the same products, but its custom VJP picks the
orientation: ``x^T g`` when ``n_in <= n_out`` (the transposed copy is of
``x``), ``(g^T x)^T`` otherwise (of ``g``, transposing the small result
back). The copies are kept behind optimization barriers
(:func:`transposed`, :func:`transpose_of_product`): otherwise XLA folds them
back into the dot as a contraction over the leading axis of both operands,
which XLA:CPU runs through Eigen with a slow strided packing. Each product
sums the same terms, in an order that the CPU's matmul kernels choose: the
dense layers' gradients of the reference LM agree with JAX's rule to float32
rounding (``tests/models``; bit for bit on some CPUs, not on all). The
Transformer's attention uses the same two helpers for its key and value
gradients (``loc_opt.models.attention``).

It is a drop-in ``dot_general`` for ``flax.nnx.Linear`` (its ``dot_general``
argument) for the one contraction a dense layer does (the last axis of the
input with the first of the kernel, no batch axes); any other contraction
goes to ``jax.lax.dot_general`` unchanged.
"""

import functools

import jax
from jax import lax

from loc_opt.models import core

# Model config values: 'auto' picks 'narrow' on CPU backends, 'xla' elsewhere.
WEIGHT_GRAD = ('auto', 'xla', 'narrow')


def check(weight_grad: str) -> None:
  """Raises ``ValueError`` naming the field unless ``weight_grad`` is valid."""
  core.check_choice(weight_grad, WEIGHT_GRAD, 'weight_grad')


def resolve(weight_grad: str) -> str:
  """``'xla'`` or ``'narrow'`` for a config value of :data:`WEIGHT_GRAD`
  (``'auto'`` asks for the default backend: :func:`core.resolve_auto`)."""
  return core.resolve_auto(weight_grad, WEIGHT_GRAD, 'weight_grad', 'narrow')


def _dense_dims(ndim: int) -> lax.DotDimensionNumbers:
  return (((ndim - 1,), (0,)), ((), ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense(x, w, precision, preferred_element_type):
  return lax.dot_general(x, w, _dense_dims(x.ndim), precision=precision,
                         preferred_element_type=preferred_element_type)


def _dense_fwd(x, w, precision, preferred_element_type):
  return _dense(x, w, precision, preferred_element_type), (x, w)


def transposed(a: jax.Array) -> jax.Array:
  """``a`` with its last two axes swapped, kept as an array of its own.

  XLA folds a plain transpose into the dot that consumes it, which gives
  back a contraction over the leading axis of both operands; XLA:CPU runs
  that through Eigen, whose packing of the strided operand took a tenth of
  the 853k LM's step (``gemm_pack_colmajor_block`` in ``perf``). Behind an
  optimization barrier the copy is made once and the dot is a plain
  row-major matmul (YNNPACK's kernel).
  """
  return lax.optimization_barrier(a.swapaxes(-1, -2))


def transpose_of_product(product: jax.Array) -> jax.Array:
  """``product`` with its last two axes swapped, the product computed as
  written.

  Without the barrier XLA folds the transpose into the dot that made
  ``product`` by swapping its operands, which is again a contraction over
  a leading axis (:func:`transposed`).
  """
  return lax.optimization_barrier(product).swapaxes(-1, -2)


def _dense_bwd(precision, preferred_element_type, residuals, g):
  # Like JAX's rule: the forward's preferred_element_type, then a cast to
  # each operand's dtype.
  x, w = residuals
  n_in, n_out = w.shape
  # dx = g w^T, as JAX's rule computes it.
  dx = lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())),
                       precision=precision,
                       preferred_element_type=preferred_element_type)
  x2 = x.reshape(-1, n_in)
  g2 = g.reshape(-1, n_out)
  row_major = functools.partial(lax.dot_general,
                                dimension_numbers=(((1,), (0,)), ((), ())),
                                precision=precision,
                                preferred_element_type=preferred_element_type)
  if n_in <= n_out:  # x^T g: the copy the kernel needs is of x
    dw = row_major(transposed(x2), g2)
  else:  # (g^T x)^T: the copy is of g, the transpose of the result is small
    dw = transpose_of_product(row_major(transposed(g2), x2))
  return dx.astype(x.dtype), dw.astype(w.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)


def dot_general(lhs, rhs, dimension_numbers, precision=None,
                preferred_element_type=None, out_sharding=None):
  """``jax.lax.dot_general`` with the narrow-transpose weight gradient.

  Only the dense contraction (``lhs``'s last axis with the first of a 2-D
  ``rhs``, no batch axes, no ``out_sharding``) takes the custom VJP; other
  calls are ``jax.lax.dot_general`` itself.
  """
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  dense = (rhs.ndim == 2 and tuple(lhs_contract) == (lhs.ndim - 1,)
           and tuple(rhs_contract) == (0,) and not lhs_batch
           and not rhs_batch and out_sharding is None)
  if not dense:
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type,
                           out_sharding=out_sharding)
  return _dense(lhs, rhs, precision, preferred_element_type)


def for_config(weight_grad: str):
  """The ``dot_general`` a config value of :data:`WEIGHT_GRAD` picks:
  :func:`dot_general` or ``jax.lax.dot_general``."""
  return dot_general if resolve(weight_grad) == 'narrow' else lax.dot_general


def matmul(x: jax.Array, w: jax.Array, weight_grad: str) -> jax.Array:
  """``x @ w`` for ``w`` 2-D, with the weight gradient :func:`resolve` picks."""
  return for_config(weight_grad)(x, w, _dense_dims(x.ndim))
