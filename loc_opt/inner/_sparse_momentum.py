"""Machinery shared by SPAM, Stable-SPAM and their clipping pieces.

* Adam-moment helpers: the dtype of a first moment (:func:`moment_dtype`)
  and the bias correction ``1 - decay**count`` (:func:`bias_correction`).
* SPAM's sparse momentum: which leaves keep moments on a random subset of
  their entries (:func:`check_density`, :func:`sparse_flags`), the initial
  moments and subsets (:func:`init_moments`) and their redraws
  (:func:`draw_indices`, :func:`leaf_key`), gathers and scatters that keep
  explicit shardings (:func:`gather`, :func:`scatter`), and the two forms of
  weight decay that spare entries a step left alone
  (:func:`with_decay_on_active`, :func:`decay_after_step`).

References:
  Huang, Zhu, Jin, Liu, Wang, Liu, *SPAM: Spike-Aware Adam with Momentum
  Reset for Stable LLM Training*, ICLR 2025.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loc_opt import _checks

ArrayLike = jax.typing.ArrayLike

NO_PARAMS = 'weight decay needs params: call update(updates, state, params)'


def moment_dtype(param_dtype, mu_dtype) -> jnp.dtype:
  """``mu_dtype`` if given, else the param dtype promoted to float32."""
  if mu_dtype is not None:
    return jnp.dtype(mu_dtype)
  return jnp.promote_types(param_dtype, jnp.float32)


def bias_correction(decay: ArrayLike, count: ArrayLike) -> jax.Array:
  """``1 - decay**count`` in float32."""
  decay = jnp.asarray(decay, jnp.float32)
  return 1.0 - decay ** jnp.asarray(count, jnp.float32)


def leaf_flags(mask: Any, tree: Any) -> list[bool]:
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


def check_density(density: Any) -> float | None:
  """The static density of the sparse momentum; None for dense moments.

  Raises:
    TypeError: ``density`` is traced (it sets state shapes).
    ValueError: ``density`` is not in ``(0, 1]``.
  """
  if density is None:
    return None
  density = _checks.static(density, 'density', error=TypeError)
  density = _checks.in_interval(density, 'density', 0, 1, closed='right')
  return None if density == 1.0 else density


def sparse_flags(tree, density, density_group) -> list[bool]:
  """Which leaves keep sparse momentum: 2-D leaves of the density group."""
  leaves = jax.tree.leaves(tree)
  if density is None:
    return [False] * len(leaves)
  group = leaf_flags(density_group, tree)
  return [g and x.ndim == 2 for g, x in zip(group, leaves)]


def _num_kept(size: int, density: float) -> int:
  k = int(np.floor(density * size))
  if k < 1:
    raise ValueError(f'density {density} keeps no entry of a leaf with '
                     f'{size} entries')
  return k


def draw_indices(key, size: int, k: int) -> jax.Array:
  """``k`` distinct flat indices in ``[0, size)``, sorted (int32)."""
  return jnp.sort(jax.random.permutation(key, size)[:k]).astype(jnp.int32)


def _draw_exact_mask(key, shape, k: int) -> jax.Array:
  """A bool mask of ``shape`` with exactly ``k`` True entries."""
  size = int(np.prod(shape))
  flat = jnp.zeros([size], bool).at[draw_indices(key, size, k)].set(True)
  return flat.reshape(shape)


def leaf_key(key_data, leaf: int, count) -> jax.Array:
  """The key of the mask draw of leaf number ``leaf`` on step ``count``."""
  key = jax.random.wrap_key_data(key_data)
  return jax.random.fold_in(jax.random.fold_in(key, leaf), count)


def init_moments(params, key_data, *, density, density_group, mu_dtype,
                 reference_compat):
  """Zero moments, and the initial masks of the sparse leaves.

  Dense leaves get moments of the param shape (the first in
  :func:`moment_dtype`, the second in float32). Sparse leaves get float32
  moments of shape ``(K,)`` and sorted flat indices of the ``K`` kept
  entries; with ``reference_compat`` float32 moments of the param shape and
  a bool mask with exactly ``K`` True entries.

  Returns:
    ``(mu, nu, masks)``: two trees like ``params`` and a tuple with one mask
    per sparse leaf, in tree-flatten order.
  """
  leaves, treedef = jax.tree.flatten(params)
  flags = sparse_flags(params, density, density_group)
  mu, nu, masks = [], [], []
  for i, (p, sparse) in enumerate(zip(leaves, flags)):
    if not sparse:
      mu.append(jnp.zeros_like(p, moment_dtype(p.dtype, mu_dtype)))
      nu.append(jnp.zeros_like(p, jnp.float32))
      continue
    k = _num_kept(p.size, density)
    key = leaf_key(key_data, i, 0)
    if reference_compat:
      masks.append(_draw_exact_mask(key, p.shape, k))
      mu.append(jnp.zeros_like(p, jnp.float32))
      nu.append(jnp.zeros_like(p, jnp.float32))
    else:
      masks.append(draw_indices(key, p.size, k))
      mu.append(jnp.zeros([k], jnp.float32))
      nu.append(jnp.zeros([k], jnp.float32))
  return treedef.unflatten(mu), treedef.unflatten(nu), tuple(masks)


def _explicit_sharding(x):
  """The explicit mesh sharding of ``x``'s type, or None when it has none."""
  sharding = jax.typeof(x).sharding
  if sharding.mesh.empty or all(p is None for p in sharding.spec):
    return None
  return sharding


def gather(x: jax.Array, idx: jax.Array) -> jax.Array:
  """``x[idx]``, replicated when ``x`` is sharded on an explicit mesh."""
  sharding = _explicit_sharding(x)
  if sharding is None:
    return x[idx]
  return x.at[idx].get(
      out_sharding=jax.NamedSharding(sharding.mesh, jax.P()))


def scatter(values: jax.Array, idx: jax.Array, like: jax.Array) -> jax.Array:
  """Zeros shaped like ``like`` with ``values`` at flat positions ``idx``."""
  out = jnp.zeros([like.size], values.dtype).at[idx].set(values)
  out = out.reshape(like.shape)
  sharding = _explicit_sharding(like)
  if sharding is not None:
    out = jax.reshard(out, sharding.spec)
  return out


# Weight decay. The kernels are jitted so that eager updates reuse one
# compiled program per shape; under an outer jit they are inlined.


@jax.jit
def _decay_updated(u, p, rate):
  """``u - rate (p + u)``: decay of the updated parameter ``p + u``."""
  return (u - rate * (p + u)).astype(u.dtype)


@jax.jit
def _decay_kept(u, p, weight_decay, kept):
  """``u + wd p`` on the kept entries (flat indices; None: all)."""
  d = weight_decay * p
  if kept is not None:
    d = jnp.where(scatter(jnp.ones(kept.shape, bool), kept, p), d, 0.0)
  return (u + d).astype(u.dtype)


class _CountState(NamedTuple):
  """State of :func:`decay_after_step`.

  Attributes:
    count: int32 scalar, updates taken (indexes a learning-rate schedule).
  """

  count: jax.Array


def decay_after_step(
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: ArrayLike,
    flags_fn: Callable[[Any], list[bool]],
) -> optax.GradientTransformation:
  """Decoupled decay of the *updated* params: ``u - lr wd (p + u)``.

  Goes after ``scale_by_learning_rate``; ``u`` is already scaled. Decays
  the leaves for which ``flags_fn(params)`` is True.
  """

  def init_fn(params):
    del params
    return _CountState(jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(NO_PARAMS)
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


def with_decay_on_active(
    direction: optax.GradientTransformation,
    weight_decay: ArrayLike,
    mask: Any,
    sparse_fn: Callable[[Any], list[bool]],
) -> optax.GradientTransformation:
  """``direction`` plus ``wd * p`` on the entries it updated this step.

  ``direction``'s state carries ``masks``, the kept flat indices of each
  leaf for which ``sparse_fn`` is True; ``mask`` picks the leaves that decay.
  """

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(NO_PARAMS)
    out, new_state = direction.update(updates, state, params)
    leaves, treedef = jax.tree.flatten(out)
    masks = iter(new_state.masks)
    decayed = []
    for u, p, on, sparse in zip(leaves, treedef.flatten_up_to(params),
                                leaf_flags(mask, params), sparse_fn(out)):
      kept = next(masks) if sparse else None
      decayed.append(_decay_kept(u, p, weight_decay, kept) if on else u)
    return treedef.unflatten(decayed), new_state

  return optax.GradientTransformation(direction.init, update_fn)
