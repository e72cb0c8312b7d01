"""Optimizer state kept in host memory between the steps that use it.

DiLoCo's anchor and outer momentum are read only at a sync, every ``H``
steps. :func:`host_shardings` places chosen fields of a state (a
NamedTuple) in host memory (``memory_kind='pinned_host'`` by default) and
:func:`offloaded` wraps a step so that they move to the device for the
step and back after it, inside the one jitted program. Device memory then
holds them only while a step runs; the transfers are the loop's, the
transform never sees them. Where a loop runs the sync and the inner steps
as two programs (``loc_opt.outer.plan``), wrap the sync program only.

Example::

  at_rest = host_shardings(state_shardings, ('anchor', 'outer_state'))
  step = jax.jit(offloaded(step, state_shardings, at_rest, argnum=1),
                 in_shardings=(p, at_rest, p), out_shardings=(p, at_rest))

References: Rajbhandari, Rasley, Ruwase, He, *ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models*, 2020; Ren, Rajbhandari,
Aminabadi, Ruwase, Yang, Zhang, Li, He, *ZeRO-Offload: Democratizing
Billion-Scale Model Training*, 2021.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax


def host_shardings(shardings: Any, fields: Sequence[str],
                   memory_kind: str = 'pinned_host') -> Any:
  """``shardings`` (a NamedTuple of sharding trees, like the state) with
  the ``fields``' shardings moved to ``memory_kind``."""
  return shardings._replace(**{f: jax.tree.map(
      lambda s: s.with_memory_kind(memory_kind), getattr(shardings, f))
      for f in fields})


def _move(state: Any, shardings: Any, fields: Sequence[str]) -> Any:
  return state._replace(**{f: jax.device_put(
      getattr(state, f), getattr(shardings, f)) for f in fields})


def offloaded(step: Callable[..., tuple[Any, ...]], on_device: Any,
              at_rest: Any, *, argnum: int = 1, outnum: int = 1
              ) -> Callable[..., tuple[Any, ...]]:
  """``step`` with the state (argument ``argnum``, output ``outnum``)
  moved from ``at_rest`` to ``on_device`` shardings before it and back
  after it; only the fields whose shardings differ move.

  Args:
    step: ``(..., state, ...) -> (..., state, ...)``.
    on_device: the state's shardings while the step runs.
    at_rest: its shardings between steps (see :func:`host_shardings`).
    argnum: the state's position among the arguments.
    outnum: its position among the outputs.

  Returns:
    The wrapped step (jit it with ``at_rest`` as the state's in and out
    shardings).
  """
  fields = [f for f in on_device._fields
            if getattr(on_device, f) != getattr(at_rest, f)]

  def wrapped(*args):
    args = list(args)
    args[argnum] = _move(args[argnum], on_device, fields)
    out = list(step(*args))
    out[outnum] = _move(out[outnum], at_rest, fields)
    return tuple(out)

  return wrapped
