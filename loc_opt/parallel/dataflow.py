"""What each collective of a compiled program waits for, and what waits on it.

A collective can only hide behind computation that neither feeds it nor
reads its result. :func:`collective_dataflow` reads the optimized HLO of a
program and reports, for every collective (cross-worker ones by default),
the instructions that transitively depend on its result (``users``) and
those it transitively depends on (``operands``). A test can then assert, on
the program XLA will run, that the gradient computation of the steps meant
to overlap a sync neither feeds the sync's all-reduce nor reads its result
(``loc_opt.parallel.overlap``), and see the dependence in a program that
consumes the result at once. This is dataflow, not timing: whether the
scheduler does overlap the transfer is the backend's (XLA's latency-hiding
scheduler on GPU and TPU; on CPU collectives run synchronously).

The analysis is conservative: an instruction that calls computations
(fusion, while, conditional, call) counts as a whole, so everything inside
a reached loop or branch is reached, and a reached element of a tuple
reaches the whole tuple. It may report a dependence that is not there,
never miss one. Edges are operands and ``control-predecessors``.

Example::

  flows = collective_dataflow(jax.jit(step).lower(state, batch), mesh)
  for flow in flows:
    assert not [n for n in flow.users if n.opcode == 'dot']
"""

from collections.abc import Iterable
import dataclasses

import jax

from loc_opt.parallel import _hlo_text as hlo_text
from loc_opt.parallel import hlo as hlo_lib


@dataclasses.dataclass(frozen=True)
class Node:
  """One HLO instruction.

  Attributes:
    name: its name (unique in the module).
    opcode: e.g. ``'dot'``, ``'fusion'``, ``'all-reduce-start'``.
    computation: the computation that holds it.
    op_name: JAX's name stack from its metadata (``jax.named_scope`` names
      appear there), ``''`` if none.
  """

  name: str
  opcode: str
  computation: str
  op_name: str


@dataclasses.dataclass(frozen=True)
class CollectiveDataflow:
  """The dependences of one collective.

  Attributes:
    collective: the collective (kind, bytes, cross-worker or not).
    node: its instruction.
    users: instructions that transitively read its result (the matching
      ``-done`` of an async collective included).
    operands: instructions its operands transitively come from.
  """

  collective: hlo_lib.Collective
  node: Node
  users: frozenset[Node]
  operands: frozenset[Node]

  def users_where(self, *, opcodes: Iterable[str] | None = None,
                  scope: str | None = None) -> list[Node]:
    """:attr:`users` with one of ``opcodes`` and ``scope`` in their
    ``op_name`` (either filter may be left out), sorted by name."""
    return _where(self.users, opcodes, scope)

  def operands_where(self, *, opcodes: Iterable[str] | None = None,
                     scope: str | None = None) -> list[Node]:
    """:attr:`operands` filtered as :meth:`users_where`."""
    return _where(self.operands, opcodes, scope)


def _where(nodes, opcodes, scope) -> list[Node]:
  opcodes = None if opcodes is None else frozenset(opcodes)
  return sorted((n for n in nodes
                 if (opcodes is None or n.opcode in opcodes)
                 and (scope is None or scope in n.op_name)),
                key=lambda n: n.name)


class _Graph:
  """Def-use edges of every computation, and who calls each computation."""

  def __init__(self, comps):
    self.comps = comps
    self.nodes: dict[tuple[str, str], Node] = {}
    self.users: dict[tuple[str, str], list[str]] = {}
    self.preds: dict[tuple[str, str], list[str]] = {}
    self.callers: dict[str, list[tuple[str, str]]] = {}
    self.calls: dict[tuple[str, str], list[str]] = {}
    self.root: dict[str, str] = {}
    self.params: dict[str, set[str]] = {}
    for comp, instrs in comps.items():
      names = {i.name for i in instrs}
      for ins in instrs:
        key = (comp, ins.name)
        self.nodes[key] = Node(ins.name, ins.opcode, comp,
                               hlo_text.op_name(ins))
        preds = [hlo_text.operand(x)[1] for x in ins.operands]
        preds += hlo_text.control_predecessors(ins)
        preds = [p for p in preds if p in names]
        self.preds[key] = preds
        for p in preds:
          self.users.setdefault((comp, p), []).append(ins.name)
        self.calls[key] = [c for c in hlo_text.called_computations(ins)
                           if c in comps]
        for c in self.calls[key]:
          self.callers.setdefault(c, []).append(key)
        if ins.opcode == 'parameter':
          self.params.setdefault(comp, set()).add(ins.name)
      if instrs:  # the root is the last instruction printed
        self.root[comp] = instrs[-1].name

  def contents(self, comp: str, seen: set[tuple[str, str]]) -> None:
    """Adds every instruction of ``comp`` and of what it calls."""
    for ins in self.comps[comp]:
      key = (comp, ins.name)
      if key not in seen:
        seen.add(key)
        for c in self.calls[key]:
          self.contents(c, seen)

  def reach(self, start: tuple[str, str], forward: bool
            ) -> set[tuple[str, str]]:
    """Instructions reached from ``start`` (itself excluded) along users
    (``forward``) or operands, leaving a computation through its root
    (forward) or its parameters (backward) to every caller."""
    seen: set[tuple[str, str]] = set()
    todo = [start]
    left: set[str] = set()  # computations already left through callers
    while todo:
      comp, name = todo.pop()
      nxt = (self.users.get((comp, name), []) if forward
             else self.preds[(comp, name)])
      for n in nxt:
        key = (comp, n)
        if key not in seen:
          seen.add(key)
          todo.append(key)
          for c in self.calls[key]:
            self.contents(c, seen)
      exits = (name == self.root.get(comp) if forward
               else name in self.params.get(comp, ()))
      if exits and comp not in left:
        left.add(comp)
        for caller in self.callers.get(comp, ()):
          if forward and caller not in seen:
            seen.add(caller)
            todo.append(caller)
          elif not forward:
            todo.append(caller)  # its operands feed this computation
          for c in self.calls[caller]:
            self.contents(c, seen)  # a loop's later iterations, branches
    seen.discard(start)
    return seen


def collective_dataflow(
    program: 'jax.stages.Compiled | jax.stages.Lowered | str',
    mesh: jax.sharding.Mesh | None = None,
    *,
    worker_axis: str = 'worker',
    cross_worker_only: bool = True,
) -> tuple[CollectiveDataflow, ...]:
  """The users and operands of every collective of a compiled program.

  Args:
    program: a ``jax.stages.Compiled``, a ``jax.stages.Lowered`` (compiled
      here) or optimized HLO text (``compiled.as_text()``).
    mesh: the program's mesh, to tell cross-worker collectives (see
      :func:`loc_opt.parallel.collective_bytes`); ``None``: one worker.
    worker_axis: the mesh axis that indexes workers.
    cross_worker_only: report only collectives that span two workers.

  Returns:
    One :class:`CollectiveDataflow` per collective, in program order.

  Raises:
    ValueError: as :func:`loc_opt.parallel.collective_bytes`.
  """
  if isinstance(program, jax.stages.Lowered):
    program = program.compile()
  report = hlo_lib.collective_bytes(program, mesh, worker_axis=worker_axis)
  text = (program.as_text() if isinstance(program, jax.stages.Compiled)
          else program)
  _, comps, _ = hlo_text.parse_module(text)
  graph = _Graph(comps)
  where = {name: (comp, name) for comp, name in graph.nodes}
  out = []
  for c in report.collectives:
    if cross_worker_only and not c.cross_worker:
      continue
    key = where[c.name]
    out.append(CollectiveDataflow(
        collective=c, node=graph.nodes[key],
        users=frozenset(graph.nodes[k] for k in graph.reach(key, True)),
        operands=frozenset(graph.nodes[k] for k in graph.reach(key, False))))
  return tuple(out)
