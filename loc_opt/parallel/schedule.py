"""What a scheduled program runs while each asynchronous collective is in flight.

:mod:`loc_opt.parallel.dataflow` proves that a sync's collective *may*
overlap the steps after it (nothing of theirs feeds it or reads it). Whether
it *does* is the scheduler's decision: on GPU and TPU, XLA splits a
collective into a ``-start`` and a ``-done`` instruction (``all-reduce-start``
/ ``all-reduce-done``, ``all-gather-start`` / ``-done``,
``collective-permute-start`` / ``-done``, or an ``async-start`` /
``async-done`` pair around a reduce-scatter or all-to-all), and its
latency-hiding scheduler places independent work between them. The device
runs what is scheduled between the two while the transfer is in flight.

:func:`collective_schedule` reads a scheduled program (the optimized HLO of
``compiled.as_text()``, printed in schedule order) and reports, for every
collective (cross-worker ones by default), the instructions scheduled
between its start and its done in the computation that holds them, and,
among those and what they call (fusions, loops, branches, counted whole),
the matrix products: ``dot`` and ``convolution`` instructions and the
library GEMM and convolution calls GPU backends emit (cuBLAS, cuBLASLt,
cuDNN custom calls). A collective that runs synchronously (CPU, or a
schedule that left it whole) has no span.

Example::

  spans = collective_schedule(compiled, mesh)
  for span in spans:
    print(span.collective.kind, span.is_async, len(span.matmuls))
"""

from collections.abc import Callable
from collections.abc import Iterable
import dataclasses
import re

import jax

from loc_opt.parallel import _hlo_text as hlo_text
from loc_opt.parallel import dataflow
from loc_opt.parallel import hlo as hlo_lib

# Custom-call targets that are matrix products or convolutions.
_LIBRARY_MATMUL = re.compile(r'custom_call_target="([^"]*(?:gemm|matmul|'
                             r'conv)[^"]*)"', re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class CollectiveSpan:
  """One collective and what runs while it is in flight.

  Attributes:
    collective: the collective (kind, bytes, cross-worker or not).
    start: the instruction that starts it (``all-reduce-start``, or the
      ``async-start`` that wraps it); the collective itself when it runs
      synchronously.
    done: the instruction that waits for it, ``None`` when synchronous.
    between: the instructions scheduled after ``start`` and before ``done``
      in their computation, and everything those call, in schedule order.
    matmuls: the matrix products among ``between``.
  """

  collective: hlo_lib.Collective
  start: dataflow.Node
  done: dataflow.Node | None
  between: tuple[dataflow.Node, ...]
  matmuls: tuple[dataflow.Node, ...]

  @property
  def is_async(self) -> bool:
    """Whether the program waits for it later than it starts it."""
    return self.done is not None

  def matmuls_where(self, scope: str | None = None) -> list[dataflow.Node]:
    """:attr:`matmuls` with ``scope`` in their ``op_name``."""
    return [n for n in self.matmuls if scope is None or scope in n.op_name]


def is_matmul(ins: hlo_text.Instr) -> bool:
  """Whether ``ins`` is a matrix product or a convolution (an HLO ``dot`` or
  ``convolution``, or a library GEMM / convolution custom call)."""
  if ins.opcode in ('dot', 'convolution'):
    return True
  return ins.opcode == 'custom-call' and bool(_LIBRARY_MATMUL.search(ins.raw))


def is_scheduled(text: str) -> bool:
  """Whether the HLO module says it is printed in schedule order."""
  return bool(re.search(r'^HloModule\s.*\bis_scheduled=true', text, re.M))


def collective_schedule(
    program: 'jax.stages.Compiled | jax.stages.Lowered | str',
    mesh: jax.sharding.Mesh | None = None,
    *,
    worker_axis: str = 'worker',
    cross_worker_only: bool = True,
) -> tuple[CollectiveSpan, ...]:
  """What runs between the start and the done of every collective.

  Args:
    program: a ``jax.stages.Compiled``, a ``jax.stages.Lowered`` (compiled
      here) or optimized HLO text (``compiled.as_text()``).
    mesh: the program's mesh, to tell cross-worker collectives (see
      :func:`loc_opt.parallel.collective_bytes`); ``None``: one worker.
    worker_axis: the mesh axis that indexes workers.
    cross_worker_only: report only collectives that span two workers.

  Returns:
    One :class:`CollectiveSpan` per collective, in program order.

  Raises:
    ValueError: the module is not scheduled (its order says nothing), or
      as :func:`loc_opt.parallel.collective_bytes`.
  """
  text, comps, collectives = hlo_lib.read_collectives(
      program, mesh, worker_axis, cross_worker_only)
  if not is_scheduled(text):
    raise ValueError('the HLO module is not scheduled (no is_scheduled=true '
                     'in its header): pass the compiled program, whose '
                     'instructions are printed in the order they run')
  index = _Index(comps)
  return tuple(index.span(c) for c in collectives)


class _Index:
  """Where each instruction sits, who calls each computation."""

  def __init__(self, comps: dict[str, list[hlo_text.Instr]]):
    self.comps = comps
    self.where: dict[str, tuple[str, int]] = {}
    self.callers: dict[str, list[tuple[str, int]]] = {}
    self._deep: dict[str, tuple[hlo_text.Instr, ...]] = {}
    for comp, instrs in comps.items():
      for i, ins in enumerate(instrs):
        self.where[ins.name] = (comp, i)
        for called in hlo_text.called_computations(ins):
          self.callers.setdefault(called, []).append((comp, i))

  def node(self, comp: str, ins: hlo_text.Instr) -> dataflow.Node:
    return dataflow.Node(ins.name, ins.opcode, comp, hlo_text.op_name(ins))

  def deep(self, comp: str) -> tuple[tuple[str, hlo_text.Instr], ...]:
    """The instructions of ``comp`` and of what it calls, in order."""
    if comp not in self._deep:
      self._deep[comp] = ()  # a cycle (not valid HLO) stops here
      out = []
      for ins in self.comps.get(comp, ()):
        out.append((comp, ins))
        out.extend(self.expand(ins))
      self._deep[comp] = tuple(out)
    return self._deep[comp]

  def expand(self, ins: hlo_text.Instr) -> list[tuple[str, hlo_text.Instr]]:
    return [x for c in hlo_text.called_computations(ins) if c in self.comps
            for x in self.deep(c)]

  def starter(self, c: hlo_lib.Collective) -> tuple[str, int]:
    """The instruction that starts ``c``: itself, or the ``async-start``
    whose wrapped computation holds it."""
    comp, i = self.where[c.name]
    if self.comps[comp][i].opcode.endswith('-start'):
      return comp, i
    for caller_comp, j in self.callers.get(comp, ()):
      if self.comps[caller_comp][j].opcode == 'async-start':
        return caller_comp, j
    return comp, i

  def done_of(self, comp: str, i: int) -> int | None:
    """Position of the ``-done`` that waits for the start at ``i``
    (following ``-update`` links), ``None`` when synchronous."""
    if not self.comps[comp][i].opcode.endswith('-start'):
      return None
    chain = {self.comps[comp][i].name}
    for j in range(i + 1, len(self.comps[comp])):
      ins = self.comps[comp][j]
      if not ins.opcode.endswith(('-done', '-update')):
        continue
      if {hlo_text.operand(x)[1] for x in ins.operands} & chain:
        if ins.opcode.endswith('-done'):
          return j
        chain.add(ins.name)
    raise ValueError(f'{self.comps[comp][i].name} has no matching -done in '
                     f'{comp}')

  def span(self, c: hlo_lib.Collective) -> CollectiveSpan:
    comp, i = self.starter(c)
    instrs = self.comps[comp]
    j = self.done_of(comp, i)
    between: list[tuple[str, hlo_text.Instr]] = []
    for ins in instrs[i + 1:j] if j is not None else ():
      between.append((comp, ins))
      between.extend(self.expand(ins))
    return CollectiveSpan(
        collective=c, start=self.node(comp, instrs[i]),
        done=None if j is None else self.node(comp, instrs[j]),
        between=tuple(self.node(cc, x) for cc, x in between),
        matmuls=tuple(self.node(cc, x) for cc, x in between if is_matmul(x)))


def steps_in_flight(span: CollectiveSpan,
                    steps_of: Callable[[str], Iterable[int] | None]
                    ) -> set[int]:
  """The window steps (``steps_of(op_name)``, e.g.
  :func:`loc_opt.parallel.overlap.steps_of`) of the matrix products that
  run while ``span``'s collective is in flight."""
  return {k for n in span.matmuls for k in steps_of(n.op_name) or ()}

