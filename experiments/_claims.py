"""The claims studies' grid, logic and tables, without flags.

The DiLoCo M = 1 / M = 4 study (:mod:`experiments.claims`) and QSR against a
constant sync period (:mod:`experiments.qsr`) define absl flags, so this
module holds what the tests and :mod:`experiments.tables` import: the
sizes and methods, run names, rows imported from another machine, QSR's
sync-count match, and the table renderers (registered in
:data:`experiments._registry.RENDERERS`).
"""

import json
import os
import re
from typing import Any

from experiments import _registry
from experiments import _runs

# label -> model fields
SIZES = {
    # ~0.2M: the smallest size, affordable at 20 tokens per parameter on a
    # 2-core CPU (1,000 steps of 32 x 128 tokens).
    '0.2M': {'num_layers': 2, 'd_model': 80, 'd_ff': 320, 'num_heads': 4},
    '0.5M': {'num_layers': 2, 'd_model': 128, 'd_ff': 512, 'num_heads': 4},
    '2M': {'num_layers': 4, 'd_model': 192, 'd_ff': 768, 'num_heads': 4},
    '8M': {'num_layers': 6, 'd_model': 320, 'd_ff': 1280, 'num_heads': 5},
}


def size_fields(size: str | None) -> dict[str, Any]:
  """``{'model__<field>': value}`` of a :data:`SIZES` size, for
  ``_runs.variant`` (none for ``None``: the config's model)."""
  return {f'model__{k}': v for k, v in SIZES.get(size, {}).items()}


# method -> (label, mesh workers, overrides)
METHODS = {
    'dp': ('data-parallel', 1, {'outer__method': 'data_parallel'}),
    'diloco_m1': ('DiLoCo M=1', 1, {'outer__method': 'diloco'}),
    'diloco_m2': ('DiLoCo M=2', 2, {'outer__method': 'diloco'}),
    'diloco_m4': ('DiLoCo M=4', 4, {'outer__method': 'diloco'}),
}


def run_name(size, method, knob, seed, inner=None, momentum=None):
  """The run directory's name; ``inner`` is DiLoCo's inner learning rate
  and ``momentum`` its outer momentum where not the config's (runs at the
  config's keep the short name)."""
  tail = '' if inner is None else f'_i{inner:g}'
  tail += '' if momentum is None else f'_m{momentum:g}'
  return f'{size}_{method}_{knob:g}_s{seed}{tail}'


def import_rows(paths) -> list[dict]:
  """The rows of other runs' ``claims.json`` files (their runs' provenance
  joins this file's); a run in several files counts once."""
  rows = []
  for path in paths:
    try:
      with open(path) as f:
        data = json.load(f)
      got = data['results']['rows']
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ValueError(f'{path} is not a claims.json results file '
                       f'({e!r})') from e
    unknown = {r.get('size') for r in got} - set(SIZES)
    if unknown:
      raise ValueError(f'{path} has sizes {unknown} this study does not '
                       'know')
    seen = {r['name'] for r in rows}
    kinds = {os.path.basename(str(r.get('workdir'))):
             r['provenance'].get('device', {}).get('device_kind')
             for r in data.get('runs', [])}
    for r in got:  # rows written before rows named their device
      if 'device' not in r and kinds.get(r['name']):
        r['device'] = kinds[r['name']]
    rows += [r for r in got if r['name'] not in seen]
    known = {(r['label'], r.get('workdir')) for r in _runs.RUNS}
    _runs.RUNS.extend(r for r in data.get('runs', [])
                      if (r['label'], r.get('workdir')) not in known)
  return rows


def count_syncs(config) -> int:
  """Syncs of a run of ``config``: rounds of its sync schedule."""
  from loc_opt.train import config as cfg_lib  # pylint: disable=g-import-not-at-top
  schedule = cfg_lib.make_sync_every(config)
  t, n = 0, 0
  while t < config.num_steps:
    t += max(int(schedule(t)), 1)
    n += 1
  return n


def qsr_config(base, alpha: float):
  return _runs.variant(base, outer__sync_schedule='qsr',
                       outer__sync_schedule_kwargs={'alpha': alpha})


def qsr_alpha_for(base, syncs: int) -> float:
  """The smallest QSR ``alpha`` (to 1e-6 relative) with at most ``syncs``
  syncs over ``base``'s run; raises if no alpha gives exactly ``syncs``."""
  fewest = count_syncs(qsr_config(base, 1e6))  # every round to the end
  if fewest > syncs:
    raise ValueError(f'QSR makes at least {fewest} syncs over this run '
                     f'(H_base rounds in the warmup), not {syncs}')
  lo, hi = 0.0, 1e-3
  while count_syncs(qsr_config(base, hi)) > syncs:
    hi *= 2
  while hi - lo > 1e-6 * hi:
    mid = (lo + hi) / 2
    if count_syncs(qsr_config(base, mid)) > syncs:
      lo = mid
    else:
      hi = mid
  got = count_syncs(qsr_config(base, hi))
  if got != syncs:
    raise ValueError(f'QSR jumps from more than {syncs} syncs to {got} '
                     f'at alpha {hi:.6g}; pick another sync count')
  return hi


format_time = _registry.format_time
format_bytes = _registry.format_bytes


def setting(row) -> tuple[float, float | None]:
  """A row's tuned setting: ``(knob, inner)``, or ``(knob, inner,
  momentum)`` for a DiLoCo row whose outer momentum is not the config's;
  ``inner`` is DiLoCo's inner learning rate where it is not the config's,
  else None."""
  if row.get('outer_momentum') is not None:
    return row['knob'], row.get('inner_lr'), row['outer_momentum']
  return row['knob'], row.get('inner_lr')


def local_search(axes, losses):
  """The next settings to run so that the best one is a local minimum of
  the grid, or ``[]`` once it is.

  A pattern search on a grid: the best setting run so far (the first of
  ``axes``' values' product order while nothing has run) must have each of
  its neighbours on every axis (the next lower and higher value) run too;
  a neighbour that wins becomes the best and its neighbours are wanted in
  turn. It tunes with few runs when a good start is known (the first value
  of each axis) and never calls an edge of what was run the best when the
  grid goes further.

  Args:
    axes: one sequence of values per tuned knob; the first value of each is
      the start, the values' numeric order defines the neighbours.
    losses: ``{setting tuple: final eval loss}`` of the settings run so far
      (settings off the grid are ignored).

  Returns:
    The wanted settings (tuples), nearest first, axes in order.
  """
  grids = [sorted(set(a)) for a in axes]
  on_grid = {k: v for k, v in losses.items()
             if len(k) == len(grids) and all(x in g for x, g in
                                              zip(k, grids))}
  if not on_grid:
    return [tuple(a[0] for a in axes)]
  best = min(on_grid, key=on_grid.get)
  wanted = []
  for i, grid in enumerate(grids):
    j = grid.index(best[i])
    for k in (j - 1, j + 1):
      if 0 <= k < len(grid):
        point = best[:i] + (grid[k],) + best[i + 1:]
        if point not in on_grid:
          wanted.append(point)
  return wanted


def size_steps(pairs) -> dict[str, int]:
  """``--steps_per_size`` as ``{size: steps}``."""
  out = {}
  for pair in pairs:
    size, _, value = pair.partition('=')
    if size not in SIZES or not value.isdigit() or int(value) < 1:
      raise ValueError(f'{pair!r} is not SIZE=STEPS with a size of '
                       f'{list(SIZES)} and a positive number of steps')
    out[size] = int(value)
  return out


def method_inner(pairs, config_lr: float) -> dict[tuple[str | None, str],
                                          float | None]:
  """``--method_inner_lrs`` as ``{(size or None: every size, method):
  inner lr or None (the config's, ``config_lr``)}``; a size-less pair
  holds at every size."""
  out = {}
  for pair in pairs:
    key, _, value = pair.partition('=')
    size, _, method = key.rpartition(':')
    if (method not in METHODS or method == 'dp' or not value
        or (size and size not in SIZES)):
      raise ValueError(f'{pair!r} is not [SIZE:]DILOCO_METHOD=LR with a '
                       f'size of {list(SIZES)} and a method of '
                       f'{[m for m in METHODS if m != "dp"]}')
    lr = float(value)
    out[(size or None, method)] = (None if lr == config_lr
                                   else lr)
  return out


def claims_best(rows, size: str, method: str):
  """The setting of ``method`` at ``size`` with the lowest seed-0 final eval
  loss (None before any run)."""
  seed0 = [r for r in rows if r['size'] == size and r['method'] == method
           and r['seed'] == 0]
  if not seed0:
    return None
  return setting(min(seed0, key=lambda r: r['final_eval_loss']))


def claims_summary(rows, size: str, method: str):
  """``(setting, losses)`` of a method's best setting at ``size``, every
  seed of it; None before any run."""
  best = claims_best(rows, size, method)
  if best is None:
    return None
  return best, [r['final_eval_loss'] for r in rows if r['size'] == size
                and r['method'] == method and setting(r) == best]


def _setting_text(best) -> str:
  knob, inner, *momentum = best
  text = f'{knob:g}' if inner is None else f'{knob:g} at inner {inner:g}'
  return text + (f', momentum {momentum[0]:g}' if momentum else '')


def _search_text(s) -> str:
  """The tuning of a ``--search=local`` study, in words ('' for a grid)."""
  if s.get('search') != 'local':
    return ''
  inner = s['knobs'].get('method_inner', {})
  by_size = s['knobs'].get('method_inner_by_size', {})
  momenta = s['knobs'].get('outer_momenta')
  inner_text = (''.join(f'; {m} inner lr {v:g}' for m, v in inner.items())
                if not by_size else ''.join(
                    f'; at {size}: ' + ', '.join(f'{m} inner lr {v:g}'
                                                 for m, v in got.items())
                    for size, got in by_size.items()))
  return ('Local search: from the best setting of the 600-step grid (at a '
          'new size: from the first value of each knob), the grid '
          'neighbours of each best setting until it is a local minimum '
          '(not every cell)'
          + (f'; outer momentum over {momenta}' if momenta else '')
          + inner_text + '. ')


def _mean_spread(losses: list[float]) -> str:
  mean = sum(losses) / len(losses)
  if len(losses) == 1:
    return f'{mean:.4f} (1 seed)'
  return (f'{mean:.4f} ± {(max(losses) - min(losses)) / 2:.4f} '
          f'({len(losses)} seeds)')


def claims_main(data: dict[str, Any]) -> str:
  """DiLoCo M=1 / M=4 vs data-parallel per size: each method's best setting,
  mean ± half the range over seeds, and the relative gap to data-parallel."""
  res = data['results']
  s, rows = res['setup'], res['rows']
  methods = s['methods']
  gaps = [m for m in methods if m != 'dp']  # DiLoCo M=1, M=2, M=4
  steps = {size: _size_steps(rows, size, s) for size in s['sizes']}
  one = len(set(steps.values())) == 1
  lines = [(f'{s["num_steps"]} steps' if one else 'The steps column\'s steps')
           + f' x {s["batch_size"]} x {s["seq_len"]} '
           f'tokens per run; DiLoCo H = {s["sync_every"]}, outer Nesterov '
           f'momentum {s["outer_momentum"]:g}; tuned: data-parallel inner lr '
           f'over {s["knobs"]["dp"]}, DiLoCo outer lr over '
           f'{s["knobs"]["diloco_m1"]} at inner lr '
           f'{s["knobs"].get("diloco_inner", [s["inner_learning_rate"]])} '
           f'(the config\'s: {s["inner_learning_rate"]:g}). '
           + _search_text(s) + 'Final eval loss of '
           'each method\'s best setting (tuned values in brackets), mean ± '
           'half the range over seeds.', '',
           '| size (params) | steps (tokens / param) | '
           + ' | '.join(methods.values()) + ' | '
           + ''.join(f'{methods[m][7:]} vs DP | ' for m in gaps)
           + 'devices |', '|---|' + '---|' * (len(methods) + len(gaps) + 2)]
  for size in s['sizes']:
    params = [r['num_params'] for r in rows if r['size'] == size]
    if not params:
      continue
    cells, means = [], {}
    for m in methods:
      got = claims_summary(rows, size, m)
      if got is None:
        cells.append('')
        continue
      best, losses = got
      means[m] = sum(losses) / len(losses)
      cells.append(f'{_mean_spread(losses)} '
                   f'[{_setting_text(best)}]')
    for m in gaps:
      cells.append(f'{100 * (means[m] / means["dp"] - 1):+.2f}%'
                   if m in means and 'dp' in means else '')
    cells.append(_devices([r for r in rows if r['size'] == size]))
    per_param = steps[size] * s['batch_size'] * s['seq_len'] / params[0]
    lines.append(f'| {size} ({params[0]:,}) | {steps[size]:,} '
                 f'({per_param:.1f}) | ' + ' | '.join(cells) + ' |')
  if res.get('pending'):
    lines += ['', f'Not run yet: {_pending_summary(res["pending"])}.']
  compute = compute_line(data.get('runs', []))
  if compute:
    lines += ['', compute]
  return '\n'.join(lines) + '\n'


def _size_steps(rows, size: str, setup) -> int:
  """The steps of the runs at ``size`` (the setup's where none ran)."""
  got = [r['steps'] for r in rows if r['size'] == size and r.get('steps')]
  return max(got) if got else setup['num_steps']


def compute_line(runs) -> str:
  """The wall time the runs' provenance records, summed per device kind
  (a resumed run records its last segment only, so this is a floor; runs
  that shared a machine overlap)."""
  spent: dict[str, list[float]] = {}
  for r in runs:
    p = r.get('provenance', {})
    wall = p.get('wall_seconds')
    if wall is None:
      continue
    kind = p.get('device', {}).get('device_kind', 'unknown device')
    spent.setdefault(kind, []).append(float(wall))
  if not spent:
    return ''
  parts = [f'{format_time(sum(w))} over {len(w)} runs on {kind}'
           for kind, w in sorted(spent.items())]
  return ('Compute recorded: ' + '; '.join(parts) + ' (wall time summed '
          'over runs; runs that shared a machine overlap, and a resumed run '
          'counts its last segment only).')


def claims_figure(data: dict[str, Any], path) -> None:
  """Eval loss against training tokens of each method's best setting
  (seed 0), one panel per size."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  res = data['results']
  s, rows = res['setup'], res['rows']
  sizes = [k for k in SIZES if any(r['size'] == k for r in rows)]
  tokens = s['batch_size'] * s['seq_len']
  fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4),
                           squeeze=False)
  for ax, size in zip(axes[0], sizes):
    for m, label in s['methods'].items():
      best = claims_best(rows, size, m)
      if best is None:
        continue
      row = next(r for r in rows if r['size'] == size and r['method'] == m
                 and r['seed'] == 0 and setting(r) == best)
      steps = sorted(row['curve'], key=int)
      ax.plot([int(k) * tokens / 1e6 for k in steps],
              [row['curve'][k] for k in steps], marker='o', markersize=3,
              label=f'{label} [{_setting_text(best)}]')
    ax.set_title(f'{size}, {_size_steps(rows, size, s)} steps')
    ax.set_xlabel('training tokens (M)')
    ax.set_ylabel('eval loss')
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _pending_summary(pending) -> str:
  """The runs not done yet, counted per size and method (the names are in
  the results file): seed-0 runs as settings of the grid, the others as
  seeds of the best setting; other entries as written."""
  counts: dict[tuple[str, str], int] = {}
  seeds: dict[tuple[str, str], list[str]] = {}
  other = []
  for name in pending:
    size, rest = name.split('_', 1) if '_' in name else (name, '')
    method = next((m for m in METHODS if rest.startswith(m + '_')), None)
    seed = re.search(r'_s(\d+)(?:_i|_m|$)', rest)
    if size in SIZES and method is not None and seed and seed.group(1) != '0':
      seeds.setdefault((size, method), []).append(seed.group(1))
    elif size in SIZES and method is not None:
      counts[size, method] = counts.get((size, method), 0) + 1
    else:
      other.append(name)
  parts = [f'{size} {METHODS[m][0]}: {n} setting{"s" * (n != 1)} of the '
           'grid' for (size, m), n in counts.items()]
  parts += [f'{size} {METHODS[m][0]}: seed{"s" * (len(s) != 1)} '
            f'{", ".join(s)} of the best setting'
            for (size, m), s in seeds.items()]
  return '; '.join(parts + other)


def _devices(rows) -> str:
  """The devices ``rows`` ran on, with the methods on each where several."""
  by_device: dict[str, list[str]] = {}
  for r in rows:
    methods = by_device.setdefault(r.get('device', 'not recorded'), [])
    if r['method'] not in methods:
      methods.append(r['method'])
  if len(by_device) == 1:
    return next(iter(by_device))
  return '; '.join(f'{d}: {", ".join(m)}' for d, m in by_device.items())


def _bytes_cell(row) -> str:
  if row.get('simulated_workers'):
    return 'not measured (simulated workers)'
  return format_bytes(row['cross_worker_bytes'])


def claims_sweep(data: dict[str, Any]) -> str:
  """Every seed-0 run of the sweep: final eval loss per tuned value."""
  res = data['results']
  order = {k: i for i, k in enumerate(SIZES)}
  methods = list(METHODS)
  base_inner = res['setup'].get('inner_learning_rate', 0.0)
  rows = sorted((r for r in res['rows'] if r['seed'] == 0),
                key=lambda r: (order.get(r['size'], len(order)),
                               methods.index(r['method'])
                               if r['method'] in methods else len(methods),
                               r.get('inner_lr') or base_inner, r['knob']))
  lines = ['| size | method | tuned value | final eval loss | '
           'cross-worker bytes | device |', '|---|---|---|---|---|---|']
  for r in rows:
    what = ('inner lr ' if r['method'] == 'dp' else 'outer lr ')
    inner = ('' if r.get('inner_lr') is None
             else f', inner lr {r["inner_lr"]:g}')
    if r.get('outer_momentum') is not None:
      inner += f', momentum {r["outer_momentum"]:g}'
    lines.append(f'| {r["size"]} | {res["setup"]["methods"][r["method"]]} | '
                 f'{what}{r["knob"]:g}{inner} | {r["final_eval_loss"]:.4f} | '
                 f'{_bytes_cell(r)} | '
                 f'{r.get("device", "not recorded")} |')
  return '\n'.join(lines) + '\n'


def qsr_main(data: dict[str, Any]) -> str:
  """QSR against the constant period with the same syncs, and the constant
  H_base reference: final eval loss (mean over seeds) per rule."""
  res = data['results']
  s, rows = res['setup'], res['rows']
  kw = s['schedule_kwargs']
  lines = [f'{s["num_steps"]} steps x {s["batch_size"]} x {s["seq_len"]} '
           f'tokens, M = {s["workers"]} workers x {s["devices"] // s["workers"]}'
           f' devices, `outer.method={s["method"]}` (parameter averaging), '
           f'inner {s["optimizer"]} at peak lr {s["learning_rate"]:g} '
           f'({s["schedule"]}, {", ".join(f"{k} {v}" for k, v in kw.items())})'
           f'; QSR with H_base = {s["base_period"]}. Each QSR run\'s alpha is '
           'the one that makes its number of syncs; its twin is the constant '
           'H with the same syncs (same bytes).', '',
           '| rule | syncs | cross-worker bytes | final eval loss | '
           'vs constant H at equal syncs |', '|---|---|---|---|---|']
  groups: dict[str, list[dict]] = {}
  for r in rows:
    groups.setdefault(r['name'], []).append(r)
  def mean(name):
    got = groups.get(name, [])
    return sum(r['final_eval_loss'] for r in got) / len(got) if got else None
  for name, got in groups.items():
    r = got[0]
    rule = (f'QSR, alpha {r["knob"]:.4g}' if r['rule'] == 'qsr'
            else f'constant H = {r["knob"]:g}')
    loss = mean(name)
    seeds = f' ({len(got)} seeds)' if len(got) > 1 else ''
    gap = ''
    if r['rule'] == 'qsr':
      twin = mean(f'constant_h{s["num_steps"] // r["pair"]}')
      gap = f'{100 * (loss / twin - 1):+.2f}%' if twin else ''
    lines.append(f'| {rule} | {r["syncs"]} | '
                 f'{format_bytes(r["cross_worker_bytes"])} | {loss:.4f}{seeds}'
                 f' | {gap} |')
  if res.get('pending'):
    lines += ['', f'Not run yet: {_pending_summary(res["pending"])}.']
  return '\n'.join(lines) + '\n'


def best_lr(rows) -> float:
  """The learning rate of the row with the lowest final eval loss."""
  if not rows:
    raise ValueError('no runs to pick a learning rate from')
  return min(rows, key=lambda r: r['final_eval_loss'])['learning_rate']


def _loss_cell(values) -> str:
  mean, sd = _registry.mean_sd(values)
  return f'{mean:.4f}' + (f' +- {sd:.4f}' if sd is not None else '')


def qsr_budget_main(data: dict[str, Any]) -> str:
  """QSR against its constant twin, with the seed spread: final eval loss
  (mean +- sd over seeds, and each seed), and the per-seed paired
  difference QSR - twin; the inner-lr check first."""
  res = data['results']
  s, rows = res['setup'], res['rows']
  kw = s['schedule_kwargs']
  where = ('stacked on one device (simulated: the same numerics, no bytes '
           'measured)' if s.get('simulated_workers')
           else f'x {s["devices"] // s["workers"]} devices')
  model = f'{s["size"]} LM' if s.get('size') else "config's LM"
  lines = [f'The {model}, {s["num_steps"]} steps x '
           f'{s["batch_size"]} x {s["seq_len"]} tokens, M = {s["workers"]} '
           f'workers {where}, `outer.method={s["method"]}` (parameter '
           f'averaging), inner {s["optimizer"]} at peak lr '
           f'{s["learning_rate"]:g} ({s["schedule"]}, '
           f'{", ".join(f"{k} {v}" for k, v in kw.items())}); QSR with '
           f'H_base = {s["base_period"]}, each alpha the one that makes its '
           'number of syncs; its twin is the constant H with the same syncs '
           '(same bytes).']
  if res.get('lr_check'):
    tried = ', '.join(f'{r["learning_rate"]:g}: {r["final_eval_loss"]:.4f}'
                      for r in res['lr_check'])
    lines += ['', f'Inner peak lr, constant H = {s["base_period"]}, seed '
              f'{res["lr_check"][0]["seed"]} (final eval loss): {tried}; the '
              f'runs below use {s["learning_rate"]:g}.']
  lines += ['', '| rule | syncs | final eval loss (mean +- sd) | each seed | '
            'vs twin | QSR - twin per seed (mean +- sd) |',
            '|---|---|---|---|---|---|']
  groups: dict[str, dict[int, float]] = {}
  first: dict[str, dict] = {}
  for r in rows:
    groups.setdefault(r['name'], {})[r['seed']] = r['final_eval_loss']
    first.setdefault(r['name'], r)
  for name, got in groups.items():
    r = first[name]
    rule = (f'QSR, alpha {r["knob"]:.4g}' if r['rule'] == 'qsr'
            else f'constant H = {r["knob"]:g}')
    twin = groups.get(f'constant_h{s["num_steps"] // (r["pair"] or 1)}', {})
    gap = paired = ''
    if r['rule'] == 'qsr' and twin:
      loss = _registry.mean_sd(list(got.values()))[0]
      other = _registry.mean_sd(list(twin.values()))[0]
      gap = f'{100 * (loss / other - 1):+.2f}%'
      diffs = [got[k] - twin[k] for k in got if k in twin]
      mean, sd = _registry.mean_sd(diffs)
      paired = (f'{mean:+.4f}' + (f' +- {sd:.4f}' if sd is not None else '')
                + f' ({len(diffs)} seed{"s" * (len(diffs) != 1)})')
    each = ', '.join(f'{v:.4f}' for _, v in sorted(got.items()))
    lines.append(f'| {rule} | {r["syncs"]} | {_loss_cell(list(got.values()))}'
                 f' | {each} | {gap} | {paired} |')
  if res.get('pending'):
    lines += ['', f'Not run yet: {", ".join(res["pending"])}.']
  return '\n'.join(lines) + '\n'


_registry.tables({
    ('claims', 'main'): claims_main,
    ('claims', 'sweep'): claims_sweep,
    ('claims_long', 'main'): claims_main,
    ('claims_long', 'sweep'): claims_sweep,
    ('claims_budget', 'main'): claims_main,
    ('qsr', 'main'): qsr_main,
    ('qsr_budget', 'main'): qsr_budget_main,
})
_registry.figure('claims', claims_figure, 'figures/claims.png')
_registry.figure('claims_long', claims_figure, 'figures/claims_long.png')
_registry.figure('claims_budget', claims_figure,
                 'figures/claims_budget.png')
