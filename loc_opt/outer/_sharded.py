r"""Outer state sharded over the workers: each holds 1/M of the anchor.

With ``diloco(..., outer_state_layout='sharded')`` every worker keeps, of
each anchor leaf zero-padded on its leading axis to a multiple of the
worker count ``M``, only its own rows, strided (worker ``i`` holds rows
``i, i + M, i + 2M, ...``: ``ceil(rows / M)`` of them; a scalar is one
row), and the outer optimizer's state over that shard. Strided rows keep
the leaf's other axes, and a device's block of rows under FSDP holds
whole groups of ``M`` rows, so the shard can take its parameter's
sharding inside a worker. (XLA's SPMD partitioner, in a ``shard_map``
manual over the worker axis only, gathers a reduce-scatter's and an
all-gather's operand inside the worker first: under FSDP / tensor
parallelism the sync would move that many times the bytes. With
``param_specs`` each leaf's collectives run on each device's block, manual
over the axes inside the worker; see :func:`scatter_delta` and
docs/sharding.md.) The sync then is

.. math::

  \bar\theta_i = \operatorname{reduce\_scatter}_i(\theta'), \quad
  \Delta_i = \phi_i - \bar\theta_i / M, \quad
  \phi_i \leftarrow \phi_i + \mathrm{outer}(\Delta_i), \quad
  \phi = \operatorname{all\_gather}(\phi_i),

a reduce-scatter of the local parameters and an all-gather of the new
anchor: together the two halves of a ring all-reduce, so the bytes on the
wire are those of the replicated layout's all-reduce (where a worker's
parameters are not split inside it), while the persistent
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

import functools
import math
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
  """Rows of one worker's shard of a leading axis of ``size`` rows."""
  return -(-int(size) // int(num_workers))


def shard_shape(shape: tuple[int, ...], num_workers: int
                ) -> tuple[int, ...]:
  """The shape of one worker's shard of a leaf of ``shape`` (a scalar is
  one row)."""
  shape = tuple(shape) or (1,)
  return (shard_size(shape[0], num_workers), *shape[1:])


def _grouped(x: jax.Array, num_workers: int) -> jax.Array:
  """``x`` (a scalar as one row), its rows zero-padded to a multiple of
  ``num_workers`` and grouped: shape ``(rows / M, M, *rest)``, so that
  ``[:, i]`` is worker ``i``'s rows ``i, i + M, ...``."""
  x = jnp.reshape(x, (1,)) if x.ndim == 0 else x
  pad = shard_size(x.shape[0], num_workers) * num_workers - x.shape[0]
  if pad:
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
  return x.reshape(x.shape[0] // num_workers, num_workers, *x.shape[1:])


def shard_tree(tree: Any, axis_name: str) -> Any:
  """This worker's rows of every leaf of ``tree`` (see
  :func:`shard_shape`)."""
  m = jax.lax.axis_size(axis_name)
  index = jax.lax.axis_index(axis_name)

  def one(x):
    return jax.lax.dynamic_index_in_dim(_grouped(x, m), index, axis=1,
                                        keepdims=False)

  return jax.tree.map(one, tree)


def _is_spec(x) -> bool:
  return x is None or isinstance(x, jax.P)


def _names(entry) -> tuple[str, ...]:
  """The mesh axes a spec entry names."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _block_specs(like: Any, specs: Any, num_workers: int
                 ) -> list[tuple[Any, tuple[str, ...]] | None]:
  """Per leaf of ``like``: ``(spec, spread)`` when the leaf can run its
  collectives on each device's block, manual over the mesh axes inside a
  worker, else None. ``spread``: the axes inside the worker that the leaf
  is replicated over (data-parallel replicas), which then split its block
  so that each replica sends its part.

  A block holds the same rows of the worker's shard as the strided layout
  when the leaf's rows split over its spec's leading axes into blocks of a
  multiple of ``M`` rows (device ``k``'s block, rows ``i, i + M, ...`` of
  it, is then the ``k``-th block of worker ``i``'s shard); the replicas
  split those rows when the block is a multiple of ``M`` times their
  count.
  """
  leaves = jax.tree.leaves(like)
  if specs is None:
    return [None] * len(leaves)
  specs = jax.tree.leaves(specs, is_leaf=_is_spec)
  if len(specs) != len(leaves):
    raise ValueError(f'param_specs has {len(specs)} leaves, the parameters '
                     f'{len(leaves)}')
  mesh = jax.sharding.get_abstract_mesh()
  inner = [a for a in mesh.axis_names if a not in mesh.manual_axes] \
      if not mesh.empty else []
  if not inner:
    return [None] * len(leaves)
  out = []
  for x, spec in zip(leaves, specs):
    spec = jax.P() if spec is None else spec
    used = {a for entry in spec for a in _names(entry)}
    split = math.prod(mesh.shape[a] for a in _names(spec[0] if spec else None))
    if x.ndim == 0 or x.shape[0] % (split * num_workers):
      out.append(None)
      continue
    spread = tuple(a for a in inner if a not in used and mesh.shape[a] > 1)
    replicas = math.prod(mesh.shape[a] for a in spread)
    if (x.shape[0] // split) % (num_workers * replicas):
      spread = ()
    out.append((spec, spread))
  return out


def _part(x: jax.Array, spread: tuple[str, ...]) -> jax.Array:
  """This replica's part of ``x``'s rows (all of them without ``spread``)."""
  if not spread:
    return x
  rows = x.shape[0] // math.prod(jax.lax.axis_size(a) for a in spread)
  return jax.lax.dynamic_slice_in_dim(
      x, jax.lax.axis_index(spread) * rows, rows, axis=0)


def _joined(x: jax.Array, spread: tuple[str, ...]) -> jax.Array:
  """The replicas' parts of the rows, back in order (:func:`_part`)."""
  return jax.lax.all_gather(x, spread, axis=0, tiled=True) if spread else x


def _map_leaves(fn, blocks: list[Any], *trees, extra=()) -> Any:
  """``fn(*leaves, *extra, spread=...)`` per leaf of ``trees``; where the
  leaf has a block spec, under a ``shard_map`` manual over the axes inside
  the worker (each device on its block; ``extra`` replicated)."""
  mesh = jax.sharding.get_abstract_mesh()
  structure = jax.tree.structure(trees[0])
  out = []
  for block, *leaves in zip(blocks, *map(jax.tree.leaves, trees)):
    if block is None:
      out.append(fn(*leaves, *extra, spread=()))
      continue
    spec, spread = block
    inner = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
    # The replicas' parts are joined by an all-gather: the result is the
    # same on each of them, which check_vma cannot infer.
    out.append(jax.shard_map(
        functools.partial(fn, spread=spread),
        in_specs=(spec,) * len(leaves) + (jax.P(),) * len(extra),
        out_specs=spec, axis_names=inner, check_vma=False)(*leaves, *extra))
  return jax.tree.unflatten(structure, out)


def gather_tree(shards: Any, like: Any, axis_name: str, *,
                param_specs: Any = None) -> Any:
  """The full leaves (shapes of ``like``) from every worker's rows: one
  all-gather per leaf, the padding dropped. With ``param_specs`` (see
  :func:`scatter_delta`), per device block where the rows allow."""
  m = jax.lax.axis_size(axis_name)

  def one(s, x, *, spread):
    full = jax.lax.all_gather(_part(s, spread), axis_name, axis=1)
    full = _joined(full, spread)
    full = full.reshape(-1, *full.shape[2:])
    return full[:x.shape[0] if x.ndim else 1].reshape(x.shape)

  return _map_leaves(one, _block_specs(like, param_specs, m), shards, like)


def scatter_delta(anchor: Any, local: Any, included: jax.Array,
                  axis_name: str, *, param_specs: Any = None) -> Any:
  """This worker's shard of the pseudo-gradient mean over the workers
  where ``included`` holds: ``phi_i - sum_i(theta') / count`` (zero when no
  worker is included), by a reduce-scatter of the local parameters in the
  anchor's dtypes and a scalar all-reduce of the count.

  ``param_specs``: the parameters' specs over the mesh axes inside a
  worker (a tree of ``jax.P`` like ``local``), when this runs in a
  ``shard_map`` manual over the worker axis only. A leaf whose rows split
  over its spec's leading axes into blocks of a multiple of ``M`` rows
  then reduce-scatters each device's block under a ``shard_map`` manual
  over the axes inside the worker: each device sends its block, where
  GSPMD would gather the leaf inside the worker first and every device
  would send it whole; devices that hold the same block (data-parallel
  replicas) each send a part of it and all-gather the parts inside the
  worker. Same values, same layout of the shards.
  """
  m = jax.lax.axis_size(axis_name)
  count = jax.lax.psum(included.astype(jnp.float32), axis_name)

  def one(a, x, included, count, *, spread):
    scale = jnp.where(count > 0, 1 / jnp.maximum(count, 1.), 0.)
    x = jnp.where(included, x.astype(a.dtype), jnp.zeros((), a.dtype))
    total = jax.lax.psum_scatter(_part(_grouped(x, m), spread), axis_name,
                                 scatter_dimension=1)
    delta = _part(a, spread) - (total * scale).astype(a.dtype)
    return _joined(jnp.where(count > 0, delta, jnp.zeros_like(delta)),
                   spread)

  return _map_leaves(one, _block_specs(local, param_specs, m), anchor, local,
                     extra=(included, count))


def _leaf_bytes(param: Any, layout: str, num_workers: int,
                anchor_dtype: Any, outer: optax.GradientTransformation
                ) -> int:
  """Bytes of the anchor and outer state of one parameter leaf."""

  def build(p):
    anchor = _local.init_anchor(p, anchor_dtype)
    if layout == 'sharded':
      anchor = jnp.zeros(shard_shape(anchor.shape, num_workers),
                         anchor.dtype)
    return anchor, outer.init(anchor)

  return sum(int(x.size) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(jax.eval_shape(build, param)))


def state_bytes(params: Any, num_workers: int, *, layout: str,
                divisors: Any = None, anchor_dtype: Any = jnp.float32,
                outer: optax.GradientTransformation | None = None) -> int:
  """Bytes of DiLoCo's anchor and outer-optimizer state on one device.

  Derived from shapes (``jax.eval_shape``), not from a compiler's memory
  analysis: ``'replicated'`` holds the whole anchor and outer state on
  every worker, ``'sharded'`` the padded ``1/M`` of each leaf (see
  :func:`shard_tree`; ZeRO stage 1, Rajbhandari et al., 2020). Within a
  worker each leaf's state is divided over ``divisors`` devices (e.g. the
  FSDP / tensor devices its parameter is sharded over, for the replicated
  layout; the sharded layout's shards are replicated within a worker
  unless the loop shards them). Scalar optimizer leaves (counts) are
  counted once per parameter leaf, a few bytes over.

  Args:
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
    num_workers: the worker count ``M``.
    layout: ``'replicated'`` or ``'sharded'``.
    divisors: per parameter leaf, the devices of a worker its state is
      divided over (a tree like ``params``, or one int); default 1.
    anchor_dtype: the anchor's minimum precision (as ``diloco``).
    outer: the outer optimizer (default: Nesterov SGD).

  Returns:
    Bytes per device (rounded up).

  Example:
    >>> state_bytes({'w': jnp.zeros((64, 32))}, 4, layout='sharded')
    4096
  """
  check_layout(layout)
  outer = _local.nesterov_outer() if outer is None else outer
  leaves = jax.tree.leaves(params)
  divisors = 1 if divisors is None else divisors
  if isinstance(divisors, int):
    divisors = [divisors] * len(leaves)
  else:
    divisors = jax.tree.leaves(divisors)
  total = sum(_leaf_bytes(p, layout, num_workers, anchor_dtype, outer) / d
              for p, d in zip(leaves, divisors, strict=True))
  return int(-(-total // 1))
