"""Reading optimized HLO text: computations, instructions, replica groups.

The parsing half of :mod:`loc_opt.parallel.hlo`: it turns the text of
``compiled.as_text()`` into computations of instructions, reads attributes
(replica groups in their list, iota and mesh forms; source-target pairs;
called computations) and sizes HLO types in bytes. It knows nothing of
meshes or workers.
"""

import math
import re
from typing import NamedTuple

import numpy as np

_BITS = {
  'pred': 8, 's1': 1, 'u1': 1, 's2': 2, 'u2': 2, 's4': 4, 'u4': 4,
  's8': 8, 'u8': 8, 's16': 16, 'u16': 16, 'f16': 16, 'bf16': 16,
  's32': 32, 'u32': 32, 'f32': 32, 's64': 64, 'u64': 64, 'f64': 64,
  'c64': 64, 'c128': 128, 'token': 0,
}
_OPEN, _CLOSE = '([{', ')]}'
_ARRAY = re.compile(r'([a-z][a-z0-9]*)\[([^\]]*)\]')
_LAYOUT = re.compile(r'\{[^{}]*\}')
_IOTA = re.compile(r'\[([\d,]*)\]<=\[([\d,]*)\](?:T\(([\d,]*)\))?')
_MESH = re.compile(
  r"mesh\[([^\]]*)\](?:,\s*device_ids=\(((?:[^()]|\([^()]*\))*)\))?"
  r'\s*\{([^{}]*)\}'
)
_COMP = re.compile(r'^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{$')
_INSTR = re.compile(r'^(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$')
_OPERAND = re.compile(r'(.*?)\s*%?([\w.\-]+)')
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def _balanced(s: str, i: int) -> int:
  """Index just past the bracket group opening at `s[i]`."""
  depth = 0
  for j in range(i, len(s)):
    depth += (s[j] in _OPEN) - (s[j] in _CLOSE)
    if depth == 0:
      return j + 1
  raise ValueError(f'unbalanced brackets in HLO: {s[i : i + 80]!r}')


def split_top(s: str) -> list[str]:
  """Splits `s` at commas outside brackets."""
  items, depth, start = [], 0, 0
  for j, ch in enumerate(s + ','):
    depth += (ch in _OPEN) - (ch in _CLOSE)
    if ch == ',' and depth == 0:
      items.append(s[start:j].strip())
      start = j + 1
  return [x for x in items if x]


def attr(attrs: str, key: str) -> str | None:
  """Value of `key=` in an attribute string."""
  m = re.search(rf'(?:^|[\s,]){key}=', attrs)
  if m is None:
    return None
  i = m.end()
  m = _MESH.match(attrs, i) or _IOTA.match(attrs, i)
  if m:  # replica groups: mesh[...] {...} or [a,b]<=[c]T(...)
    return m.group()
  if attrs[i : i + 1] in tuple(_OPEN):
    return attrs[i : _balanced(attrs, i)]
  return re.match(r'[^\s,]*', attrs[i:]).group()


class Instr(NamedTuple):
  """One instruction, `name = type opcode(operands), attributes`."""

  name: str
  type: str
  opcode: str
  operands: list[str]
  attrs: str  # attributes with quoted strings blanked out
  raw: str  # attributes as printed


def parse_module(text: str):
  """Returns (header line, {computation: [Instr]}, entry name)."""
  lines = [ln.strip() for ln in re.sub(r'/\*.*?\*/', '', text).splitlines()]
  header = next((ln for ln in lines if ln.startswith('HloModule ')), None)
  if header is None:
    hint = ''
    if 'stablehlo' in text or text.lstrip().startswith('module'):
      hint = ' (this looks like StableHLO: pass the compiled program)'
    raise ValueError(f"not HLO text: no 'HloModule' header line{hint}; "
                     f'it starts {text.strip()[:60]!r}')
  comps: dict[str, list[Instr]] = {}
  entry, current = None, None
  for ln in lines:
    if current is None:
      if m := _COMP.match(ln):
        current = comps.setdefault(m.group(2), [])
        entry = m.group(2) if m.group(1) else entry
    elif ln == '}':
      current = None
    elif m := _INSTR.match(ln):
      current.append(_parse_instr(m.group(1), m.group(2)))
  if entry is None:
    raise ValueError('HLO text has no ENTRY computation')
  return header, comps, entry


def _parse_instr(name: str, rest: str) -> Instr:
  end = _balanced(rest, 0) if rest.startswith('(') else rest.find(' ')
  type_, rest = rest[:end], rest[end:].strip()
  m = re.match(r'([\w\-]+)\(', rest)
  if m is None:
    return Instr(name, type_, '', [], '', rest)
  close = _balanced(rest, m.end() - 1)
  raw = rest[close:]
  attrs = re.sub(r'"(?:[^"\\]|\\.)*"', '""', raw)
  operands = split_top(rest[m.end() : close - 1])
  return Instr(name, type_, m.group(1), operands, attrs, raw)


def array_bytes(type_: str) -> int:
  """Bytes of all arrays in an HLO type string (tuples flattened)."""
  total = 0
  for dtype, dims in _ARRAY.findall(type_):
    bits = _BITS.get(dtype)
    if bits is None and re.fullmatch(r'f[48]e\w+', dtype):
      bits = int(dtype[1])  # f8e4m3fn, f8e5m2, f4e2m1fn, ...
    if bits is None:
      raise ValueError(f'unknown HLO element type {dtype!r} in {type_!r}')
    sizes = [int(d.lstrip('<=')) for d in dims.split(',') if d.strip()]
    total += -(-math.prod(sizes) * bits // 8)
  return total


def _ints(s: str | None) -> list[int]:
  return [int(x) for x in s.split(',') if x.strip()] if s else []


def ids(spec: str, what: str) -> list[list[int]]:
  """Parses `{{0,1},{2,3}}` into [[0, 1], [2, 3]]."""
  inner = spec.strip()[1:-1]
  if re.sub(r'\{[\d,\s]*\}|[,\s]', '', inner):
    raise ValueError(f'cannot parse {what}={spec!r}')
  return [_ints(g) for g in re.findall(r'\{([^{}]*)\}', inner)]


def _iota(dims, reshape, perm) -> np.ndarray:
  ids = np.arange(math.prod(reshape)).reshape(reshape)
  return (ids.transpose(perm) if perm else ids).reshape(dims)


def replica_groups(spec: str, name: str) -> list[list[int]] | None:
  """Groups of ids, or `None` for `{}` (all devices)."""
  if m := _IOTA.fullmatch(spec):  # [groups,size]<=[reshape]T(perm)
    return _iota(*(_ints(g) for g in m.groups())).tolist()
  if spec.startswith('mesh['):
    return _mesh_groups(spec, name)
  if spec.startswith('{'):
    return ids(spec, f'replica_groups of {name}') or None
  raise ValueError(f'cannot parse replica_groups={spec!r} of {name}')


def _mesh_groups(spec: str, name: str) -> list[list[int]]:
  """Expands `mesh['a'=4,'b'=2](, device_ids=(...))? {'a','b':(1)2}`."""
  m = _MESH.fullmatch(spec)
  if m is None:
    raise ValueError(f'cannot parse replica_groups={spec!r} of {name}')
  axes = re.findall(r"'?([^',=\s]+)'?\s*=\s*(\d+)", m.group(1))
  names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
  ids = m.group(2)
  if ids is None:  # the mesh holds ids 0..n-1 in order
    assignment = np.arange(math.prod(sizes))
  elif t := re.fullmatch(r'\s*\[([\d,]*)\](?:T\(([\d,]*)\))?\s*', ids):
    assignment = _iota(sizes, _ints(t.group(1)), _ints(t.group(2)))
  else:
    assignment = np.array(_ints(ids))
  # A device's key is its mesh position with the grouped parts zeroed.
  keys = np.indices(sizes).reshape(len(sizes), -1).T.copy()
  for ref in split_top(m.group(3)):
    r = re.fullmatch(r"'?([^':]+)'?(?::\((\d+)\)(\d+))?", ref)
    if r is None or r.group(1) not in names:
      raise ValueError(f'unknown mesh axis {ref} in {spec!r} of {name}')
    i = names.index(r.group(1))
    if r.group(2):  # sub-axis (pre)size: axis i viewed as [pre, size, rest]
      pre, size = int(r.group(2)), int(r.group(3))
      rest = sizes[i] // (pre * size)
      keys[:, i] -= (keys[:, i] // rest) % size * rest
    else:
      keys[:, i] = 0
  groups: dict[tuple, list[int]] = {}
  for key, dev in zip(map(tuple, keys), assignment.reshape(-1)):
    groups.setdefault(key, []).append(int(dev))
  return list(groups.values())


def called_name(ref: str | None) -> str:
  """The computation an attribute such as `to_apply=%add` names."""
  if not ref:
    raise ValueError('HLO instruction lacks a called computation')
  return ref.strip().lstrip('%')


def strip_layout(type_: str) -> str:
  """An HLO type without its layouts (`f32[4]{0}` -> `f32[4]`)."""
  return _LAYOUT.sub('', type_)


def operand(item: str) -> tuple[str, str]:
  """`(inline type or '', name)` of an operand such as `f32[4]{0} %p`."""
  m = _OPERAND.fullmatch(item)
  return (m.group(1), m.group(2)) if m else ('', '')


def known_trip_count(raw: str) -> int | None:
  """The trip count XLA recorded in a `while`'s backend config, if any."""
  m = _TRIP_COUNT.search(raw)
  return int(m.group(1)) if m else None


# Attributes that name the computations an instruction runs.
_CALL_KEYS = ('calls', 'called_computations', 'to_apply', 'body',
              'condition', 'branch_computations', 'true_computation',
              'false_computation')
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')


def called_computations(ins: Instr) -> list[str]:
  """Names of the computations `ins` runs (fusion, call, while body and
  condition, conditional branches, async and reduction computations)."""
  out = []
  for key in _CALL_KEYS:
    if f'{key}=' not in ins.attrs:
      continue
    value = attr(ins.attrs, key)
    if not value:
      continue
    refs = split_top(value[1:-1]) if value[0] == '{' else [value]
    out.extend(called_name(r) for r in refs)
  return out


def control_predecessors(ins: Instr) -> list[str]:
  """Names in `ins`'s `control-predecessors={...}` (must run before it)."""
  if 'control-predecessors=' not in ins.attrs:
    return []
  value = attr(ins.attrs, 'control-predecessors')
  if not value or value[0] != '{':
    return []
  return [operand(x)[1] for x in split_top(value[1:-1])]


def op_name(ins: Instr) -> str:
  """The `op_name` of `ins`'s metadata (JAX's name stack), or `''`."""
  m = _OP_NAME.search(ins.raw)
  return m.group(1) if m else ''
