"""Logical axis names: one table maps model dimensions to mesh axes.

A model names each dimension of its parameters and activations by what it
is (``'batch'``, ``'length'``, ``'embed'``, ``'mlp'``, ``'heads'``,
``'vocab'``), not by the mesh axis it is split over. One table, the *axis
rules*, maps every logical name to zero or more mesh axes; it is a field of
the model config (``model.axis_rules``), so a run changes its layout without
touching model code.

A logical spec becomes a ``jax.P`` name by name, left to right: each name
takes the mesh axes of its rule that exist on the mesh, are not manual and
are not already taken by an earlier dimension of the same spec. The last
condition lets one table serve both parameters and activations, as in Flax's
``logical_to_mesh_axes``: with the default rules a kernel
``('embed', 'mlp')`` is ``P('fsdp', 'tensor')`` (FSDP over ``fsdp``,
Megatron over ``tensor``) while an activation ``('batch', 'length',
'embed')`` is ``P(('data', 'fsdp'), None, None)``, because ``'batch'``
already took ``fsdp``.

Default rules (:data:`DEFAULT_RULES`):

==========  =============================  ==================================
logical     mesh axes                      used by
==========  =============================  ==================================
batch       ('worker', 'data', 'fsdp')     activations' batch dimension
length      ()                             sequence positions
embed       ('fsdp',)                      d_model: parameters only (FSDP)
mlp         ('tensor',)                    MLP hidden units (Megatron)
heads       ('tensor',)                    attention heads (Megatron)
kv          ()                             per-head features
vocab       ('tensor',)                    vocabulary (vocab-parallel)
layers      ()                             stacked blocks (``scan_layers``)
expert      ('fsdp',)                      MoE experts (``model.moe``)
==========  =============================  ==================================

Inside the trainer's ``jax.shard_map`` the ``worker`` axis is manual, so
``'batch'`` resolves to ``('data', 'fsdp')``; under plain ``jax.jit`` on a
mesh (data parallel) it spans all three.

References:
  Shoeybi et al., Megatron-LM: Training Multi-Billion Parameter Language
  Models Using Model Parallelism, 2019.
  Rajbhandari et al., ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models, 2020.
  Xu et al., GSPMD: General and Scalable Parallelization for ML Computation
  Graphs, 2021.
"""

from collections.abc import Iterable, Mapping, Sequence
import functools
import math
from typing import Any

import jax

P = jax.P
Rules = tuple[tuple[str, tuple[str, ...]], ...]

DEFAULT_RULES: Rules = (
    ('batch', ('worker', 'data', 'fsdp')),
    ('length', ()),
    ('embed', ('fsdp',)),
    ('mlp', ('tensor',)),
    ('heads', ('tensor',)),
    ('kv', ()),
    ('vocab', ('tensor',)),
    ('layers', ()),
    ('expert', ('fsdp',)),
)


def normalize_rules(rules: Mapping[str, Any] | Iterable[Any] | None) -> Rules:
  """Axis rules as a hashable tuple of ``(logical, mesh_axes)`` pairs.

  Args:
    rules: a mapping or a sequence of pairs ``logical -> mesh axes``, where
      the mesh axes are ``None`` (replicated), one axis name, or a sequence
      of names. ``None`` gives :data:`DEFAULT_RULES`.

  Returns:
    The rules, each value a tuple of axis names.

  Raises:
    ValueError: for a malformed table or a logical name given twice.
  """
  if rules is None:
    return DEFAULT_RULES
  pairs = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
  out, seen = [], set()
  for pair in pairs:
    if not isinstance(pair, Sequence) or len(pair) != 2:
      raise ValueError(f'axis rule {pair!r} is not a (logical, axes) pair')
    name, axes = pair
    if not isinstance(name, str) or name in seen:
      raise ValueError(f'axis rule name {name!r} is not a new string')
    if axes is None:
      axes = ()
    elif isinstance(axes, str):
      axes = (axes,)
    if not isinstance(axes, Sequence) or not all(
        isinstance(a, str) for a in axes):
      raise ValueError(f'axis rule {name!r}: mesh axes {axes!r} not strings')
    seen.add(name)
    out.append((name, tuple(axes)))
  return tuple(out)


def logical_to_spec(
    logical: Sequence[str | None],
    rules: Rules,
    mesh_axes: Iterable[str] | None = None,
) -> P:
  """The ``jax.P`` of one logical spec.

  Args:
    logical: a logical name (or ``None``: replicated) per dimension.
    rules: normalized axis rules (:func:`normalize_rules`).
    mesh_axes: the mesh axes a name may use (default: any).

  Returns:
    A ``jax.P`` with one entry per dimension: ``None``, an axis name, or a
    tuple of axis names.

  Raises:
    KeyError: for a logical name the rules lack.

  Example:
    >>> logical_to_spec(('batch', 'length', 'embed'), DEFAULT_RULES,
    ...                 ('data', 'fsdp', 'tensor'))
    PartitionSpec(('data', 'fsdp'), None, None)
  """
  table = dict(rules)
  allowed = None if mesh_axes is None else frozenset(mesh_axes)
  used: set[str] = set()
  entries = []
  for name in logical:
    if name is None:
      entries.append(None)
      continue
    if name not in table:
      raise KeyError(
          f'logical axis {name!r} has no rule; rules name {sorted(table)}')
    axes = tuple(a for a in table[name] if a not in used
                 and (allowed is None or a in allowed))
    used.update(axes)
    entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*entries)


def logical_to_mesh_specs(logical_specs: Any, rules: Rules) -> Any:
  """Maps a pytree of logical ``jax.P`` (parameter annotations) to mesh
  axis ``jax.P`` with :func:`logical_to_spec` (every mesh axis allowed)."""
  return jax.tree.map(lambda s: logical_to_spec(tuple(s), rules), logical_specs,
                      is_leaf=lambda x: isinstance(x, P))


def _free_axes() -> dict[str, int]:
  """The current mesh's axes that a sharding constraint may name (not
  manual, size above 1) and their sizes; empty when no mesh is set."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return {}
  manual = jax.sharding.AxisType.Manual
  return {name: size for name, size, kind in
          zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
          if kind != manual and size > 1}


def _divisible(entry: Any, dim: int, sizes: Mapping[str, int]) -> Any:
  """``entry`` without the trailing axes that do not divide ``dim``."""
  if entry is None:
    return None
  axes = (entry,) if isinstance(entry, str) else tuple(entry)
  while axes and dim % math.prod(sizes[a] for a in axes):
    axes = axes[:-1]
  return None if not axes else axes[0] if len(axes) == 1 else axes


def constrain(x: jax.Array, logical: Sequence[str | None],
              rules: Rules) -> jax.Array:
  """``jax.lax.with_sharding_constraint`` of ``x`` to a logical spec.

  Resolved against the mesh in context (``jax.set_mesh``, or the mesh of an
  enclosing ``jax.shard_map``, minus its manual axes). With no mesh, or no
  axis to split over, ``x`` is returned unchanged (a dimension that an
  axis does not divide is left unsplit over it), so model code runs the
  same on one device, under ``jax.vmap`` and on a mesh.

  Args:
    x: an activation.
    logical: a logical name (or ``None``) per dimension of ``x``.
    rules: normalized axis rules.

  Returns:
    ``x``, constrained.
  """
  if len(logical) != x.ndim:
    raise ValueError(f'logical spec {tuple(logical)} for a {x.ndim}-d array')
  sizes = _free_axes()
  if not sizes:
    return x
  spec = logical_to_spec(logical, rules, sizes)
  spec = P(*(_divisible(e, d, sizes) for e, d in zip(spec, x.shape)))
  return jax.lax.with_sharding_constraint(x, spec)


def is_split(logical: str, dim: int, rules: Rules) -> bool:
  """Whether a dimension of size ``dim`` named ``logical`` is split over a
  mesh axis of the mesh in context (what :func:`constrain` would do); False
  with no mesh."""
  sizes = _free_axes()
  if not sizes:
    return False
  entry = logical_to_spec((logical,), rules, sizes)[0]
  return _divisible(entry, dim, sizes) is not None


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def constrain_forward(x: jax.Array, logical: tuple[str | None, ...],
                      rules: Rules) -> jax.Array:
  """:func:`constrain` in the forward pass only: the cotangent is left to
  the partitioner (a constrained cotangent would be, e.g. a weight gradient
  all-reduced whole instead of reduce-scattered to its shards)."""
  return constrain(x, logical, rules)


def _constrain_forward_fwd(x, logical, rules):
  return constrain(x, logical, rules), None


def _constrain_forward_bwd(logical, rules, residual, g):
  del logical, rules, residual
  return (g,)


constrain_forward.defvjp(_constrain_forward_fwd, _constrain_forward_bwd)
