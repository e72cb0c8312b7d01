"""Helpers shared by the inner-optimizer and schedule experiment programs."""

import json
import os
import pathlib
from typing import Any

import ml_collections


def variant(base: ml_collections.ConfigDict,
            **overrides: Any) -> ml_collections.ConfigDict:
  """A copy of ``base`` with dotted fields (``a__b`` for ``a.b``) replaced."""
  from loc_opt.train import config as cfg_lib  # pylint: disable=g-import-not-at-top
  return cfg_lib.with_overrides(base, overrides, sep='__')


def run(config: ml_collections.ConfigDict, workdir: str | os.PathLike,
        label: str) -> dict[str, Any]:
  """Trains (or resumes, or reads a finished run) and prints one line."""
  from loc_opt import train  # pylint: disable=g-import-not-at-top
  summary = train.train_and_evaluate(config, workdir)
  summary.pop('state', None)
  summary['curve'] = curve(workdir)
  print(f'{label:<34} steps {summary["step"]:>4}  final eval loss '
        f'{summary["final_eval_loss"]:.4f}', flush=True)
  return summary


def curve(workdir: str | os.PathLike) -> dict[str, dict[int, float]]:
  """``{'eval': {step: loss}, 'train': {step: loss}}`` of a run."""
  from loc_opt import train  # pylint: disable=g-import-not-at-top
  out = {'eval': {}, 'train': {}}
  for r in train.read_metrics(workdir):
    for key, name in (('eval/loss', 'eval'), ('train/loss', 'train')):
      if key in r and isinstance(r[key], (int, float)):
        out[name][int(r['step'])] = float(r[key])
  return out


def write(workdir: str | os.PathLike, name: str, markdown: str,
          results: Any) -> None:
  """Writes ``name.md`` and ``name.json`` into ``workdir`` and prints."""
  path = pathlib.Path(workdir)
  path.mkdir(parents=True, exist_ok=True)
  (path / f'{name}.md').write_text(markdown)
  (path / f'{name}.json').write_text(json.dumps(results, indent=2,
                                                default=str))
  print('\n' + markdown)
  print(f'wrote {path / (name + ".md")}, {path / (name + ".json")}')


def require_optimizers(names) -> None:
  """Raises a usage error naming any of ``names`` not in the registry."""
  from absl import app  # pylint: disable=g-import-not-at-top
  from loc_opt import inner  # pylint: disable=g-import-not-at-top
  missing = [n for n in names if n not in inner.OPTIMIZERS]
  if missing:
    raise app.UsageError(f'optimizers {missing} are not in '
                         f'loc_opt.inner.OPTIMIZERS {sorted(inner.OPTIMIZERS)}')


def setup(cpu_devices: int) -> None:
  """Quiet logs and ``cpu_devices`` virtual CPU devices; call first in
  ``main``, before anything touches a JAX backend."""
  from absl import logging  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.WARNING)
  jax.config.update('jax_num_cpu_devices', cpu_devices)


def chosen(names, known, flag: str = '--runs') -> list[str]:
  """``names`` (all of ``known`` when empty), or a usage error naming the
  unknown ones."""
  from absl import app  # pylint: disable=g-import-not-at-top
  names = list(names or known)
  unknown = sorted(set(names) - set(known))
  if unknown:
    raise app.UsageError(f'unknown {flag} {unknown}; choose from '
                         f'{list(known)}')
  return names

