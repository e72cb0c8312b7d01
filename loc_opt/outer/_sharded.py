r"""Outer state sharded over the workers: each holds 1/M of the anchor.

With ``diloco(..., outer_state_layout='sharded')`` every worker keeps, of
each anchor leaf flattened and zero-padded to a multiple of the worker
count ``M``, only its own contiguous 1/M (worker ``i`` holds elements
``[i s, (i + 1) s)``, ``s = ceil(n / M)``), and the outer optimizer's
state over that shard. The sync then is

.. math::

  \bar\theta_i = \operatorname{reduce\_scatter}_i(\theta'), \quad
  \Delta_i = \phi_i - \bar\theta_i / M, \quad
  \phi_i \leftarrow \phi_i + \mathrm{outer}(\Delta_i), \quad
  \phi = \operatorname{all\_gather}(\phi_i),

a reduce-scatter of the local parameters and an all-gather of the new
anchor: together the two halves of a ring all-reduce, so the bytes on the
wire are those of the replicated layout's all-reduce, while the persistent
outer state costs ``1/M`` per worker. The full anchor exists only inside
the sync step (it is where every worker lands). The mean of the pseudo-
gradient is taken as ``phi - mean(theta')``, equal to ``mean(phi -
theta')`` up to float rounding.

Exact for element-wise outer optimizers (SGD, Nesterov, Adam); an outer
optimizer that couples elements (global-norm clipping) would see only the
shard.

References:
  Rajbhandari, Rasley, Ruwase, He, *ZeRO: Memory Optimizations Toward
  Training Trillion Parameter Models*, 2020 (optimizer-state partitioning,
  stage 1). https://arxiv.org/abs/1910.02054
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from loc_opt.outer import _local

LAYOUTS = ('replicated', 'sharded')


def check_layout(layout: str) -> str:
  """``layout`` if it is one of :data:`LAYOUTS`, else a ``ValueError``."""
  if layout not in LAYOUTS:
    raise ValueError(f'outer_state_layout must be one of {LAYOUTS}, got '
                     f'{layout!r}')
  return layout


def shard_size(size: int, num_workers: int) -> int:
  """Elements of one worker's shard of a leaf of ``size`` elements."""
  return -(-int(size) // int(num_workers))


def _padded(x: jax.Array, num_workers: int) -> jax.Array:
  """``x`` flattened and zero-padded to a multiple of ``num_workers``."""
  flat = jnp.ravel(x)
  pad = shard_size(flat.size, num_workers) * num_workers - flat.size
  return jnp.pad(flat, (0, pad)) if pad else flat


def shard_tree(tree: Any, axis_name: str) -> Any:
  """This worker's shard of every leaf of ``tree`` (1-D, ``ceil(n/M)``)."""
  m = jax.lax.axis_size(axis_name)
  index = jax.lax.axis_index(axis_name)

  def one(x):
    rows = _padded(x, m).reshape(m, -1)
    return jax.lax.dynamic_index_in_dim(rows, index, keepdims=False)

  return jax.tree.map(one, tree)


def gather_tree(shards: Any, like: Any, axis_name: str) -> Any:
  """The full leaves (shapes of ``like``) from every worker's shard: one
  tiled all-gather per leaf, the padding dropped."""

  def one(s, x):
    full = jax.lax.all_gather(s, axis_name, tiled=True)
    return full[:x.size].reshape(x.shape)

  return jax.tree.map(one, shards, like)


def scatter_delta(anchor: Any, local: Any, included: jax.Array,
                  axis_name: str) -> Any:
  """This worker's shard of the pseudo-gradient mean over the workers
  where ``included`` holds: ``phi_i - sum_i(theta') / count`` (zero when no
  worker is included), by a tiled reduce-scatter of the local parameters
  in the anchor's dtypes and a scalar all-reduce of the count."""
  m = jax.lax.axis_size(axis_name)
  count = jax.lax.psum(included.astype(jnp.float32), axis_name)
  scale = jnp.where(count > 0, 1 / jnp.maximum(count, 1.), 0.)

  def one(a, x):
    x = jnp.where(included, x.astype(a.dtype), jnp.zeros((), a.dtype))
    total = jax.lax.psum_scatter(_padded(x, m), axis_name, tiled=True)
    return jnp.where(count > 0, a - (total * scale).astype(a.dtype),
                     jnp.zeros_like(a))

  return jax.tree.map(one, anchor, local)


def state_bytes(params: Any, num_workers: int, *, layout: str,
                anchor_dtype: Any = jnp.float32,
                outer: optax.GradientTransformation | None = None) -> int:
  """Bytes of DiLoCo's anchor and outer-optimizer state on one worker.

  Derived from shapes (``jax.eval_shape``), not from a compiler's memory
  analysis: ``replicated`` holds the whole anchor and outer state,
  ``sharded`` the padded ``1/M`` of each leaf (see :func:`shard_tree`).
  Within a worker the state is further divided over any devices it is
  sharded on; this is the per-worker figure.

  Args:
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
    num_workers: the worker count ``M``.
    layout: ``'replicated'`` or ``'sharded'``.
    anchor_dtype: the anchor's minimum precision (as ``diloco``).
    outer: the outer optimizer (default: Nesterov SGD).

  Returns:
    Bytes per worker.
  """
  check_layout(layout)
  outer = _local.nesterov_outer() if outer is None else outer

  def anchor_of(p):
    anchor = _local.init_anchor(p, anchor_dtype)
    if layout == 'sharded':
      anchor = jax.tree.map(
          lambda a: jnp.zeros((shard_size(a.size, num_workers),), a.dtype),
          anchor)
    return anchor, outer.init(anchor)

  shapes = jax.eval_shape(anchor_of, params)
  return sum(int(x.size) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(shapes))
