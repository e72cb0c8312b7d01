"""Metrics: JSONL, TensorBoard, CSV or Weights & Biases, and a progress bar.

``metrics.jsonl`` is always written (the run summary and ``loc_opt.plot``
read it); ``logging.backends`` in the config adds the others:
``'tensorboard'`` (event files in ``tensorboard/``, written with
``tensorboardX``, which does not need TensorFlow), ``'csv'``
(``metrics.csv``, one row per logged step, one column per metric) and
``'wandb'`` (a Weights & Biases run; the ``wandb`` package is optional and
imported only when chosen: ``pip install wandb``).
"""

import csv
import json
import math
import os
import pathlib
import sys
from typing import Any, TextIO
import uuid

import tensorboardX

BACKENDS = ('jsonl', 'tensorboard', 'csv', 'wandb')


def format_bytes(n: float) -> str:
  """``1536 -> '1.5 KiB'``."""
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if abs(n) < 1024 or unit == 'TiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.1f} {unit}'
    n /= 1024
  return f'{n:.1f} TiB'


def check_logging(config) -> tuple[str, ...]:
  """``config.logging.backends`` validated (default ``('jsonl',
  'tensorboard')``, the behaviour before the field existed); with
  ``'wandb'``, the package must import."""
  section = config.get('logging') or {}
  backends = tuple(section.get('backends', ('jsonl', 'tensorboard')))
  unknown = [b for b in backends if b not in BACKENDS]
  if unknown:
    raise ValueError(f'logging.backends has unknown {unknown}; choose from '
                     f'{BACKENDS}')
  if 'jsonl' not in backends:
    raise ValueError("logging.backends must include 'jsonl': the run "
                     'summary and loc_opt.plot read metrics.jsonl')
  if 'wandb' in backends:
    _import_wandb()
  return backends


def _import_wandb():
  try:
    import wandb  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        "logging.backends includes 'wandb', but the wandb package is not "
        "installed: pip install wandb (or pip install 'loc_opt[wandb]'), "
        'or drop it from logging.backends') from e
  return wandb


def _kept_lines(path: pathlib.Path, step: int, step_of) -> list[str]:
  """The lines of ``path`` whose step is at most ``step`` (a line that does
  not parse, cut short by an interruption, is dropped)."""
  kept = []
  for line in path.read_text(encoding='utf-8').splitlines():
    try:
      if step_of(line) <= step:
        kept.append(line)
    except (ValueError, KeyError, IndexError):
      continue
  return kept


def _rewrite(path: pathlib.Path, lines: list[str]) -> None:
  tmp = path.with_suffix(path.suffix + '.tmp')
  tmp.write_text(''.join(k + '\n' for k in lines), encoding='utf-8')
  os.replace(tmp, path)


class CsvWriter:
  """``metrics.csv``: a ``step`` column and one column per metric, a row
  per logged step (empty where a metric was not logged). A metric seen for
  the first time rewrites the file with the wider header (a few times per
  run); rows past ``resume_step`` are dropped on resume."""

  def __init__(self, path: pathlib.Path, *, resume_step: int = 0):
    self.path = path
    self.columns, self.rows = ['step'], []
    if path.exists():
      lines = path.read_text(encoding='utf-8').splitlines()
      if lines:
        self.columns = next(csv.reader([lines[0]]))
        for row in csv.DictReader(lines):
          try:
            if int(row['step']) <= resume_step:
              self.rows.append(row)
          except (TypeError, ValueError):
            continue
    self._flush_all()

  def _flush_all(self) -> None:
    tmp = self.path.with_suffix('.csv.tmp')
    with open(tmp, 'w', newline='', encoding='utf-8') as f:
      w = csv.DictWriter(f, self.columns, restval='')
      w.writeheader()
      w.writerows(self.rows)
    os.replace(tmp, self.path)

  def write(self, record: dict[str, Any]) -> None:
    row = {k: ('' if v is None else v) for k, v in record.items()}
    self.rows.append(row)
    new = [k for k in row if k not in self.columns]
    if new:
      self.columns += new
      self._flush_all()
      return
    with open(self.path, 'a', newline='', encoding='utf-8') as f:
      csv.DictWriter(f, self.columns, restval='').writerow(row)

  def close(self) -> None:
    pass


class WandbWriter:
  """A Weights & Biases run for the workdir. Its id is kept in
  ``workdir/wandb_run_id``, so a resumed run continues the same W&B run."""

  def __init__(self, workdir: pathlib.Path, settings: dict[str, Any],
               run_config: dict[str, Any] | None):
    wandb = _import_wandb()
    id_path = workdir / 'wandb_run_id'
    if id_path.exists():
      run_id = id_path.read_text().strip()
    else:
      run_id = uuid.uuid4().hex[:12]
      id_path.write_text(run_id)
    self._run = wandb.init(
        project=settings.get('wandb_project') or 'loc_opt',
        name=settings.get('wandb_name') or workdir.name,
        mode=settings.get('wandb_mode') or 'online',
        id=run_id, resume='allow', dir=str(workdir), config=run_config)

  def write(self, step: int, scalars: dict[str, float]) -> None:
    self._run.log(scalars, step=step)

  def close(self) -> None:
    self._run.finish()


class MetricWriter:
  """Writes scalar metrics per step to ``metrics.jsonl`` and the chosen
  backends (see the module docstring).

  On resume, records past the restored step (written after the last
  checkpoint by the interrupted run) are dropped, so the files describe one
  run without duplicates.

  Args:
    workdir: the run directory.
    resume_step: the step the run resumes from (0: a fresh run).
    backends: a subset of :data:`BACKENDS` that includes ``'jsonl'``.
    settings: the ``logging`` config section (``wandb_project``,
      ``wandb_name``, ``wandb_mode``).
    run_config: the run's config as a dict, for W&B.
  """

  def __init__(self, workdir: str | os.PathLike, *, resume_step: int = 0,
               backends: tuple[str, ...] = ('jsonl', 'tensorboard'),
               settings: dict[str, Any] | None = None,
               run_config: dict[str, Any] | None = None):
    self.dir = pathlib.Path(workdir)
    self.dir.mkdir(parents=True, exist_ok=True)
    self.path = self.dir / 'metrics.jsonl'
    if self.path.exists():
      _rewrite(self.path, _kept_lines(
          self.path, resume_step, lambda l: json.loads(l).get('step', 0)))
    self._jsonl = open(self.path, 'a', encoding='utf-8')
    self._tb = (tensorboardX.SummaryWriter(str(self.dir / 'tensorboard'))
                if 'tensorboard' in backends else None)
    self._csv = (CsvWriter(self.dir / 'metrics.csv', resume_step=resume_step)
                 if 'csv' in backends else None)
    self._wandb = (WandbWriter(self.dir, settings or {}, run_config)
                   if 'wandb' in backends else None)

  def write(self, step: int, scalars: dict[str, Any]) -> None:
    record = {'step': int(step)}
    values = {}
    for k, v in scalars.items():
      v = float(v)
      values[k] = v
      record[k] = v if math.isfinite(v) else str(v)
      if self._tb is not None:
        self._tb.add_scalar(k, v, int(step))
    self._jsonl.write(json.dumps(record) + '\n')
    self._jsonl.flush()
    if self._csv is not None:
      self._csv.write({'step': int(step), **values})
    if self._wandb is not None:
      self._wandb.write(int(step), values)

  def close(self) -> None:
    self._jsonl.close()
    for sink in (self._tb, self._csv, self._wandb):
      if sink is not None:
        sink.close()


class NullWriter:
  """A :class:`MetricWriter` that writes nothing (processes other than 0
  of a multi-process run)."""

  def write(self, step: int, scalars: dict[str, Any]) -> None:
    del step, scalars

  def close(self) -> None:
    pass


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, Any]]:
  """Reads back ``metrics.jsonl`` of a workdir."""
  path = pathlib.Path(workdir) / 'metrics.jsonl'
  return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


class Progress:
  """A one-line progress bar on a terminal; plain log lines elsewhere."""

  def __init__(self, total: int, *, every: int = 10,
               stream: TextIO | None = None, enabled: bool = True):
    self.total = total
    self.every = max(1, every)
    self.stream = stream or sys.stderr
    self.enabled = enabled
    self.tty = enabled and hasattr(self.stream, 'isatty') and \
        self.stream.isatty()

  def update(self, step: int, *, loss: float, tokens_per_s: float,
             cross_worker_bytes: float) -> None:
    if not self.enabled:
      return
    if not self.tty and step % self.every and step != self.total:
      return
    frac = step / max(self.total, 1)
    width = 24
    bar = '#' * int(frac * width) + '.' * (width - int(frac * width))
    line = (f'step {step:>6}/{self.total} [{bar}] loss {loss:7.4f} | '
            f'{tokens_per_s / 1e3:7.1f}k tok/s | cross-worker '
            f'{format_bytes(cross_worker_bytes)}')
    if self.tty:
      self.stream.write('\r' + line)
      if step == self.total:
        self.stream.write('\n')
    else:
      self.stream.write(line + '\n')
    self.stream.flush()

  def message(self, text: str) -> None:
    if not self.enabled:
      return
    if self.tty:
      self.stream.write('\r\033[K')
    self.stream.write(text + '\n')
    self.stream.flush()
