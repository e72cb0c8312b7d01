"""Reading a profiled XLA:CPU step: which op computes what, and how long.

The analysis behind ``experiments.profile_step`` (kept apart from its absl
flags so that tests can import it): :func:`shared_times` turns a trace's
op intervals into times that add up, :func:`categorize` sorts a compiled
module's ops into :data:`CATEGORIES` by the matmuls in them and by JAX's
named scopes.
"""

import collections
import re


# Rows of the table, in order: name -> what it holds.
CATEGORIES = {
    'dense matmuls': 'the linear layers, embedding and head: forward, '
                     'input and weight gradients',
    'attention matmuls': 'scores, softmax fused in, values; forward and '
                         'backward',
    'attention, other': 'RoPE, heads-major transposes, the mask',
    'RMSNorm': 'forward and backward, outside the matmuls',
    'GELU': 'forward and backward',
    'embedding, head, loss': 'one-hot, cross-entropy, outside the matmuls',
    'optimizer and guard': 'AdamW, clipping, the non-finite check and skip',
    'other': 'residual adds, weight-gradient transposes, copies',
}
_SCOPES = (('attention_core', 'attention, other'), ('rms_norm', 'RMSNorm'),
           ('gelu', 'GELU'), ('optimizer', 'optimizer and guard'),
           ('non_finite_guard', 'optimizer and guard'),
           ('embed', 'embedding, head, loss'),
           ('head', 'embedding, head, loss'),
           ('loss', 'embedding, head, loss'))
INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = (.*)$', re.M)
_COMPUTATION = re.compile(r'^(?:ENTRY )?%([\w.\-]+) [^\n]*\{\n(.*?)\n\}',
                          re.S | re.M)
_SHAPE = re.compile(r'^\(?[a-z]+\d*\[([\d,]*)\]')


def _dims(text: str) -> list[int]:
  return [int(x) for x in text.split(',') if x]


def _dot_flops(body: str, shapes: dict[str, list[int]]) -> int:
  """FLOPs of the dots in ``body`` (instructions' text; 2 per
  multiply-add), their operands' dimensions looked up in ``shapes``."""
  total = 0
  for m in INSTRUCTION.finditer(body):
    dot = re.match(r'\S+\[([\d,]*)\]\S* dot\(%([\w.\-]+), %[\w.\-]+\)(.*)',
                   m.group(2))
    if not dot:
      continue
    lhs = shapes.get(dot.group(2))
    contracting = re.search(r'lhs_contracting_dims=\{([\d,]*)\}',
                            dot.group(3))
    if lhs is None or contracting is None:
      raise ValueError(f'cannot read the shapes of dot {m.group(1)}')
    k = 1
    for i in _dims(contracting.group(1)):
      k *= lhs[i]
    n = 1
    for d in _dims(dot.group(1)):
      n *= d
    total += 2 * n * k
  return total


def _in_scope(scope: str, op_name: str) -> bool:
  """Whether JAX's name stack ``op_name`` passes through named scope
  ``scope`` (``.../jvp(scope)/...`` or ``.../scope/...``)."""
  return re.search(rf'(^|[/(]){re.escape(scope)}([/)]|$)', op_name) is not None


def categorize(hlo: str, op_ms: dict[str, float]) -> dict[str, dict]:
  """``{category: {'ms', 'gflop', 'ops'}}`` of the ops of compiled module
  text ``hlo``, given each op's time (``op_ms``: instruction name -> ms).

  Names in ``op_ms`` that are no instruction of ``hlo`` (the runtime's own
  events) are left out; see :data:`CATEGORIES` for the rows.
  """
  bodies = {m.group(1): m.group(2) for m in _COMPUTATION.finditer(hlo)}
  # Instruction names are unique in a module: every one's dimensions.
  shapes = {}
  for m in INSTRUCTION.finditer(hlo):
    shape = _SHAPE.match(m.group(2))
    if shape:
      shapes[m.group(1)] = _dims(shape.group(1))
  rows = {c: {'ms': 0.0, 'gflop': 0.0, 'ops': 0} for c in CATEGORIES}
  for m in INSTRUCTION.finditer(hlo):
    name, rest = m.group(1), m.group(2)
    if name not in op_ms:
      continue
    called = re.search(r'calls=%([\w.\-]+)', rest)
    body = (bodies.get(called.group(1), '') if called
            else f'%{name} = {rest}')
    flops = _dot_flops(body, shapes)
    op_name = re.search(r'op_name="([^"]*)"', rest)
    stack = op_name.group(1) if op_name else ''
    if flops:
      category = ('attention matmuls' if _in_scope('attention_core', stack)
                  else 'dense matmuls')
    else:
      category = next((c for s, c in _SCOPES if _in_scope(s, stack)),
                      'other')
    row = rows[category]
    row['ms'] += op_ms[name]
    row['gflop'] += flops / 1e9
    row['ops'] += 1
  return rows


def shared_times(intervals: list[tuple[int, int, str]]) -> dict[str, float]:
  """Nanoseconds of each name over ``(start_ns, end_ns, name)`` intervals,
  the time in which several overlap shared equally among them.

  On one core, ops that XLA runs at the same time on two threads take
  turns; their durations overlap and would count the same time twice.
  The shares add up to the time in which any op ran.
  """
  edges = sorted({t for start, end, _ in intervals for t in (start, end)})
  index = {t: i for i, t in enumerate(edges)}
  # Active names per elementary segment, by a sweep over the edges.
  starts, ends = collections.defaultdict(list), collections.defaultdict(list)
  for start, end, name in intervals:
    if end > start:
      starts[index[start]].append(name)
      ends[index[end]].append(name)
  active = collections.Counter()
  out = collections.Counter()
  for i, t in enumerate(edges[:-1]):
    for name in ends[i]:
      active[name] -= 1
    for name in starts[i]:
      active[name] += 1
    running = sum(active.values())
    if running:
      span = edges[i + 1] - t
      for name, count in active.items():
        if count:
          out[name] += span * count / running
  return dict(out)
