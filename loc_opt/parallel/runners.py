"""Running one per-worker function across all workers.

The library's transforms never name a mesh axis: they take ``axis_name`` and
use ``jax.lax`` collectives over it. The same per-worker function then runs

* under :func:`vmap_workers` -- ``jax.vmap`` with an axis name over stacked
  replicas on one device (simulation, Colab, unit tests), or
* under :func:`shard_map_workers` -- ``jax.shard_map`` that is manual over the
  worker axis only, so that GSPMD keeps sharding the model over ``data``,
  ``fsdp`` and ``tensor`` inside each worker (real pods).

In both, arguments mapped with ``0`` carry a leading axis of size M (one slice
per worker) and the function sees one worker's slice without that axis;
arguments mapped with ``None`` are shared by all workers.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from loc_opt import _checks
from loc_opt.parallel import mesh as mesh_lib

AxisSpec = int | None


def _normalize(axes: AxisSpec | Sequence[AxisSpec], n: int, what: str):
  if axes is None or isinstance(axes, int):
    axes = (axes,) * n
  axes = tuple(axes)
  if len(axes) != n:
    raise ValueError(f'{what} has {len(axes)} entries for {n} values')
  for a in axes:
    if a not in (0, None):
      raise ValueError(f'{what} entries must be 0 (per worker) or None '
                       f'(shared), got {a!r}')
  return axes


def _stacked(fn, axis_name, in_axes, out_axes):
  """``fn`` under ``jax.vmap`` over the whole stacked worker axis.

  Serves two layouts. With a worker mesh axis of size 1, a collective over a
  size-1 manual axis would reach XLA's SPMD partitioner as a cross-partition
  all-reduce outside manual mode, which it rejects ("Cross-partition
  allreduce must be in (partial) manual partitioning mode"), for every
  method that averages over workers; with one worker every such collective
  is the identity, so ``fn`` runs under ``jax.vmap`` over the size-1 worker
  axis instead (its collectives bind the axis name and reduce over one
  element), and GSPMD shards the model inside the worker as before. With
  ``stacked`` workers (:func:`shard_map_workers`), the leading axis holds
  all M workers split over the G device groups of the worker mesh axis:
  ``jax.vmap`` sees all M, each collective over ``axis_name`` becomes an
  operation along that axis, and GSPMD keeps each group's M / G workers on
  the group's devices, so only the collectives cross groups. The vmap's
  ``spmd_axis_name`` puts the worker axis on the stacked dimension of every
  sharding constraint inside ``fn``, so no constraint gathers the workers
  onto every group.
  """

  def mapped(*args):
    ins = _normalize(in_axes, len(args), 'in_axes')
    out = jax.vmap(fn, in_axes=ins, out_axes=0, axis_name=axis_name,
                   spmd_axis_name=axis_name)(*args)
    single = not isinstance(out, tuple)
    outs = (out,) if single else out
    o_axes = _normalize(out_axes, len(outs), 'out_axes')
    outs = tuple(o if ax == 0 else jax.tree.map(lambda x: x[0], o)
                 for o, ax in zip(outs, o_axes))
    return outs[0] if single else outs

  return mapped


def runs_under_vmap(mesh: jax.sharding.Mesh, *,
                    axis_name: str = mesh_lib.WORKER,
                    stacked: bool = False) -> bool:
  """Whether :func:`shard_map_workers` on ``mesh`` runs the worker function
  under ``jax.vmap`` (stacked workers, or a worker axis of size 1) rather
  than ``jax.shard_map``."""
  return stacked or mesh.shape[axis_name] == 1


def replicate(tree: Any, num_workers: int) -> Any:
  """``num_workers`` identical copies of every leaf, stacked on a new
  leading axis: the per-worker layout of :func:`vmap_workers` and
  :func:`shard_map_workers` (DiLoCo's workers start from one point).

  Example:
    >>> replicate({'w': jnp.zeros(3)}, 4)['w'].shape
    (4, 3)
  """
  num_workers = _checks.positive_int(num_workers, 'num_workers')
  return jax.tree.map(
      lambda x: jnp.broadcast_to(x, (num_workers, *jnp.shape(x))), tree)


def vmap_workers(
    fn: Callable[..., Any],
    *,
    axis_name: str = mesh_lib.WORKER,
    in_axes: AxisSpec | Sequence[AxisSpec] = 0,
    out_axes: AxisSpec | Sequence[AxisSpec] = 0,
) -> Callable[..., Any]:
  """Runs ``fn`` once per worker with ``jax.vmap`` over a named axis.

  Collectives over ``axis_name`` inside ``fn`` reduce over the stacked axis,
  so this simulates M workers on a single device.

  Args:
    fn: the per-worker function.
    axis_name: the name collectives in ``fn`` use for the worker axis.
    in_axes: per positional argument, ``0`` (stacked per worker) or ``None``
      (shared); one value applies to all arguments.
    out_axes: the same for the outputs (a tuple for a tuple output).

  Returns:
    The mapped function.
  """
  return jax.vmap(fn, in_axes=in_axes, out_axes=out_axes, axis_name=axis_name)


def shard_map_workers(
    fn: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    *,
    axis_name: str = mesh_lib.WORKER,
    in_axes: AxisSpec | Sequence[AxisSpec] = 0,
    out_axes: AxisSpec | Sequence[AxisSpec] = 0,
    stacked: bool = False,
) -> Callable[..., Any]:
  """Runs ``fn`` once per worker under ``jax.shard_map`` over ``axis_name``.

  The map is manual over the worker axis only: inside ``fn`` every other mesh
  axis is still handled by GSPMD, so the model keeps its within-worker
  sharding. Arguments mapped with ``0`` must have a leading axis equal to the
  worker count; ``fn`` sees them without it.

  Args:
    fn: the per-worker function.
    mesh: a mesh with an axis named ``axis_name``.
    axis_name: the worker axis.
    in_axes: as in :func:`vmap_workers`.
    out_axes: as in :func:`vmap_workers`. Outputs mapped with ``None`` must be
      the same on every worker (e.g. the result of a ``pmean``).
    stacked: the leading axis holds M workers stacked over the G groups of
      devices along ``axis_name`` (M / G workers on each group, G dividing
      M; simulated workers, ``mesh.simulate_workers``): ``fn`` runs under
      ``jax.vmap`` and GSPMD keeps each group's workers on its devices, so
      only ``fn``'s collectives cross groups.

  Returns:
    The mapped function (wrap it in ``jax.jit``).
  """
  if axis_name not in mesh.axis_names:
    raise ValueError(
        f'mesh axes {mesh.axis_names} have no worker axis {axis_name!r}'
    )
  if runs_under_vmap(mesh, axis_name=axis_name, stacked=stacked):
    return _stacked(fn, axis_name, in_axes, out_axes)
  spec = {0: jax.P(axis_name), None: jax.P()}

  def mapped(*args):
    ins = _normalize(in_axes, len(args), 'in_axes')

    def body(*local):
      local = [
          jax.tree.map(lambda x: x[0], a) if ax == 0 else a
          for a, ax in zip(local, ins)
      ]
      out = fn(*local)
      single = not isinstance(out, tuple)
      outs = (out,) if single else out
      o_axes = _normalize(out_axes, len(outs), 'out_axes')
      outs = tuple(
          jax.tree.map(lambda x: x[None], o) if ax == 0 else o
          for o, ax in zip(outs, o_axes)
      )
      return outs[0] if single else outs

    if isinstance(out_axes, int) or out_axes is None:
      out_specs = spec[out_axes]
    else:
      out_specs = tuple(spec[a] for a in out_axes)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(spec[a] for a in ins),
        out_specs=out_specs,
        axis_names={axis_name},
    )(*args)

  return mapped
