"""Metrics: JSONL and TensorBoard event files, and a terminal progress bar.

TensorBoard files are written with ``tensorboardX``, which does not need
TensorFlow.
"""

import json
import math
import os
import pathlib
import sys
from typing import Any, TextIO

import tensorboardX


def format_bytes(n: float) -> str:
  """``1536 -> '1.5 KiB'``."""
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if abs(n) < 1024 or unit == 'TiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.1f} {unit}'
    n /= 1024
  return f'{n:.1f} TiB'


class MetricWriter:
  """Writes scalar metrics per step to ``metrics.jsonl`` and TensorBoard.

  On resume, records past the restored step (written after the last
  checkpoint by the interrupted run) are dropped, so the files describe one
  run without duplicates.
  """

  def __init__(self, workdir: str | os.PathLike, *, resume_step: int = 0):
    self.dir = pathlib.Path(workdir)
    self.dir.mkdir(parents=True, exist_ok=True)
    self.path = self.dir / 'metrics.jsonl'
    self._truncate_after(resume_step)
    self._jsonl = open(self.path, 'a', encoding='utf-8')
    self._tb = tensorboardX.SummaryWriter(str(self.dir / 'tensorboard'))

  def _truncate_after(self, step: int) -> None:
    if not self.path.exists():
      return
    kept = []
    for line in self.path.read_text(encoding='utf-8').splitlines():
      try:
        if json.loads(line).get('step', 0) <= step:
          kept.append(line)
      except json.JSONDecodeError:
        continue  # a line cut short by the interruption
    tmp = self.path.with_suffix('.jsonl.tmp')
    tmp.write_text(''.join(k + '\n' for k in kept), encoding='utf-8')
    os.replace(tmp, self.path)

  def write(self, step: int, scalars: dict[str, Any]) -> None:
    record = {'step': int(step)}
    for k, v in scalars.items():
      v = float(v)
      record[k] = v if math.isfinite(v) else str(v)
      self._tb.add_scalar(k, v, int(step))
    self._jsonl.write(json.dumps(record) + '\n')
    self._jsonl.flush()

  def close(self) -> None:
    self._jsonl.close()
    self._tb.close()


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
