"""The bytes-at-quality frontier's results, table, sentence and figure
(:mod:`experiments.frontier`; registered in :mod:`experiments._registry`)."""

from typing import Any

from experiments import _registry

# The loss margins over data-parallel's of the headline sentence.
MARGINS = (0.02, 0.05)

# Results names -> figure: the 0.2M study and the 0.5M (459k) one.
NAMES = {'frontier': 'figures/frontier.png',
         'frontier_459k': 'figures/frontier_459k.png'}


_fmt_bytes = _registry.format_bytes


def best_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Each run's row at its best knob value, in the rows' order."""
  best: dict[str, dict[str, Any]] = {}
  for r in rows:
    if (r['run'] not in best
        or r['final_eval_loss'] < best[r['run']]['final_eval_loss']):
      best[r['run']] = r
  return list(best.values())


def pareto(rows: list[dict[str, Any]]) -> list[str]:
  """Names of the rows no other row beats on both loss and bytes, by
  bytes."""
  front, lowest = [], float('inf')
  for r in sorted(rows, key=lambda r: (r['cross_worker_bytes'],
                                       r['final_eval_loss'])):
    if r['final_eval_loss'] < lowest:
      front.append(r['name'])
      lowest = r['final_eval_loss']
  return front


def within(rows: list[dict[str, Any]], margin: float
           ) -> dict[str, Any] | None:
  """The row with the fewest bytes whose loss is within ``margin`` of
  data-parallel's, and its reduction of bytes against data-parallel
  (None without a data-parallel row)."""
  dp = [r for r in rows if r['family'] == 'data-parallel']
  if not dp:
    return None
  ref = min(dp, key=lambda r: r['final_eval_loss'])
  ok = [r for r in rows if r['family'] != 'data-parallel'
        and r['final_eval_loss'] <= ref['final_eval_loss'] * (1 + margin)]
  if not ok:
    return {'margin': margin, 'name': None, 'reduction': None}
  r = min(ok, key=lambda r: r['cross_worker_bytes'])
  return {'margin': margin, 'name': r['name'], 'label': r['label'],
          'final_eval_loss': r['final_eval_loss'],
          'reduction': ref['cross_worker_bytes'] / max(
              r['cross_worker_bytes'], 1)}


def results(rows, setup, pending) -> dict[str, Any]:
  """The results file's ``results``: every run, each run's best, the
  Pareto front of the bests and the reductions within :data:`MARGINS`."""
  best = best_rows(rows)
  return {'setup': setup, 'rows': rows, 'pending': pending,
          'front': pareto(best),
          'within': [within(best, m) for m in MARGINS]}


def _closest(best: list[dict[str, Any]]) -> str:
  """The method nearest data-parallel's loss, in words."""
  ref = min((r for r in best if r['family'] == 'data-parallel'),
            key=lambda r: r['final_eval_loss'])
  r = min((r for r in best if r['family'] != 'data-parallel'),
          key=lambda r: r['final_eval_loss'])
  return (f'the closest is {r["label"]} at '
          f'{100 * (r["final_eval_loss"] / ref["final_eval_loss"] - 1):+.1f}%'
          f' with {ref["cross_worker_bytes"] / max(r["cross_worker_bytes"], 1):,.0f}x'
          ' fewer bytes')


def sentence(data: dict[str, Any]) -> str:
  """The headline: the largest reduction of cross-worker bytes against
  data-parallel within 2% of its loss, and within 5%."""
  res = data['results']
  parts = []
  for w in res['within']:
    if w is None:
      return 'No data-parallel run yet: no reduction to state.'
    if w['name'] is None:
      parts.append(f'no method is within {100 * w["margin"]:g}% of '
                   'data-parallel\'s loss')
    else:
      parts.append(f'within {100 * w["margin"]:g}% of data-parallel\'s '
                   f'loss the largest reduction of cross-worker bytes is '
                   f'{w["reduction"]:,.0f}x ({w["label"]}, '
                   f'{w["final_eval_loss"]:.4f})')
  others = [r for r in res['rows'] if r['family'] != 'data-parallel']
  if others and all(w['name'] is None for w in res['within']):
    parts.append(_closest(best_rows(res['rows'])))
  s = res['setup']
  size = f'the {s["size"]} LM, ' if 'size' in s else ''
  text = (f'At {size}{s["num_steps"]} steps x {s["batch_size"]} x {s["seq_len"]} '
          f'bytes (M = {s["workers"]}), ' + '; '.join(parts) + '.')
  if res['pending']:
    text += (f' ({len(res["pending"])} runs of the study are not done; '
             'the answer can change.)')
  return text


def frontier_main(data: dict[str, Any]) -> str:
  """Every run's best setting: loss, bytes, both against data-parallel,
  and whether it is on the Pareto front; then the headline sentence."""
  res = data['results']
  best = best_rows(res['rows'])
  dp = [r for r in best if r['family'] == 'data-parallel']
  ref = dp[0] if dp else None
  lines = ['| run | method | final eval loss | vs data-parallel | '
           'cross-worker bytes | fewer bytes than data-parallel | '
           'Pareto front |', '|---|---|---|---|---|---|---|']
  for r in sorted(best, key=lambda r: -r['cross_worker_bytes']):
    vs = (f'{100 * (r["final_eval_loss"] / ref["final_eval_loss"] - 1):+.2f}%'
          if ref else '')
    fewer = (f'{ref["cross_worker_bytes"] / max(r["cross_worker_bytes"], 1):,.0f}x'
             if ref else '')
    lines.append(f'| {r["label"]} | {r["family"]} | '
                 f'{r["final_eval_loss"]:.4f} | {vs} | '
                 f'{_fmt_bytes(r["cross_worker_bytes"])} | {fewer} | '
                 f'{"yes" if r["name"] in res["front"] else ""} |')
  lines += ['', sentence(data)]
  if res['pending']:
    lines += ['', f'Not run yet: {", ".join(res["pending"])}.']
  return '\n'.join(lines) + '\n'


def frontier_figure(data: dict[str, Any], path) -> None:
  """Final eval loss against total cross-worker bytes (log scale), every
  run's best, the Pareto front joined, the 2% and 5% bands over
  data-parallel shaded."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  res = data['results']
  best = best_rows(res['rows'])
  fig, ax = plt.subplots(figsize=(8, 5))
  families = sorted({r['family'] for r in best})
  for i, fam in enumerate(families):
    got = [r for r in best if r['family'] == fam]
    ax.scatter([r['cross_worker_bytes'] for r in got],
               [r['final_eval_loss'] for r in got], label=fam,
               marker='*' if fam == 'data-parallel' else 'o',
               s=120 if fam == 'data-parallel' else 30, color=f'C{i}')
    for r in got:
      ax.annotate(r['label'], (r['cross_worker_bytes'],
                               r['final_eval_loss']),
                  textcoords='offset points', xytext=(4, 3), fontsize=7)
  front = [r for n in res['front'] for r in best if r['name'] == n]
  ax.plot([r['cross_worker_bytes'] for r in front],
          [r['final_eval_loss'] for r in front], 'k--', lw=0.8,
          label='Pareto front')
  dp = [r for r in best if r['family'] == 'data-parallel']
  if dp:
    loss = dp[0]['final_eval_loss']
    for m, alpha in zip(MARGINS, (0.15, 0.08)):
      ax.axhspan(loss, loss * (1 + m), color='C0', alpha=alpha)
  ax.set_xscale('log')
  ax.set_xlabel('total cross-worker bytes')
  ax.set_ylabel('final eval loss')
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def frontier_headline(data: dict[str, Any]) -> str:
  """The headline sentence alone (the top of the claims page)."""
  return sentence(data) + '\n'


for _name, _path in NAMES.items():
  _registry.tables({(_name, 'main'): frontier_main,
                    (_name, 'headline'): frontier_headline})
  _registry.figure(_name, frontier_figure, _path)
