"""Renderers of the tables of docs/faults.md (worker dropout),
docs/hierarchical.md and docs/benchmarks.md (hierarchical against flat
DiLoCo) and docs/decoupled_diloco.md (Decoupled DiLoCo under stragglers
and a failure), and of its figure docs/figures/decoupled.png.

``experiments.dropout``, ``experiments.hierarchical`` and
``experiments.decoupled`` print their tables with these and write the
results files; ``experiments.tables`` renders the docs tables from the
files. Each file holds the base config under ``results.config`` and the
numbers of each run under ``results.runs`` (run name -> numbers); a row is
labelled as its run was when trained (the file's ``runs``, matched by run
directory).
"""

import math
import pathlib
from typing import Any

from experiments import _registry


def labels(data: dict[str, Any]) -> dict[str, str]:
  """Run name (its directory's name) -> the label it was trained under."""
  return {pathlib.PurePath(r['workdir']).name: r['label']
          for r in data.get('runs', [])}


def _rows(data: dict[str, Any]):
  """``(name, label, numbers)`` of each run in ``data['results']['runs']``,
  in order; a run without a recorded label is labelled by its name."""
  names = labels(data)
  for name, r in data['results']['runs'].items():
    yield name, names.get(name, name), r


def _loss(x: float | None) -> str:
  """``1.9514`` to 4 places, ``'-'`` where missing or not finite."""
  return f'{x:.4f}' if x is not None and math.isfinite(x) else '-'


def dropout_main(data: dict[str, Any]) -> str:
  """Per run: syncs, workers left out, final eval loss, and the relative
  change of a dropout run's loss against its run without dropout."""
  res = data['results']
  c, runs = res['config'], res['runs']
  lines = [
      f'Worker dropout, {c["mesh"]["workers"]} workers, H = '
      f'{c["outer"]["sync_every"]}, {c["num_steps"]} steps; a drawn worker '
      f'misses {res["drop_fraction"]:.0%} (rounded up) of the syncs.', '',
      '| run | syncs | workers left out | final eval loss | vs. no dropout |',
      '|---|---:|---:|---:|---:|']
  for name, label, r in _rows(data):
    base = runs.get(name.removesuffix('_drop'))
    change = ''
    if name.endswith('_drop') and base is not None:
      rel = r['final_eval_loss'] / base['final_eval_loss'] - 1
      change = f'{100 * rel:+.2f}%'
    lines.append(f'| {label} | {r["syncs"]} | {r["left_out"]} | '
                 f'{r["final_eval_loss"]:.4f} | {change} |')
  return '\n'.join(lines) + '\n'


def hierarchical_main(data: dict[str, Any]) -> str:
  """Per run: final eval loss, bytes per worker between and inside groups,
  and the simulated seconds and utilization on the two-level links."""
  res = data['results']
  c = res['config']
  lines = [
      f'{c["mesh"]["workers"]} workers in groups of {res["group_size"]}, '
      f'{c["num_steps"]} steps; links {res["fast_gbps"]:g} Gbit/s inside a '
      f'group, {res["slow_gbps"]:g} Gbit/s between groups, '
      f'{c["wallclock"]["step_time_s"]:g} s per step.', '',
      '| run | final eval loss | MB/worker between groups | MB/worker '
      'inside groups | simulated s | utilization |',
      '|---|---:|---:|---:|---:|---:|']
  for _, label, r in _rows(data):
    lines.append(
        f'| {label} | {r["final_eval_loss"]:.4f} | '
        f'{r["between_groups_mb_per_worker"]:.2f} | '
        f'{r["within_groups_mb_per_worker"]:.2f} | {r["seconds"]:.1f} | '
        f'{r["utilization"]:.3f} |')
  return '\n'.join(lines) + '\n'


def _failures(c: dict[str, Any]) -> str:
  return '; '.join(f'learner {int(w)} down for steps {int(s)}-'
                   f'{int(s + n) - 1}' for w, s, n in c['faults']['failures'])


def decoupled_main(data: dict[str, Any]) -> str:
  """Per run: merges, learners per merge, final eval loss, tokens and
  simulated seconds, and the eval loss at the simulated time and at the
  tokens of the K=1 + grace run (``-`` without that run, or past the end
  of a run's curve); below, the bytes one learner sends per merge."""
  res = data['results']
  c = res['config']
  lines = [
      f'{c["mesh"]["workers"]} learners (speeds '
      f'{tuple(c["wallclock"]["worker_speeds"])}); '
      f'{_failures(c) or "no failure"}; H = {c["outer"]["sync_every"]}, '
      f'{c["num_steps"]} program steps each.', '',
      '| run | merges | learners per merge | final eval loss | tokens (M) | '
      'simulated s | loss at K=1+grace time | loss at its tokens |',
      '|---|---:|---:|---:|---:|---:|---:|---:|']
  for _, label, r in _rows(data):
    lines.append(
        f'| {label} | {r["merges"]} | {r["per_merge"]} | '
        f'{r["final_eval_loss"]:.4f} | {r["tokens"] / 1e6:.2f} | '
        f'{r["seconds"]:.1f} | {_loss(r.get("loss_at_time"))} | '
        f'{_loss(r.get("loss_at_tokens"))} |')
  if res.get('bytes_per_learner'):
    lines += ['', 'Bytes one learner sends (compiled HLO): ' + ', '.join(
        f'{k} {v:,}' for k, v in res['bytes_per_learner'].items()) + '.']
  return '\n'.join(lines) + '\n'


def decoupled_figure(data: dict[str, Any], path: str | pathlib.Path,
                     top: float = 2.6) -> None:
  """Eval loss against tokens processed (left) and simulated seconds
  (right) of each run's ``points``; the synchronous runs dashed.

  The y-axis ends at ``top`` (cutting off the first evaluations of the
  reference LM), or higher where the second half of a run's curve lies
  above it, so that every run's later curve shows."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  later = []
  for name, label, r in _rows(data):
    pts = [tuple(map(float, p)) for p in r['points']]
    if not pts:
      continue
    later += [p[3] for p in pts[(len(pts) - 1) // 2:]]
    style = '--' if name in ('data_parallel', 'streaming') else '-'
    for ax, col, scale in ((axes[0], 1, 1e6), (axes[1], 2, 1)):
      ax.plot([p[col] / scale for p in pts], [p[3] for p in pts], style,
              label=label)
  axes[0].set_xlabel('tokens processed (M)')
  axes[1].set_xlabel('simulated seconds')
  axes[0].set_ylabel('eval loss')
  if later and max(later) > top:
    low = min(later)
    top = max(later) + 0.05 * max(max(later) - low, 0.1)
  axes[0].set_ylim(top=top)
  axes[1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


_registry.tables({
    ('dropout', 'main'): dropout_main,
    ('hierarchical', 'main'): hierarchical_main,
    ('decoupled', 'main'): decoupled_main,
})
_registry.figure('decoupled', decoupled_figure, 'figures/decoupled.png')
