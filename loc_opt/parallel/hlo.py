"""Bytes moved by the collectives of a compiled XLA program.

`collective_bytes` reads the optimized HLO of a program, expands the replica
groups of every collective to logical device ids, places those on a mesh
whose outermost axis is `worker`, and classes each collective as
cross-worker (a group spans two workers: the slow inter-slice links that
DiLoCo-style methods economize) or within-worker. Example::

  report = collective_bytes(jax.jit(step).lower(params, batch), mesh)
  print(report.summary())

The HLO text itself is read by :mod:`loc_opt.parallel._hlo_text`; this
module walks the computations and does the byte accounting.

Reference: Douillard et al., "DiLoCo: Distributed Low-Communication Training
of Language Models", 2023 (https://arxiv.org/abs/2311.08105).
"""

from collections.abc import Mapping
import dataclasses
import re
from typing import NamedTuple

import jax
import numpy as np

from loc_opt.parallel import _hlo_text as hlo_text

_KINDS = frozenset({
  'all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all',
  'ragged-all-to-all', 'collective-permute', 'collective-broadcast',
})
# Collectives whose HLO carries a `use_global_device_ids` bool.
_GLOBAL_ID_KINDS = ('all-reduce', 'all-gather', 'reduce-scatter')


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of a program.

  Attributes:
    kind: collective kind without an async suffix, e.g. `'all-reduce'`.
    name: HLO instruction name (of the `-start` op for async collectives).
    shape: HLO type of the operand(s) one device contributes.
    bytes_per_device: bytes of that operand (see `collective_bytes`).
    devices: devices that contribute an operand.
    total_bytes: `bytes_per_device * devices`.
    cross_worker: whether a group (or permute pair) spans two workers.
    branch: `None` if executed unconditionally, else the path of
      `(conditional_name, branch_index)` pairs that leads to it.
    in_loop: whether it sits inside a `while` body or condition.
    trip_count: product of the enclosing loops' trip counts when XLA knows
      all of them, else `None` (also `None` outside loops).
    is_async: whether it runs asynchronously (`-start`/`-done`, or inside
      an `async-start`).
    worker_groups: the distinct sets of workers that its replica groups (or
      permute pairs) join, as sorted tuples of worker indices; `()` when
      it joins no two devices.
  """

  kind: str
  name: str
  shape: str
  bytes_per_device: int
  devices: int
  total_bytes: int
  cross_worker: bool
  branch: tuple[tuple[str, int], ...] | None = None
  in_loop: bool = False
  trip_count: int | None = None
  is_async: bool = False
  worker_groups: tuple[tuple[int, ...], ...] = ()

  def crosses_groups(self, group_size: int) -> bool:
    """Whether it joins workers of two groups of `group_size` consecutive
    workers (worker `w` is in group `w // group_size`)."""
    return any(len({w // group_size for w in g}) > 1
               for g in self.worker_groups)


@dataclasses.dataclass(frozen=True)
class CollectiveReport:
  """Collectives of a program, split into cross- and within-worker traffic.

  Attributes:
    collectives: every collective, in program order (depth first).
    num_workers: size of the worker axis (1 when no mesh was given).
    num_devices: devices the program runs on (replicas times partitions).
    conditionals: number of branches of each `conditional` instruction that
      holds a collective, keyed by instruction name.
  """

  collectives: tuple[Collective, ...]
  num_workers: int
  num_devices: int
  conditionals: Mapping[str, int] = dataclasses.field(default_factory=dict)

  def _sum(self, cross: bool | None, path=()) -> int:
    return sum(
      c.total_bytes
      for c in self.collectives
      if (c.branch or ()) == path and cross in (None, c.cross_worker)
    )

  @property
  def cross_worker_bytes(self) -> int:
    """Bytes of unconditional cross-worker collectives (loops counted once)."""
    return self._sum(True)

  @property
  def within_worker_bytes(self) -> int:
    """Bytes of unconditional within-worker collectives."""
    return self._sum(False)

  def cross_group_bytes(self, group_size: int) -> int:
    """Bytes of unconditional collectives that join two groups of
    `group_size` consecutive workers (the slow links of a hierarchy)."""
    return sum(c.total_bytes for c in self.collectives
               if c.branch is None and c.crosses_groups(group_size))

  @property
  def cross_worker_bytes_per_worker(self) -> float:
    """`cross_worker_bytes / num_workers`."""
    return self.cross_worker_bytes / self.num_workers

  def _branches(self, cross: bool) -> dict[str, tuple[int, ...]]:
    def total(name, i):
      return sum(
        c.total_bytes
        for c in self.collectives
        if c.cross_worker == cross and (name, i) in (c.branch or ())
      )

    return {
      name: tuple(total(name, i) for i in range(n))
      for name, n in self.conditionals.items()
    }

  @property
  def branches(self) -> dict[str, tuple[int, ...]]:
    """Cross-worker bytes of each branch (nested ones included), by name."""
    return self._branches(True)

  @property
  def within_worker_branches(self) -> dict[str, tuple[int, ...]]:
    """Within-worker bytes of each branch (nested ones included), by name."""
    return self._branches(False)

  def _span(self, cross: bool, path=()) -> tuple[int, int]:
    lo = hi = self._sum(cross, path)
    k = len(path)
    children = sorted({
      c.branch[k][0] for c in self.collectives
      if c.branch and len(c.branch) > k and c.branch[:k] == path
    })
    for name in children:
      spans = [
        self._span(cross, path + ((name, i),))
        for i in range(self.conditionals[name])
      ]
      lo += min(s[0] for s in spans)
      hi += max(s[1] for s in spans)
    return lo, hi

  @property
  def cross_worker_bytes_range(self) -> tuple[int, int]:
    """Least and most cross-worker bytes over all choices of branches.

    Unconditional bytes plus, for each conditional, its cheapest (resp.
    dearest) branch, recursing into nested conditionals.
    """
    return self._span(True)

  @property
  def within_worker_bytes_range(self) -> tuple[int, int]:
    """As `cross_worker_bytes_range`, for within-worker bytes."""
    return self._span(False)

  def by_kind(self, cross_worker: bool | None = None) -> dict[str, int]:
    """Unconditional bytes per collective kind, e.g. `{'all-reduce': 512}`.

    Args:
      cross_worker: keep only cross-worker (`True`) or within-worker
        (`False`) collectives; `None` keeps both.
    """
    out: dict[str, int] = {}
    for c in self.collectives:
      if c.branch is None and cross_worker in (None, c.cross_worker):
        out[c.kind] = out.get(c.kind, 0) + c.total_bytes
    return out

  def summary(self) -> str:
    """A readable table of the collectives and the totals."""
    rows = [('kind', 'name', 'shape', 'bytes/dev', 'devs', 'total', 'where')]
    for c in self.collectives:
      where = ['cross' if c.cross_worker else 'within']
      if c.branch:
        where.append('/'.join(f'{n}[{i}]' for n, i in c.branch))
      if c.in_loop:
        where.append(f'loop x{c.trip_count}' if c.trip_count else 'loop')
      kind = c.kind + (' (async)' if c.is_async else '')
      nums = (c.bytes_per_device, c.devices, c.total_bytes)
      rows.append((kind, c.name[:28], c.shape[:28], *map(str, nums),
                   ' '.join(where)))
    widths = [max(map(len, col)) for col in zip(*rows)]
    lines = [
      '  '.join(f.ljust(w) for f, w in zip(r, widths)).rstrip() for r in rows
    ]
    lines.insert(1, '-' * len(lines[0]))
    lo, hi = self.cross_worker_bytes_range
    lines.append(
      f'cross-worker bytes:  {self.cross_worker_bytes} (range {lo}..{hi}; '
      f'{self.cross_worker_bytes_per_worker:g} per worker of '
      f'{self.num_workers})'
    )
    lines.append(f'within-worker bytes: {self.within_worker_bytes}')
    return '\n'.join(lines)


def collective_bytes(
  program: 'jax.stages.Compiled | jax.stages.Lowered | str',
  mesh: jax.sharding.Mesh | None = None,
  *,
  worker_axis: str = 'worker',
) -> CollectiveReport:
  """Bytes moved by every collective of a compiled program.

  Per collective, `bytes_per_device` is the operand one device contributes:
  all-reduce, the operand (= result); all-gather, the operand (= result /
  group size); reduce-scatter, the operand (= result * group size);
  all-to-all and collective-permute, the operand (ragged-all-to-all: its
  input buffer, an upper bound). Then `total_bytes = bytes_per_device *
  devices`, where `devices` counts the contributing devices (for a
  collective-permute, the source-target pairs; singleton groups move nothing
  and are not counted). Tuple (combined) collectives sum their operands;
  sub-byte types are packed per array (`s4[3]` is 2 bytes); dynamic
  dimensions count at their bound. Operand types come from the operands'
  definitions, else from the result type.

  A collective is cross-worker when one of its groups, or a permute pair,
  holds devices with different coordinates along `worker_axis`. Group ids
  are logical device ids (`replica * num_partitions + partition`, following
  XLA's group modes), which for `jax.jit` over a mesh index
  `mesh.devices.flat`; for a `Compiled` (or `Lowered`) program the device
  order of the executable is used when it covers all devices.

  Control flow: collectives in `conditional` branches carry their branch
  path and are left out of the unconditional totals (see `branches` and
  `cross_worker_bytes_range`); for a predicate-form conditional branch 0 is
  `true_computation` (for `lax.cond`, branch 1 is the true function).
  Collectives in `while` loops are flagged `in_loop` and counted once; XLA's
  known trip counts are recorded in `trip_count`, never multiplied in.

  Args:
    program: a `jax.stages.Compiled`, a `jax.stages.Lowered` (compiled
      here), or optimized HLO text (`compiled.as_text()`).
    mesh: the mesh the program was built for. `None` treats all devices as
      one worker, so every collective is within-worker.
    worker_axis: name of the mesh axis that indexes workers.

  Returns:
    A `CollectiveReport`.

  Raises:
    ValueError: if the text is not HLO, a collective cannot be parsed, or
      the mesh does not match the program.

  Example::

    report = collective_bytes(jax.jit(f).lower(x).compile(), mesh)
    report.cross_worker_bytes, report.branches
  """
  text, order = read_program(program)
  return report_of(hlo_text.parse_module(text), mesh, worker_axis, order)


def read_program(program) -> tuple[str, list[int] | None]:
  """``(optimized HLO text, device order or None)`` of a program given as
  in :func:`collective_bytes`."""
  order = None
  if isinstance(program, jax.stages.Lowered):
    program = program.compile()
  if isinstance(program, jax.stages.Compiled):
    try:
      order = [d.id for d in program.runtime_executable().local_devices()]
    except Exception:  # noqa: BLE001 (the order is an optional refinement)
      order = None
    program = program.as_text()
  if not isinstance(program, str):
    raise TypeError(
      'program must be a jax.stages.Compiled, jax.stages.Lowered or str, '
      f'got {type(program).__name__}'
    )
  return program, order


def read_collectives(program, mesh, worker_axis: str,
                     cross_worker_only: bool):
  """``(HLO text, {computation: [Instr]}, collectives)`` of a program given
  as in :func:`collective_bytes`: its collectives in program order, only
  those that span two workers with ``cross_worker_only`` (the common start
  of ``collective_dataflow`` and ``collective_schedule``)."""
  text, order = read_program(program)
  parsed = hlo_text.parse_module(text)
  report = report_of(parsed, mesh, worker_axis, order)
  return text, parsed[1], [c for c in report.collectives
                           if c.cross_worker or not cross_worker_only]


def report_of(parsed, mesh, worker_axis, order) -> CollectiveReport:
  """The :class:`CollectiveReport` of ``hlo_text.parse_module``'s output."""
  header, comps, entry = parsed
  replicas = int(hlo_text.attr(header, 'replica_count') or 1)
  partitions = int(hlo_text.attr(header, 'num_partitions') or 1)
  n = replicas * partitions
  walker = _Walker(comps, replicas, partitions,
                   _worker_of(mesh, worker_axis, n, order))
  walker.walk(entry, _Ctx())
  used = {name for c in walker.out for name, _ in c.branch or ()}
  conds = {k: v for k, v in walker.conds.items() if k in used}
  num_workers = 1 if mesh is None else int(mesh.shape[worker_axis])
  return CollectiveReport(tuple(walker.out), num_workers, n, conds)


def _worker_of(mesh, axis, n, order) -> np.ndarray:
  """Worker index of each logical device id."""
  if mesh is None:
    return np.zeros(n, dtype=np.int64)
  if axis not in mesh.axis_names:
    raise ValueError(f'mesh axes {mesh.axis_names} have no {axis!r} axis')
  if mesh.size != n:
    raise ValueError(f'the program runs on {n} devices but the mesh has '
                     f'{mesh.size}')
  flat = [d.id for d in mesh.devices.flat]
  pos = np.arange(n)
  if order is not None and sorted(order) == sorted(flat):
    where = {d: i for i, d in enumerate(flat)}
    pos = np.array([where[d] for d in order])
  coords = np.unravel_index(pos, mesh.devices.shape)
  return np.asarray(coords[mesh.axis_names.index(axis)])


# ------------------------------------------------------------------ walking


class _Ctx(NamedTuple):
  branch: tuple[tuple[str, int], ...] = ()
  in_loop: bool = False
  trips: int | None = None
  is_async: bool = False


class _Walker:
  """Walks computations from ENTRY, collecting `Collective` records."""

  def __init__(self, comps, replicas, partitions, worker):
    self.comps, self.worker = comps, worker
    self.r, self.p = replicas, partitions
    self.types = {c: {i.name: i.type for i in v} for c, v in comps.items()}
    self.out: list[Collective] = []
    self.conds: dict[str, int] = {}

  def walk(self, comp: str, ctx: _Ctx, depth: int = 0):
    if comp not in self.comps:
      raise ValueError(f'HLO calls unknown computation {comp!r}')
    if depth > 64:
      raise ValueError('HLO call graph is too deep (recursive?)')
    for ins in self.comps[comp]:
      op, attrs = ins.opcode, ins.attrs
      if op.removesuffix('-start') in _KINDS:
        self.out.append(self.record(comp, ins, ctx))
      if op.endswith(('-done', '-update')):
        continue  # the matching -start was counted: never count twice
      if op == 'while':
        n = hlo_text.known_trip_count(ins.raw)
        known = n is not None and (ctx.trips or not ctx.in_loop)
        trips = n * (ctx.trips or 1) if known else None
        for key in ('condition', 'body'):
          sub = ctx._replace(in_loop=True, trips=trips)
          self.walk(hlo_text.called_name(hlo_text.attr(attrs, key)), sub,
                    depth + 1)
      elif op == 'conditional':
        names = hlo_text.attr(attrs, 'branch_computations')
        names = hlo_text.split_top(names[1:-1]) if names else [
          hlo_text.attr(attrs, 'true_computation'),
          hlo_text.attr(attrs, 'false_computation'),
        ]
        self.conds[ins.name] = len(names)
        for i, b in enumerate(names):
          sub = ctx._replace(branch=ctx.branch + ((ins.name, i),))
          self.walk(hlo_text.called_name(b), sub, depth + 1)
      else:  # call, fusion, async-start, custom-call, ...
        sub = ctx._replace(is_async=ctx.is_async or op == 'async-start')
        keys = ['calls', 'called_computations'] + ['to_apply'] * (op == 'call')
        for v in filter(None, (hlo_text.attr(attrs, k) for k in keys)):
          for c in hlo_text.split_top(v[1:-1]) if v[0] == '{' else [v]:
            self.walk(hlo_text.called_name(c), sub, depth + 1)

  def record(self, comp: str, ins: hlo_text.Instr, ctx: _Ctx) -> Collective:
    kind, attrs = ins.opcode.removesuffix('-start'), ins.attrs
    channel = hlo_text.attr(attrs, 'channel_id') is not None
    r, p = self.r, self.p
    if kind == 'collective-permute':
      pairs = hlo_text.ids(
        hlo_text.attr(attrs, 'source_target_pairs') or '{}',
        f'source_target_pairs of {ins.name}')
      # Partition pairs repeat in each replica (cross-replica: vice versa).
      groups = [
        [x * p + s, x * p + t] if channel else [s * p + x, t * p + x]
        for x in range(r if channel else p)
        for s, t in pairs
        if s != t
      ]
    else:
      ids = hlo_text.replica_groups(
        hlo_text.attr(attrs, 'replica_groups') or '{}', ins.name)
      global_ids = hlo_text.attr(attrs, 'use_global_device_ids') == 'true'
      groups = self.expand(ids, kind, channel, global_ids)
      groups = [g for g in groups if len(g) > 1]
    flat = [d for g in groups for d in g]
    if flat and (min(flat) < 0 or max(flat) >= len(self.worker)):
      raise ValueError(f'{ins.name} names device {max(flat)} but the program '
                       f'runs on {len(self.worker)} devices')
    joined = {tuple(sorted({int(self.worker[d]) for d in g}))
              for g in groups}
    cross = any(len(g) > 1 for g in joined)
    devices = len(groups) if kind == 'collective-permute' else len(flat)
    size = len(groups[0]) if groups else 1
    shape, nbytes = self.operand_bytes(comp, ins, kind, size)
    return Collective(
      kind=kind, name=ins.name, shape=shape, bytes_per_device=nbytes,
      devices=devices, total_bytes=nbytes * devices, cross_worker=cross,
      branch=ctx.branch or None, in_loop=ctx.in_loop,
      trip_count=ctx.trips if ctx.in_loop else None,
      is_async=ctx.is_async or ins.opcode.endswith('-start'),
      worker_groups=tuple(sorted(g for g in joined if len(g) > 1)),
    )

  def expand(self, ids, kind, channel, global_ids) -> list[list[int]]:
    """Groups of logical device ids, following XLA's collective group modes."""
    r, p = self.r, self.p
    if channel and global_ids:  # flattened ids
      return ids if ids is not None else [list(range(r * p))]
    if not channel:  # cross-replica: groups of replicas, per partition
      ids = ids if ids is not None else [list(range(r))]
      return [[q * p + x for q in g] for x in range(p) for g in ids]
    if kind in _GLOBAL_ID_KINDS:  # cross-replica-and-partition
      ids = ids if ids is not None else [list(range(r))]
      return [[q * p + x for q in g for x in range(p)] for g in ids]
    ids = ids if ids is not None else [list(range(p))]  # cross-partition
    return [[x * p + q for q in g] for x in range(r) for g in ids]

  def operand_bytes(self, comp, ins, kind, size) -> tuple[str, int]:
    """Operand type (layouts dropped) and bytes one device contributes."""
    one = kind in ('collective-permute', 'ragged-all-to-all')
    types = []
    for item in ins.operands[:1] if one else ins.operands:
      inline, name = hlo_text.operand(item)
      t = inline or self.types[comp].get(name)
      if not t:
        break
      types.append(hlo_text.strip_layout(t))
    else:
      if types:
        shape = types[0] if len(types) == 1 else f'({", ".join(types)})'
        return shape, hlo_text.array_bytes(shape)
    # An operand is unknown: derive from the result type.
    result = hlo_text.strip_layout(ins.type)
    if kind != 'all-reduce' and ins.opcode.endswith('-start'):
      # An async start returns (operand(s), result(s), ...).
      if result[0] == '(':
        result = hlo_text.split_top(result[1:-1])[0]
      return result, hlo_text.array_bytes(result)
    nbytes = hlo_text.array_bytes(result)
    if kind == 'all-gather':
      return result, nbytes // size
    return result, nbytes * (size if kind == 'reduce-scatter' else 1)


# XLA's memory space of host memory (``memory_kind='pinned_host'``), as
# printed in a layout: ``f32[4]{0:S(5)}``.
_HOST_SPACE = re.compile(r':[^{}]*S\(5\)')


def host_arguments(
  program: 'jax.stages.Compiled | str',
) -> dict[int, tuple[str, ...]]:
  """The entry parameters a compiled program takes in host memory, and the
  opcodes of the instructions of the entry computation that read each.

  A parameter is in host memory when its layout in the module's
  ``entry_computation_layout`` carries memory space 5 (``S(5)``:
  ``jax.NamedSharding(..., memory_kind='pinned_host')``). A donated
  parameter whose only reader is the root ``tuple`` is passed through
  untouched (aliased to its output: no transfer, no compute); without
  donation XLA copies it to a new output buffer (a ``copy``).

  Args:
    program: a compiled program or its optimized HLO text.

  Returns:
    ``{parameter number: (opcode of each reader, ...)}``.

  Example::

    users = host_arguments(jax.jit(step, in_shardings=...).lower(...)
                           .compile())
    untouched = all(u == ('tuple',) for u in users.values())
  """
  text = program if isinstance(program, str) else program.as_text()
  header, comps, entry = hlo_text.parse_module(text)
  key = 'entry_computation_layout={'
  if key not in header:
    raise ValueError('HLO module header has no entry_computation_layout')
  start = header.index(key) + len(key)  # at the '(' of the arguments
  args = hlo_text.split_top(
      header[start + 1:hlo_text._balanced(header, start) - 1])
  host = {i for i, a in enumerate(args) if _HOST_SPACE.search(a)}
  instrs = comps[entry]
  names = {int(x.operands[0]): x.name for x in instrs
           if x.opcode == 'parameter'}
  readers = {}
  for i in sorted(host):
    readers[i] = tuple(x.opcode for x in instrs if names[i] in
                       (hlo_text.operand(o)[1] for o in x.operands))
  return readers
