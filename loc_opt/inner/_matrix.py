"""Shared pieces of the matrix-aware inner optimizers.

SWAN, FRUGAL, Fira, Dion and Drop-Muon treat every *matrix* leaf (a leaf with
two or more dimensions) as a linear map and every other leaf (biases, norm
scales, scalars) with a simpler fallback rule. This module holds what they
share:

* the eligibility rule (:func:`is_matrix`, :func:`matrix_labels`), the
  routing of the two kinds to two transforms (:func:`split_by_kind`,
  :func:`matrix_optimizer`) and the default fallback (:func:`adam_fallback`);
* the 2-D view of a leaf (:func:`as_matrix`): a leaf of shape
  ``(d_1, ..., d_k)`` is the matrix ``(d_1 ... d_{k-1}, d_k)``, i.e.
  ``(fan_in, fan_out)`` for Flax ``Dense``/``DenseGeneral``/``Conv`` kernels,
  whose last axis is the output axis; its tall orientation for low-rank
  methods (:func:`as_tall_matrix`, :func:`from_tall_matrix`);
* the static shape-setting hyperparameters (:func:`static_number`);
* matrix functions: the quintic Newton--Schulz orthogonalization of Muon
  (:func:`orthogonalize`), inverse square roots (:func:`inverse_sqrt`) and the
  polar factor ``U V^T`` (:func:`polar_factor`), subspace bases
  (:func:`top_right_singular_vectors`, :func:`random_orthonormal`);
* :func:`gathered`: runs a transform on unsharded copies of its inputs, so that
  QR/SVD/eigh and Gram matrices work on leaves sharded over an explicit mesh,
  and gives results the shardings of the inputs back.
"""

from collections.abc import Callable, Sequence
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

from loc_opt import _checks

MATRIX = 'matrix'
OTHER = 'other'

# Quintic Newton--Schulz coefficients of Muon (Jordan, 2024), the default of
# ``optax.contrib.scale_by_muon``.
MUON_NS_COEFFS = (3.4445, -4.7750, 2.0315)

# A tree of booleans (True: matrix rule) with the params' structure, or a
# function of the params returning one; None: the :func:`is_matrix` rule.
MatrixMask = Any | Callable[[Any], Any] | None

Whitening = Literal['newton_schulz', 'exact', 'quintic']


def is_matrix(x: Any) -> bool:
  """The default eligibility rule: a leaf with two or more dimensions."""
  return len(x.shape) >= 2


def matrix_labels(params: Any, matrix_mask: MatrixMask = None) -> Any:
  """Labels each leaf ``'matrix'`` or ``'other'``.

  Args:
    params: a tree of arrays (or ``jax.ShapeDtypeStruct``).
    matrix_mask: None (the :func:`is_matrix` rule), a tree of booleans with
      the structure of ``params``, or a function of ``params`` returning one.
      Use it to send e.g. embeddings or the output head to the fallback.

  Returns:
    A tree of labels with the structure of ``params``.

  Raises:
    ValueError: if the mask marks a leaf with fewer than two dimensions.
  """
  if matrix_mask is None:
    return jax.tree.map(lambda x: MATRIX if is_matrix(x) else OTHER, params)
  mask = matrix_mask(params) if callable(matrix_mask) else matrix_mask

  def label(m, x):
    if m and not is_matrix(x):
      raise ValueError(f'matrix_mask marks a leaf of shape {x.shape}; matrix '
                       'rules need at least two dimensions')
    return MATRIX if m else OTHER

  return jax.tree.map(label, mask, params)


def split_by_kind(
    matrix_tx: optax.GradientTransformation,
    other_tx: optax.GradientTransformation,
    matrix_mask: MatrixMask = None,
) -> optax.GradientTransformation:
  """Routes matrix leaves to ``matrix_tx`` and the rest to ``other_tx``.

  A thin wrapper of ``optax.partition``: each transform sees only its own
  leaves (the others are ``optax.MaskedNode``).

  Args:
    matrix_tx: the transform for matrix leaves.
    other_tx: the fallback for all other leaves.
    matrix_mask: see :func:`matrix_labels`.

  Returns:
    The combined transform.
  """
  return optax.partition(
      {MATRIX: matrix_tx, OTHER: other_tx},
      lambda params: matrix_labels(params, matrix_mask))


def adam_fallback(
    fallback: optax.GradientTransformation | None,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    *,
    nesterov: bool = False,
) -> optax.GradientTransformation:
  """``fallback``, or the default rule for non-matrix leaves when it is None:
  ``optax.scale_by_adam(b1, b2, eps, nesterov)``."""
  if fallback is not None:
    return fallback
  return optax.scale_by_adam(b1=b1, b2=b2, eps=eps, nesterov=nesterov)


def matrix_optimizer(
    core: optax.GradientTransformation,
    fallback: optax.GradientTransformation,
    matrix_mask: MatrixMask = None,
) -> optax.GradientTransformation:
  """``core`` on whole matrix leaves and ``fallback`` on the others.

  The shape of SWAN, FRUGAL, Fira and Dion: :func:`split_by_kind` of
  :func:`gathered` ``(core)`` and ``fallback``.

  Args:
    core: the matrix rule, a transform of a tree of matrix leaves.
    fallback: the transform for all other leaves.
    matrix_mask: see :func:`matrix_labels`.

  Returns:
    The combined transform.
  """
  return split_by_kind(gathered(core), fallback, matrix_mask)


def static_number(value: Any, name: str, cast: type = int) -> Any:
  """``cast(value)`` for a hyperparameter that sets a shape.

  Args:
    value: a Python number or a concrete array.
    name: the argument's name, for the error message.
    cast: ``int`` or ``float``.

  Returns:
    The Python number.

  Raises:
    ValueError: if ``value`` is traced (e.g. injected by
      ``optax.inject_hyperparams`` into a jitted ``init``).
  """
  return cast(_checks.static(value, name))


def as_matrix(x: jax.Array) -> jax.Array:
  """The ``(prod(shape[:-1]), shape[-1])`` view of a leaf (fan_in, fan_out)."""
  if x.ndim < 2:
    raise ValueError(f'need at least two dimensions, got shape {x.shape}')
  return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
  """The shape :func:`as_matrix` gives a leaf of shape ``shape``."""
  return math.prod(shape[:-1]), shape[-1]


def tall_shape(shape: Sequence[int]) -> tuple[int, int]:
  """``(big, small)``: the shape :func:`as_tall_matrix` gives a leaf."""
  m, n = matrix_shape(shape)
  return max(m, n), min(m, n)


def as_tall_matrix(x: jax.Array) -> tuple[jax.Array, bool]:
  """The float32 matrix view of a leaf, transposed if needed to be tall.

  Low-rank methods keep a basis of the smaller side: with the view tall,
  ``(big, small)``, that is always the right side.

  Returns:
    ``(matrix, transposed)``; :func:`from_tall_matrix` undoes it.
  """
  xm = as_matrix(x).astype(jnp.float32)
  transposed = xm.shape[0] < xm.shape[1]
  return (xm.T if transposed else xm), transposed


def from_tall_matrix(u: jax.Array, transposed: bool,
                     like: jax.Array) -> jax.Array:
  """A tall ``u`` back in the shape and dtype of the leaf ``like``."""
  u = u.T if transposed else u
  return u.reshape(like.shape).astype(like.dtype)


def orthogonalize(
    x: jax.Array,
    steps: jax.typing.ArrayLike = 5,
    coeffs: Sequence[float] = MUON_NS_COEFFS,
    eps: jax.typing.ArrayLike = 1e-7,
) -> jax.Array:
  r"""Approximate polar factor by Muon's quintic Newton--Schulz iteration.

  With :math:`X_0 = X/(\|X\|_F + \epsilon)` and
  :math:`X_{k+1} = a X_k + (b A_k + c A_k^2) X_k`, :math:`A_k = X_k X_k^T`
  (on the wide orientation). The default coefficients favour speed: singular
  values land roughly in [0.7, 1.2] rather than exactly at 1.

  Args:
    x: a matrix.
    steps: number of iterations (may be traced).
    coeffs: the quintic coefficients ``(a, b, c)``.
    eps: guards the initial normalization.

  Returns:
    An approximately orthogonal matrix of the shape and dtype of ``x``.
  """
  a, b, c = coeffs
  tall = x.shape[0] > x.shape[1]
  y = x.T if tall else x
  y = y.astype(jnp.float32)
  y = y / (jnp.linalg.norm(y) + eps)

  def body(_, y):
    gram = y @ y.T
    return a * y + (b * gram + c * gram @ gram) @ y

  y = jax.lax.fori_loop(0, steps, body, y)
  return (y.T if tall else y).astype(x.dtype)


def inverse_sqrt(
    a: jax.Array,
    *,
    method: Literal['newton_schulz', 'exact'] = 'newton_schulz',
    steps: jax.typing.ArrayLike = 10,
) -> jax.Array:
  r"""Inverse square root of a symmetric positive semi-definite matrix.

  ``'newton_schulz'`` is the coupled iteration
  :math:`Y_0 = A/\|A\|_F`, :math:`Z_0 = I`,
  :math:`T_k = (3I - Z_k Y_k)/2`, :math:`Y_{k+1} = Y_k T_k`,
  :math:`Z_{k+1} = T_k Z_k`, returning :math:`Z_K/\sqrt{\|A\|_F}`. Only
  matrix products: fast on accelerators; eigenvalues far below
  :math:`\|A\|_F` need more steps (each step multiplies a small normalized
  eigenvalue by about 1.5 until it nears 1). ``'exact'`` uses ``eigh``.
  Zero eigenvalues are clamped (damp ``a`` before calling for a
  well-defined answer).

  Args:
    a: a symmetric PSD matrix (float32 recommended).
    method: ``'newton_schulz'`` or ``'exact'``.
    steps: Newton--Schulz iterations (may be traced).

  Returns:
    :math:`A^{-1/2}` with the shape of ``a``.
  """
  _checks.one_of(method, 'method', ('newton_schulz', 'exact'))
  tiny = jnp.finfo(a.dtype).tiny
  if method == 'exact':
    w, v = jnp.linalg.eigh(a)
    return (v * jax.lax.rsqrt(jnp.maximum(w, tiny))) @ v.T
  eye = jnp.eye(a.shape[0], dtype=a.dtype)
  norm = jnp.linalg.norm(a) + tiny

  def body(_, yz):
    y, z = yz
    t = 0.5 * (3.0 * eye - z @ y)
    return y @ t, t @ z

  start = (a / norm, jnp.zeros_like(a) + eye)  # varying like `a`
  _, z = jax.lax.fori_loop(0, steps, body, start)
  return z * jax.lax.rsqrt(norm)


def polar_factor(
    x: jax.Array,
    *,
    method: Whitening = 'newton_schulz',
    steps: jax.typing.ArrayLike = 10,
    damping: jax.typing.ArrayLike = 1e-6,
) -> jax.Array:
  r"""The polar factor :math:`U V^T` of :math:`X = U \Sigma V^T` (whitening).

  Computes :math:`(X X^T + \delta I)^{-1/2} X` on the smaller Gram matrix
  (:math:`X (X^T X + \delta I)^{-1/2}` when ``x`` is tall), with
  :math:`\delta = \text{damping} \cdot \operatorname{tr}(G)/d` relative to
  the Gram matrix :math:`G` of size :math:`d`. ``method='quintic'`` uses
  :func:`orthogonalize` instead (Muon's fast approximate iteration).

  Args:
    x: a matrix; computed in float32, returned in float32.
    method: ``'newton_schulz'``, ``'exact'`` or ``'quintic'``.
    steps: iterations of the iterative methods.
    damping: relative Tikhonov damping of the Gram matrix.

  Returns:
    The polar factor, shape of ``x``, float32.
  """
  x = x.astype(jnp.float32)
  if method == 'quintic':
    return orthogonalize(x, steps)
  tall = x.shape[0] > x.shape[1]
  gram = x.T @ x if tall else x @ x.T
  d = gram.shape[0]
  gram = gram + (damping * jnp.trace(gram) / d) * jnp.eye(d, dtype=gram.dtype)
  inv = inverse_sqrt(gram, method=method, steps=steps)
  return x @ inv if tall else inv @ x


def top_right_singular_vectors(x: jax.Array, rank: int) -> jax.Array:
  """The leading ``rank`` right singular vectors of ``x`` as columns.

  Args:
    x: an ``(m, n)`` matrix (computed in float32).
    rank: static, at most ``min(m, n)``.

  Returns:
    An ``(n, rank)`` float32 matrix with orthonormal columns.
  """
  _, _, vt = jnp.linalg.svd(x.astype(jnp.float32), full_matrices=False)
  return vt[:rank].T


def random_orthonormal(key: jax.Array, n: int, rank: int) -> jax.Array:
  """An ``(n, rank)`` float32 matrix with random orthonormal columns."""
  q, _ = jnp.linalg.qr(jax.random.normal(key, (n, rank), jnp.float32))
  return q


def random_coordinates(key: jax.Array, n: int, rank: int) -> jax.Array:
  """An ``(n, rank)`` selection matrix of ``rank`` distinct random columns."""
  idx = jax.random.permutation(key, n)[:rank]
  return jax.nn.one_hot(idx, n, dtype=jnp.float32).T


# Sharding: matrix decompositions need whole matrices. On an explicit mesh the
# library's matrix code works on gathered copies and hands back results in the
# shardings of their inputs, so state shardings stay put across steps.


def _sharding(x: Any):
  return getattr(jax.typeof(x), 'sharding', None)


def _explicit(sharding) -> bool:
  if sharding is None:
    return False
  types = getattr(sharding.mesh, 'axis_types', ()) or ()
  return any(t == jax.sharding.AxisType.Explicit for t in types)


def unshard(x: jax.Array) -> jax.Array:
  """A replicated copy of ``x`` if it is sharded over an explicit mesh."""
  sharding = _sharding(x)
  if not _explicit(sharding) or all(p is None for p in sharding.spec):
    return x
  return jax.reshard(x, jax.NamedSharding(sharding.mesh, jax.P()))


def sharded_like(x: jax.Array, ref: jax.Array) -> jax.Array:
  """``x`` resharded to the explicit sharding of ``ref`` (if it has one)."""
  sharding = _sharding(ref)
  if not _explicit(sharding) or _sharding(x).spec == sharding.spec:
    return x
  return jax.reshard(x, sharding)


def gathered(
    tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """Runs ``tx.update`` on unsharded inputs; outputs keep input shardings.

  Without an explicit mesh this is ``tx`` unchanged. On one (e.g. FSDP
  sharding of a weight's rows) each leaf is all-gathered before the update
  and the new updates and state are resharded like the incoming updates and
  the old state. This is the simple, single-device form of the matrix
  methods; their communication-efficient sharded forms are out of scope.

  Args:
    tx: a transform whose update needs whole matrices.

  Returns:
    The wrapped transform (same init).
  """

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    gather = lambda t: jax.tree.map(unshard, t)
    new_updates, new_state = tx.update(
        gather(updates), gather(state), gather(params))
    return (jax.tree.map(sharded_like, new_updates, updates),
            jax.tree.map(sharded_like, new_state, state))

  return optax.GradientTransformation(tx.init, update_fn)
