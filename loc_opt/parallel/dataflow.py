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
a reached fusion, loop or branch is reached, and a reached element of a
tuple reaches the whole tuple. It may report a dependence that is not
there, never miss one. Edges are operands and ``control-predecessors``;
a collective inside a branch or loop is followed out through the
conditional's or loop's result (and in through the operand that feeds
its branch, with the branch index).

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
    self._deep: dict[str, frozenset[tuple[str, str]]] = {}
    self.operands: dict[tuple[str, str], list[str]] = {}
    self.param_index: dict[tuple[str, str], int] = {}
    for comp, instrs in comps.items():
      names = {i.name for i in instrs}
      for ins in instrs:
        key = (comp, ins.name)
        self.nodes[key] = Node(ins.name, ins.opcode, comp,
                               hlo_text.op_name(ins))
        operands = [hlo_text.operand(x)[1] for x in ins.operands]
        self.operands[key] = operands
        if ins.opcode == 'parameter':
          self.param_index[key] = int(ins.operands[0])
        preds = operands + hlo_text.control_predecessors(ins)
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
    seen |= self.deep(comp)

  def deep(self, comp: str) -> frozenset[tuple[str, str]]:
    """The instructions of ``comp`` and of the computations it calls."""
    if comp not in self._deep:
      keys = set()
      for ins in self.comps[comp]:
        keys.add((comp, ins.name))
        for c in self.calls[(comp, ins.name)]:
          keys |= self.deep(c)
      self._deep[comp] = frozenset(keys)
    return self._deep[comp]

  def reach(self, start: tuple[str, str], forward: bool
            ) -> set[tuple[str, str]]:
    """Instructions reached from ``start`` (itself excluded) along users
    (``forward``) or operands, leaving a computation through its root
    (forward: the caller's result) or a parameter (backward: the caller's
    operand that feeds it; for a conditional branch, also the branch
    index). A ``while`` body or condition left either way brings in all
    of the loop (its other iterations)."""
    seen: set[tuple[str, str]] = set()
    todo = [start]
    while todo:
      comp, name = todo.pop()
      nxt = (self.users.get((comp, name), []) if forward
             else self.preds[(comp, name)])
      for n in nxt:
        self._add((comp, n), seen, todo)
      exits = (name == self.root.get(comp) if forward
               else name in self.params.get(comp, ()))
      if not exits:
        continue
      for caller in self.callers.get(comp, ()):
        parent = caller[0]
        opcode = self.nodes[caller].opcode
        if forward:
          self._add(caller, seen, todo)
        else:
          ops = self.operands[caller]
          k = self.param_index[(comp, name)]
          if opcode == 'conditional':
            picks = [0, self.calls[caller].index(comp) + 1]
          else:
            picks = [k] if k < len(ops) else range(len(ops))
          for i in picks:
            if i < len(ops):
              self._add((parent, ops[i]), seen, todo)
        if opcode == 'while':
          for c in self.calls[caller]:
            self.contents(c, seen)
    seen.discard(start)
    return seen

  def _add(self, key, seen, todo) -> None:
    """Marks ``key`` reached (with what it calls) and queues it."""
    if key in seen or key not in self.nodes:
      return
    seen.add(key)
    todo.append(key)
    for c in self.calls[key]:
      self.contents(c, seen)


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
  _, comps, collectives = hlo_lib.read_collectives(
      program, mesh, worker_axis, cross_worker_only)
  graph = _Graph(comps)
  where = {name: (comp, name) for comp, name in graph.nodes}
  out = []
  for c in collectives:
    key = where[c.name]
    out.append(CollectiveDataflow(
        collective=c, node=graph.nodes[key],
        users=frozenset(graph.nodes[k] for k in graph.reach(key, True)),
        operands=frozenset(graph.nodes[k] for k in graph.reach(key, False))))
  return tuple(out)
