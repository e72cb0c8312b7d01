"""Renderers of the small-model tables of docs/robust_aggregation.md,
docs/hierarchical.md and docs/moe.md.

``experiments.robust_aggregation`` (DiLoCo's sync bytes under each
aggregate, one adversarial worker) and ``experiments.hierarchical_bytes``
(the group-sync bytes per group codec, the bytes of each phase) write the
results files, as does ``experiments.moe_study`` (data-parallel vs
DiLoCo on a Mixture-of-Experts LM and a dense one); ``experiments.tables``
renders them with these.
"""

import math
from typing import Any

from experiments import _registry

_DTYPES = {'s8': 'int8', 'u8': 'uint8', 'f32': 'fp32', 'bf16': 'bf16'}


def _shapes(shapes: dict[str, list[int]]) -> str:
  return ', '.join(f'`{k}` {" x ".join(map(str, s))}'
                   for k, s in shapes.items())


def _b(n: float) -> str:
  return f'{n:,.0f} B'


def _dtype(shape: str) -> str:
  """``'s8[1,128]' -> 'int8'``; a tuple's first element's."""
  head = shape.lstrip('(').split('[')[0]
  return _DTYPES.get(head, head)


def _robust_note(row: dict[str, Any], kind: str, nbytes: float,
                 setup: dict[str, Any]) -> str:
  """What a collective of the bytes table carries, where the numbers say."""
  n, d = setup['num_params'], setup['devices_per_worker']
  if kind != 'all-gather':
    return ''
  if row['codec'] is not None:
    by_dtype: dict[str, float] = {}
    for c in row['collectives']:
      if c['kind'] == kind:
        key = _dtype(c['shape'])
        by_dtype[key] = by_dtype.get(key, 0) + c['bytes_per_worker']
    parts = sorted(by_dtype.items(), key=lambda kv: -kv[1])
    return ' (' + ' + '.join(f'{_b(v)} {k}' for k, v in parts) + ')'
  if row['aggregate'] in ('median', 'trimmed_mean'):
    floats = nbytes / 4
    note = f'{n + 1} floats: {n} values and the flag'
    if floats != n + 1:
      note += f', padded to {floats:g} for {d} devices'
    return f' ({note})'
  if row['aggregate'] == 'norm_clipped_mean' and nbytes == 8 * d:
    return f' (norm, flag; on each of the {d} devices)'
  return ''


def _robust_label(row: dict[str, Any]) -> str:
  if row['reduce_fn']:
    return f'`{row["aggregate"]}` (`reduce_fn={row["reduce_fn"]}`)'
  return f'`{row["aggregate"]}`'


def robust_bytes(data: dict[str, Any]) -> str:
  """Per aggregate: the cross-worker collectives of DiLoCo's compiled sync
  per worker, and their seconds on the link against the mean's. Rows with
  the same codec and collectives are merged."""
  res = data['results']['bytes']
  s = res['setup']
  lines = [
      f'{s["workers"]} workers x {s["devices_per_worker"]} data-parallel '
      f'devices, a {s["num_params"]}-parameter model ({_shapes(s["shapes"])})'
      "; DiLoCo's compiled sync step, SGD inside; unconditional "
      'cross-worker collectives, bytes per worker; seconds: one after '
      f'another on a {s["link_gbps"]:g} Gbit/s link without latency, and '
      "against the mean's.", '',
      '| aggregate | cross-worker collectives per worker | seconds on a '
      f'{s["link_gbps"]:g} Gbit/s link |', '|---|---|---|']
  base = res['rows'][0]['seconds']
  groups: list[list[dict[str, Any]]] = []
  for r in res['rows']:
    last = groups[-1][-1] if groups else None
    if last is not None and (last['codec'], last['kinds'], last['seconds'],
                             last['reduce_fn']) == (
                                 r['codec'], r['kinds'], r['seconds'],
                                 r['reduce_fn']):
      groups[-1].append(r)
    else:
      groups.append([r])
  for i, group in enumerate(groups):
    r = group[0]
    label = ', '.join(_robust_label(g) for g in group)
    if r['codec'] is not None:
      label += f", `codec='{r['codec']}'`"
    cells = ' + '.join(f'{k} {_b(v)}{_robust_note(r, k, v, s)}'
                       for k, v in r['kinds'].items()) or 'none'
    secs = f'{r["seconds"] * 1e6:.1f} us'
    if i and base:
      secs += f' ({r["seconds"] / base:.1f}x)'
    lines.append(f'| {label} | {cells} | {secs} |')
  return '\n'.join(lines) + '\n'


def _loss(x: float, start: float) -> str:
  if not math.isfinite(x):
    return 'not finite (diverged)'
  text = f'{x:.3f}' if abs(x) < 1e3 else f'{x:.1e}'.replace('e+', 'e')
  return text + (' (diverged)' if x > start else '')


def robust_adversary(data: dict[str, Any]) -> str:
  """Final anchor loss per run, and how much of the honest run's loss
  reduction each run gives up."""
  res = data['results']['adversary']
  s, start = res['setup'], res['start_loss']
  honest = next(r['final_loss'] for r in res['rows'] if not r['adversary'])
  lines = [
      f'{s["workers"]} workers, SGD inner (lr 0.1), H = {s["sync_every"]}, '
      f'outer Nesterov (0.7, 0.9), {s["steps"]} steps; worker '
      f'{s["adversary_worker"]} of the adversary runs multiplies its '
      f'gradients by {s["adversary_scale"]:g}. Anchor loss on held-out '
      f'batches, {start:.3f} at the start; last column: (loss - honest) / '
      '(start - honest).', '',
      '| run | final loss | share of the honest reduction lost |',
      '|---|---|---|']
  for r in res['rows']:
    loss = r['final_loss']
    if not r['adversary']:
      lost = '-'
    elif not math.isfinite(loss) or loss > start:
      lost = 'all'
    else:
      lost = f'{(loss - honest) / (start - honest):.1%}'
    lines.append(f'| {r["label"]} | {_loss(loss, start)} | {lost} |')
  return '\n'.join(lines) + '\n'


def hierarchical_codec(data: dict[str, Any]) -> str:
  """Per group codec: its payload and the group-sync program's cross-worker
  bytes per worker at each group size; below, whether every collective is a
  permute inside a group and the bytes are ``(G - 1)`` payloads."""
  res = data['results']['codec']
  s = res['setup']
  sizes = [str(g) for g in s['group_sizes']]
  shift = lambda g: f'{int(g) - 1} shift' + ('s' if int(g) > 2 else '')
  lines = [
      f'{s["workers"]} workers x {s["devices_per_worker"]} devices, a '
      f'{s["num_params"]:,}-parameter model ({_shapes(s["shapes"])}); the '
      'compiled group-sync program; bytes per worker.', '',
      '| group codec | payload per worker | '
      + ' | '.join(f'`G = {g}` ({shift(g)})' for g in sizes) + ' |',
      '|---|' + '---:|' * (len(sizes) + 1)]
  kinds, between, exact = set(), 0.0, True
  for r in res['rows']:
    cells = [_b(r['payload_bytes'])]
    for g in sizes:
      one = r['by_group_size'][g]
      cells.append(_b(one['cross_worker_bytes']))
      kinds |= set(one['kinds'])
      between += one['cross_group_bytes']
      exact &= one['cross_worker_bytes'] == (int(g) - 1) * r['payload_bytes']
    lines.append(f'| {r["label"]} | ' + ' | '.join(cells) + ' |')
  lines += ['', 'Kinds of cross-worker collective in these programs: '
            f'{", ".join(sorted(kinds))}; bytes joining two groups: '
            f'{_b(between)} in all. HLO bytes '
            + ('= (G - 1) x payload in every cell.' if exact else
               'differ from (G - 1) x payload in some cells.')]
  return '\n'.join(lines) + '\n'


def _joined(row: dict[str, Any]) -> str:
  """The worker sets each collective joins, ``'; '`` between collectives
  (repeats of the previous collective's sets left out)."""
  out: list[str] = []
  for c in row['collectives']:
    sets = ', '.join('{' + ','.join(map(str, w)) + '}'
                     for w in c['worker_groups'])
    if not out or out[-1] != sets:
      out.append(sets)
  return '; '.join(out) or '-'


def hierarchical_phases(data: dict[str, Any]) -> str:
  """Per phase: its cross-worker collectives, the workers they join and
  the bytes between groups, per worker."""
  res = data['results']['phases']
  s = res['setup']
  lines = [
      f'{s["workers"]} workers x {s["devices_per_worker"]} devices, groups '
      f'of {s["group_size"]}, a {s["num_params"]}-parameter model '
      f'({_shapes(s["shapes"])}); unconditional collectives, bytes per '
      'worker.', '',
      '| phase | cross-worker collectives | worker groups joined | bytes '
      'between groups |', '|---|---|---|---|']
  for r in res['rows']:
    kinds = ' + '.join(f'{k} {_b(v)}' for k, v in r['kinds'].items())
    between = _b(r['cross_group_bytes']) if r['cross_group_bytes'] else '0'
    lines.append(f'| {r["phase"]} | {kinds or "none"} | {_joined(r)} | '
                 f'{between} |')
  return '\n'.join(lines) + '\n'

def _moe_bytes(n: float) -> str:
  for unit, size in (('GB', 1e9), ('MB', 1e6), ('kB', 1e3)):
    if n >= size:
      return f'{n / size:.1f} {unit}'
  return f'{n:.0f} B'


# experiments.moe_study (docs/moe.md)
def moe_study_main(data: dict[str, Any]) -> str:
  """One row per run: parameters (total, active), final eval loss, bytes."""
  res = data['results']
  s = res['setup']
  tokens = s['num_steps'] * s['batch_size'] * s['seq_len']
  lines = [
      f'{s["num_steps"]} steps x {s["batch_size"]} x {s["seq_len"]} = '
      f'{tokens:,} tokens; DiLoCo {s["workers"]} workers x '
      f'{s["devices"] // s["workers"]} devices, H = {s["sync_every"]}, '
      f'outer Nesterov lr {s["outer_learning_rate"]:g}, momentum '
      f'{s["outer_momentum"]:g}; AdamW lr {s["learning_rate"]:g} for every '
      'run (not tuned); one seed.', '',
      '| run | params | active params | final eval loss '
      '| cross-worker bytes | syncs |',
      '|---|---|---|---|---|---|']
  for r in res['rows']:
    syncs = (f'{r["steps"]} all-reduces' if r['method'] == 'data_parallel'
             else str(r['syncs']))
    lines.append(
        f'| {r["label"]} | {r["num_params"]:,} | {r["active_params"]:,} '
        f'| {r["final_eval_loss"]:.4f} '
        f'| {_moe_bytes(r["cross_worker_bytes"])} '
        f'| {syncs} |')
  if res.get('pending'):
    lines += ['', f'Not run yet: {", ".join(res["pending"])}.']
  return '\n'.join(lines) + '\n'


# Where in a run (fractions of its steps) the routing table looks.
_ROUTING_AT = (0.05, 0.15, 0.25, 0.5, 0.75, 1.0)


def moe_study_routing(data: dict[str, Any]) -> str:
  """The MoE runs' routing diagnostics near the fractions
  :data:`_ROUTING_AT` of the run."""
  res = data['results']
  lines = ['| run | step | imbalance | dropped | router entropy (nats) '
           '| router drift |', '|---|---|---|---|---|---|']
  for r in res['rows']:
    curves = r.get('routing') or {}
    steps = sorted(int(k) for k in curves.get('routing/entropy', {}))
    if not steps:
      continue
    total = res['setup']['num_steps']
    picked = sorted({min(steps, key=lambda k: abs(k - f * total))
                     for f in _ROUTING_AT})
    for step in picked:
      get = lambda k: (curves.get(k) or {}).get(str(step),
                                                (curves.get(k) or {}).get(
                                                    step))
      drift = get('routing/router_drift')
      lines.append(
          f'| {r["label"]} | {step} | {get("routing/imbalance"):.3f} '
          f'| {get("routing/dropped"):.3f} '
          f'| {get("routing/entropy"):.3f} '
          f'| {"-" if drift is None else f"{drift:.4f}"} |')
  return '\n'.join(lines) + '\n'


_registry.tables({
    ('moe_study', 'main'): moe_study_main,
    ('moe_study', 'routing'): moe_study_routing,
    ('moe_study_router', 'main'): moe_study_main,
    ('moe_study_router', 'routing'): moe_study_routing,
    ('robust_aggregation', 'bytes'): robust_bytes,
    ('robust_aggregation', 'adversary'): robust_adversary,
    ('hierarchical_bytes', 'codec'): hierarchical_codec,
    ('hierarchical_bytes', 'phases'): hierarchical_phases,
})
