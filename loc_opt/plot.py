"""Plots of one or several training runs: loss against steps, bytes, time.

::

  python -m loc_opt.plot WORKDIR [WORKDIR ...] --out DIR [--loss eval]

reads each run's ``metrics.jsonl`` and ``summary.json`` (written by
``loc_opt.train.train_and_evaluate``) and writes, into ``DIR``:

* ``loss_vs_step.png``: the loss against the inner step;
* ``loss_vs_bytes.png``: the loss against the cross-worker bytes moved so
  far (``comm/cross_worker_bytes_total``, read from the compiled programs'
  collectives; log scale);
* ``loss_vs_wallclock_<bandwidth>.png``: the loss against the simulated
  wall-clock of the ``wallclock`` config section on each link bandwidth
  (``wallclock/<bandwidth>_seconds``; runs from before that metric existed
  have none and are left out of these).

Each run is labelled by its method (``summary.json``'s ``method``), with the
workdir's name where two runs share a method. ``--loss train`` (default)
plots the logged training loss, ``--loss eval`` the evaluations.

Needs matplotlib (``pip install matplotlib`` or ``loc_opt[plot]``); the rest
of loc_opt does not.
"""

import argparse
from collections.abc import Sequence
import json
import pathlib
import re
import sys
from typing import Any

LOSS_KEYS = {'train': 'train/loss', 'eval': 'eval/loss'}
BYTES_KEY = 'comm/cross_worker_bytes_total'
WALLCLOCK_KEY = re.compile(r'^wallclock/(.+)_seconds$')


def _pyplot():
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError('loc_opt.plot needs matplotlib: pip install matplotlib '
                      "(or pip install 'loc_opt[plot]')") from e
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def read_run(workdir: str | pathlib.Path) -> dict[str, Any]:
  """``{'name', 'method', 'records', 'summary'}`` of a run directory.

  Raises:
    FileNotFoundError: naming the workdir without a ``metrics.jsonl``.
  """
  workdir = pathlib.Path(workdir)
  path = workdir / 'metrics.jsonl'
  if not path.is_file():
    raise FileNotFoundError(f'{workdir} has no metrics.jsonl: not a '
                            'loc_opt run directory (or the run has not '
                            'logged yet)')
  records = []
  for line in path.read_text(encoding='utf-8').splitlines():
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      continue  # a line cut short by an interruption
  summary_path = workdir / 'summary.json'
  summary = (json.loads(summary_path.read_text())
             if summary_path.is_file() else {})
  return {'name': workdir.resolve().name,
          'method': summary.get('method') or workdir.resolve().name,
          'records': records, 'summary': summary}


def _labels(runs: Sequence[dict[str, Any]]) -> list[str]:
  methods = [r['method'] for r in runs]
  return [m if methods.count(m) == 1 else f'{m} ({r["name"]})'
          for m, r in zip(methods, runs)]


def _series(records, x_key: str, y_key: str, *, positive_x: bool = False):
  """``(xs, ys)`` of the records that have both keys with finite values."""
  xs, ys = [], []
  for r in records:
    x, y = r.get(x_key), r.get(y_key)
    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
      if positive_x and x <= 0:
        continue
      xs.append(x)
      ys.append(y)
  return xs, ys


def _figure(plt, runs, labels, x_key, y_key, *, xlabel, ylabel, title,
            path, log_x=False) -> pathlib.Path | None:
  """One figure of ``y_key`` against ``x_key``; None if no run has both."""
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  drawn = 0
  for run, label in zip(runs, labels):
    xs, ys = _series(run['records'], x_key, y_key, positive_x=log_x)
    if xs:
      ax.plot(xs, ys, marker='.' if len(xs) < 30 else None, label=label)
      drawn += 1
  if not drawn:
    plt.close(fig)
    return None
  if log_x:
    ax.set_xscale('log')
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(True, alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def plot_runs(workdirs: Sequence[str | pathlib.Path],
              out_dir: str | pathlib.Path, *,
              loss: str = 'train') -> list[pathlib.Path]:
  """Writes the PNGs of the module docstring for ``workdirs`` into
  ``out_dir`` (created if needed).

  Args:
    workdirs: run directories (each with a ``metrics.jsonl``).
    out_dir: where the PNGs go.
    loss: ``'train'`` or ``'eval'``.

  Returns:
    The paths written.
  """
  if loss not in LOSS_KEYS:
    raise ValueError(f'loss must be one of {sorted(LOSS_KEYS)}, got {loss!r}')
  if not workdirs:
    raise ValueError('give at least one run directory')
  runs = [read_run(w) for w in workdirs]
  labels = _labels(runs)
  y_key, ylabel = LOSS_KEYS[loss], f'{loss} loss'
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  plt = _pyplot()
  specs = [('step', 'inner step', 'loss_vs_step', 'Loss by step', False),
           (BYTES_KEY, 'cross-worker bytes moved', 'loss_vs_bytes',
            'Loss by communication', True)]
  clocks = sorted({m.group(1) for run in runs for r in run['records']
                   for m in map(WALLCLOCK_KEY.match, r) if m})
  specs += [(f'wallclock/{bw}_seconds', f'simulated wall-clock (s), {bw} '
             'links', f'loss_vs_wallclock_{bw}',
             f'Loss by simulated time ({bw})', False) for bw in clocks]
  written = []
  for x_key, xlabel, name, title, log_x in specs:
    path = _figure(plt, runs, labels, x_key, y_key, xlabel=xlabel,
                   ylabel=ylabel, title=title, path=out / f'{name}.png',
                   log_x=log_x)
    if path is not None:
      written.append(path)
  return written


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog='python -m loc_opt.plot',
      description='Plot loss against steps, cross-worker bytes and '
      'simulated wall-clock for one or several loc_opt runs.')
  parser.add_argument('workdirs', nargs='+', help='run directories')
  parser.add_argument('--out', required=True, help='directory for the PNGs')
  parser.add_argument('--loss', choices=sorted(LOSS_KEYS), default='train')
  args = parser.parse_args(argv)
  try:
    written = plot_runs(args.workdirs, args.out, loss=args.loss)
  except (FileNotFoundError, ImportError, ValueError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  for path in written:
    print(path)
  return 0


if __name__ == '__main__':
  sys.exit(main())
