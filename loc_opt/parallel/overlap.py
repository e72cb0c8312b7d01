"""One compiled program over a sync step and the steps that overlap it.

Streaming DiLoCo's ``tau``, Eager updates and CO2 send a pseudo-gradient
(or the parameters) across workers and use the result only some steps
later. Run as one program per step, the sync's collective still blocks:
the next step's program takes the state the collective wrote. Traced as
*one* program over the sync step and the steps after it,
:func:`overlap_window`, the collective's result feeds only the step that
consumes it (Streaming DiLoCo's merge ``tau`` steps later) or the
program's output (Eager, CO2: the next sync), and the inner steps in
between neither feed it nor read it, so XLA's latency-hiding scheduler on
GPU and TPU is free to run the transfer behind their compute.
:func:`loc_opt.parallel.dataflow.collective_dataflow` checks that from
the compiled HLO; each step is traced under the name scope
``overlap_step<k>`` (a scanned run of steps ``j .. k`` under
``overlap_step<j>_<k>``), so the HLO metadata says which step an
instruction belongs to (:func:`steps_of`).

The steps are the same functions as one step at a time, composed, so the
numbers are those of the step-by-step run.

References:
  Douillard et al., *Streaming DiLoCo with overlapping communication:
  Towards a Distributed Free Lunch*, 2025.
  Kale, Douillard, Donchev, *Eager Updates For Overlapped Communication and
  Computation in DiLoCo*, 2025.
  Sun et al., *CO2: Efficient Distributed Training with Full
  Communication-Computation Overlap*, ICLR 2024.
"""

from collections.abc import Callable, Hashable, Sequence
import re
from typing import Any

import jax
import jax.numpy as jnp

from loc_opt import _checks

# The name scope of step k of a window: HLO op names contain it.
STEP_SCOPE = 'overlap_step'
_SCOPE = re.compile(rf'{STEP_SCOPE}(\d+)(?:_(\d+))?(?![\d_])')

Step = Callable[[Any, Any, Hashable], tuple[Any, Any]]

# Compile a window with these (``lowered.compile(compiler_options=...)``).
# XLA's all-reduce combiner merges independent all-reduces into one: in a
# window it merges the sync step's small within-worker reductions (the
# finiteness flags that gate the mean, the data-parallel gradient sums)
# with those of the later steps, so the sync's collective then waits for
# the later steps' backward pass (``collective_dataflow`` shows it on
# CPU). The window programs run without it: ``all-reduce-combiner``
# (XLA's generic pass), ``cpu-all-reduce-combiner`` on CPU (an unknown
# pass name is ignored).
#
# GPU's own combiner (``gpu-all-reduce-combiner``) stays: without it a
# sync's mean is one all-reduce per leaf, run one at a time. With it the
# mean comes in buckets of at most
# ``xla_gpu_all_reduce_combine_threshold_bytes`` (30 MiB by default); the
# GPU scheduler's default of one collective in flight made the first
# bucket finish inside the sync step, and two in flight let every bucket of
# Eager's average run behind the round's inner steps
# (``experiments/overlap_gpu.py``). Its cost: with data-parallel devices
# inside a worker it merged CO2's data-axis gradient sums across the
# window's steps (XLA had computed the one the send reads apart from the
# update's), and CO2's send then waited for the round. Off for CO2, it left
# the send one all-reduce per leaf, of which those holding the bulk of the
# bytes finished before step 1 on workers of one GPU: it stays on
# (docs/overlap.md).
#
# XLA's GPU multi-output fusion put a sync step's subtraction (the
# pseudo-gradient) and a later step's update into one kernel, so the
# sync's all-reduce waited for that step's backward pass (Streaming DiLoCo
# on 4 workers x 2 data-parallel devices, compiled for H100s): the windows
# run without it (``multi_output_fusion``).
COMPILER_OPTIONS = {
    'xla_disable_hlo_passes': 'all-reduce-combiner,cpu-all-reduce-combiner,'
                              'multi_output_fusion',
    'xla_gpu_experimental_parallel_collective_overlap_limit': 2}


def step_scope(first: int, last: int | None = None) -> str:
  """The name scope of step ``first`` (or of the scanned steps ``first ..
  last``) of a window."""
  if last is None or last == first:
    return f'{STEP_SCOPE}{first}'
  return f'{STEP_SCOPE}{first}_{last}'


def steps_of(op_name: str) -> range | None:
  """The window steps an HLO instruction belongs to, from its ``op_name``
  (``loc_opt.parallel.dataflow.Node.op_name``); ``None`` if none.

  Example:
    >>> steps_of('jit(window)/shard_map/overlap_step2/jvp()/dot_general')
    range(2, 3)
  """
  m = _SCOPE.search(op_name)
  if m is None:
    return None
  first = int(m.group(1))
  last = int(m.group(2)) if m.group(2) else first
  return range(first, last + 1)


def _runs(phases, scan_from):
  """``(first, count)`` of each run of equal consecutive phases; runs
  shorter than ``scan_from`` are split into single steps."""
  runs, k = [], 0
  while k < len(phases):
    n = 1
    while k + n < len(phases) and phases[k + n] == phases[k]:
      n += 1
    if scan_from is not None and n >= scan_from:
      runs.append((k, n))
    else:
      runs.extend((k + i, 1) for i in range(n))
    k += n
  return runs


def overlap_window(step: Step, phases: Sequence[Hashable], *,
                   scan_from: int | None = None
                   ) -> Callable[[Any, Sequence[Any]], tuple[Any, tuple]]:
  """One function over consecutive steps, to be jitted as one program.

  ``window(carry, xs)`` runs ``carry, y_k = step(carry, xs[k], phases[k])``
  for ``k = 0 .. len(phases) - 1`` and returns ``(carry, (y_0, ...))``.
  Put the step that issues a collective first and the steps that should
  overlap it after it: when the collective's result is read only by a later
  step's last part (or only returned), the compiled program lets them run
  concurrently; compile it with :data:`COMPILER_OPTIONS`. ``step`` may be
  a per-worker step (wrap the window in
  :func:`loc_opt.parallel.shard_map_workers` or :func:`vmap_workers`) or
  an already mapped one.

  Args:
    step: ``(carry, x, phase) -> (carry, y)``; ``phase`` is static (a
      method's ``sync`` argument, ``loc_opt.outer.plan``).
    phases: the phase of each step, at least one.
    scan_from: a run of at least this many equal consecutive phases runs as
      one ``lax.scan`` (the program stays small for Eager / CO2, whose
      window is a whole round); ``None`` unrolls every step.

  Returns:
    ``window(carry, xs) -> (carry, ys)``, ``xs`` and ``ys`` tuples with one
    entry per phase (the ``xs`` of a scanned run must share shapes).

  Example:
    >>> def step(c, x, phase):
    ...   return c + x if phase else c * x, c
    >>> overlap_window(step, (True, False))(1.0, (2.0, 3.0))
    (9.0, (1.0, 3.0))
  """
  phases = tuple(phases)
  if not phases:
    raise ValueError('overlap_window needs at least one phase, got none')
  if scan_from is not None:
    _checks.positive_int(scan_from, 'scan_from')
  runs = _runs(phases, scan_from)

  def window(carry, xs):
    xs = tuple(xs)
    if len(xs) != len(phases):
      raise ValueError(f'the window has {len(phases)} steps but got '
                       f'{len(xs)} inputs')
    ys = []
    for first, n in runs:
      phase = phases[first]
      with jax.named_scope(step_scope(first, first + n - 1)):
        if n == 1:
          carry, y = step(carry, xs[first], phase)
          ys.append(y)
          continue
        stacked = jax.tree.map(lambda *a: jnp.stack(a),
                               *xs[first:first + n])
        carry, y = jax.lax.scan(lambda c, x, ph=phase: step(c, x, ph),
                                carry, stacked)
        ys.extend(jax.tree.map(lambda a, i=i: a[i], y) for i in range(n))
    return carry, tuple(ys)

  return window
