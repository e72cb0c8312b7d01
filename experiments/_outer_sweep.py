"""The outer-step sweep's parts without flags (:mod:`experiments.outer_sweep`).

The methods it sweeps beyond ``outer.method`` values (the naive one-round
delay of Eager updates), the ``--also`` settings, the run names, and the
renderers of the sweep at the claims study's budget (registered in
:data:`experiments._registry.RENDERERS`).
"""

from typing import Any

from experiments import _registry

# Sweep names that are not outer.method values: name -> (outer.method,
# overrides). The naive delay is Eager updates' ablation (Kale et al., 2025):
# the outer step takes the previous round's average alone.
VARIANTS = {
    'eager_naive': ('eager_diloco', {'outer__eager_diloco__naive': True}),
}
LABELS = {'diloco': 'DiLoCo', 'eager_diloco': 'Eager updates',
          'eager_naive': 'naive one-round delay', 'co2': 'CO2',
          'noloco': 'NoLoCo'}


def method_of(name: str) -> tuple[str, dict[str, Any]]:
  """``(outer.method, overrides)`` of sweep method ``name``."""
  return VARIANTS.get(name, (name, {}))


def run_name(method: str, workers: int, lr: float, momentum: float,
             seed: int = 0, size: str = '') -> str:
  """The run directory's name (seed 0 and no size: the sweep's old names)."""
  head = f'{size}_' if size else ''
  tail = f'_s{seed}' if seed else ''
  return f'{head}{method}_m{workers}_lr{lr:g}_mom{momentum:g}{tail}'


def parse_also(values, methods) -> list[tuple[str, Any, int]]:
  """``--also`` entries as ``(method, setting, seeds)``.

  An entry is ``METHOD@LR:MOMENTUM[:SEEDS]`` (that outer step) or
  ``METHOD@TUNED[:SEEDS]`` (the best setting ``TUNED``, one of ``methods``,
  found at the same M); ``setting`` is ``(lr, momentum)`` or ``TUNED``'s
  name, ``seeds`` the number of seeds (0 .. SEEDS-1; default 1).
  """
  out = []
  for value in values:
    method, at, rest = value.partition('@')
    parts = rest.split(':')
    bad = (f'--also entry {value!r} is not METHOD@LR:MOMENTUM[:SEEDS] or '
           f'METHOD@TUNED[:SEEDS] with TUNED one of --methods {list(methods)}')
    if not method or not at or not rest:
      raise ValueError(bad)
    try:
      if parts[0] in methods:
        setting, tail = parts[0], parts[1:]
      else:
        setting, tail = (float(parts[0]), float(parts[1])), parts[2:]
      seeds = int(tail[0]) if tail else 1
    except (ValueError, IndexError) as e:
      raise ValueError(bad) from e
    if len(tail) > 1 or seeds < 1:
      raise ValueError(bad)
    out.append((method, setting, seeds))
  return out


def _settings(rows):
  """``{(method, M, lr, momentum): [losses by seed order]}``, first-seen
  order, of the settings run at several seeds or besides the search
  (``--also``); the search's other points are in the tuning table."""
  out: dict[tuple, list[float]] = {}
  shown = set()
  for r in sorted(rows, key=lambda r: r.get('seed', 0)):
    key = (r['method'], r['workers'], r['learning_rate'], r['momentum'])
    out.setdefault(key, []).append(r['final_eval_loss'])
    if r.get('role', 'search') != 'search' or len(out[key]) > 1:
      shown.add(key)
  order = []
  for r in rows:
    key = (r['method'], r['workers'], r['learning_rate'], r['momentum'])
    if key in shown and key not in order:
      order.append(key)
  methods = list(dict.fromkeys(k[0] for k in order))
  order.sort(key=lambda k: methods.index(k[0]))  # stable: by method
  return {k: out[k] for k in order}


def budget_seeds(data: dict[str, Any]) -> str:
  """The settings run at several seeds or besides the search (``--also``):
  their seeds' final eval losses, mean +- sample std,
  and the gap of the mean to DiLoCo's most-seeded setting at the same M (in
  percent and in that DiLoCo setting's seed standard deviations)."""
  res = data['results']
  settings = _settings(res['rows'])
  reference = {}
  for (method, m, lr, mom), losses in settings.items():
    if method == 'diloco' and len(losses) > len(
        reference.get(m, (None, []))[1]):
      reference[m] = ((lr, mom), losses)
  lines = ['| method | M | outer lr | momentum | seeds | final eval loss '
           '(by seed) | mean +- std | vs DiLoCo |', '|---' * 8 + '|']
  for (method, m, lr, mom), losses in settings.items():
    mean, std = _registry.mean_sd(losses)
    spread = '' if std is None else f' +- {std:.4f}'
    gap = ''
    if m in reference and (method, (lr, mom)) != ('diloco', reference[m][0]):
      ref_mean, ref_std = _registry.mean_sd(reference[m][1])
      gap = f'{100 * (mean / ref_mean - 1):+.2f}%'
      if ref_std:
        gap += f' ({(mean - ref_mean) / ref_std:+.1f} std)'
    lines.append(
        f'| {LABELS.get(method, method)} | {m} | {lr:g} | {mom:g} | '
        f'{len(losses)} | ' + ', '.join(f'{x:.4f}' for x in losses)
        + f' | {mean:.4f}{spread} | {gap} |')
  if res.get('pending'):
    lines += ['', f'Not run yet: {", ".join(res["pending"])}.']
  return '\n'.join(lines) + '\n'


_registry.tables({
    ('outer_sweep_budget', 'seeds'): budget_seeds,
})
