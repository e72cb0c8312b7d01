r"""Adds a corpus record to results files written before runs kept one.

  python -m experiments.corpus_backfill [--results_dir=docs/results] [--dry_run]

A results file of :func:`experiments._runs.write` holds a ``corpus`` record
(:func:`experiments._runs.corpus_record`); older files do not. For each run
of such a file this recomputes the fingerprint (:mod:`loc_opt.data.corpus`)
only where it can be known: the run read the default corpus (the standard
library, no ``source_dirs`` or corpus file) and its provenance names the
Python version of this interpreter, whose standard library is read here.
Such a fingerprint carries ``derived``, saying so. Every other run (another
Python, a copied source directory) is left without one, and the file's
record lists it as unknown, which ``python -m experiments.tables --check``
reports. A file without runs gets ``reads_text`` False when its program
reads no text (:data:`READS_NO_TEXT`), else None (unknown). Files that
have a record are left alone, unless ``--unknown_runs``: then their runs
without a fingerprint (trained before fingerprints were kept, and read back
since) get one where it can be known, and the record is made again.

  python -m experiments.corpus_backfill --unknown_runs \
    --results_dir=docs/results --only=claims_long
"""

import argparse
import datetime
import json
import pathlib
import platform
import sys
from typing import Any

from experiments import _runs
from experiments import tables

# Programs (experiments.<name>) that read no text: they compile programs or
# count bytes without the data (experiment.build_experiment builds
# everything but the data).
READS_NO_TEXT = frozenset({
    'goodput', 'overlap_gpu', 'robust_aggregation', 'hierarchical_bytes',
    'scale_check', 'outer_state_memory', 'sharded_sync_bytes', 'wire_bytes'})


def _derive(run: dict[str, Any], today: str) -> dict[str, Any] | None:
  """The fingerprint of a run's corpus where this machine can know it."""
  from loc_opt import data as data_lib  # pylint: disable=g-import-not-at-top
  data = run.get('config', {}).get('data')
  python = run.get('provenance', {}).get('packages', {}).get('python')
  if (not data or data.get('dataset') != 'local_text'
      or data.get('source_dirs') or data.get('corpus_file')
      or python != platform.python_version()):
    return None
  fp = data_lib.corpus_fingerprint(data)
  fp['derived'] = (
      f'recomputed {today} by experiments.corpus_backfill from the Python '
      f'{python} standard library of this machine: the run recorded Python '
      f'{python} and the default corpus, not its text')
  return {**fp, 'from_step': 0}


def backfill(data: dict[str, Any], today: str) -> dict[str, Any]:
  """The ``corpus`` record for results ``data`` (its runs get theirs)."""
  runs = data.get('runs', [])
  if not runs:
    module = data.get('command', ['', '', ''])[2].removeprefix(
        'experiments.')
    if module in READS_NO_TEXT:
      return {'fingerprints': [], 'unknown_runs': [], 'reads_text': False,
              'note': f'experiments.{module} reads no text'}
    return {'fingerprints': [], 'unknown_runs': [], 'reads_text': None,
            'note': f'experiments.{module} read the text of its config '
                    'before corpus fingerprints were kept'}
  reasons = set()
  for run in runs:
    c = run.get('corpus')
    if c is not None and c.get('from_step', 0) >= (run.get('steps') or 1):
      run.pop('corpus')  # recorded when read back after its last step
    if run.get('corpus') is None:
      run['corpus'] = _derive(run, today)
      if run['corpus'] is None:
        dirs = run.get('config', {}).get('data', {}).get('source_dirs')
        python = run.get('provenance', {}).get('packages', {}).get('python')
        reasons.add(f'source_dirs {dirs} read by Python {python}' if dirs
                    else f'the standard library of Python {python}')
  record = _runs.corpus_record(runs)
  if record['unknown_runs']:
    record['note'] = ('runs trained before corpus fingerprints were kept, '
                      'on ' + '; '.join(sorted(reasons)))
  return record


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--results_dir', type=pathlib.Path,
                      default=tables.RESULTS)
  parser.add_argument('--dry_run', action='store_true')
  parser.add_argument('--unknown_runs', action='store_true',
                      help='Also files with a record: fingerprint their '
                      'runs that have none, where it can be known.')
  parser.add_argument('--only', default='',
                      help='Comma-separated results names (NAME.json).')
  args = parser.parse_args(argv)
  only = {n for n in args.only.split(',') if n}
  today = datetime.date.today().isoformat()
  for path in sorted(args.results_dir.rglob('*.json')):
    if only and path.stem not in only:
      continue
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or (
        'corpus' in data and not (args.unknown_runs
                                  and data['corpus'].get('unknown_runs'))):
      continue
    data['corpus'] = backfill(data, today)
    rec = data['corpus']
    print(f'{path}: {len(rec["fingerprints"])} fingerprints, '
          f'{len(rec["unknown_runs"])} unknown runs, reads_text '
          f'{rec["reads_text"]}')
    if not args.dry_run:  # in the file's own indentation
      lines = path.read_text().split('\n', 2)
      indent = (len(lines[1]) - len(lines[1].lstrip(' ')) or 2
                if len(lines) > 1 else None)
      path.write_text(json.dumps(data, indent=indent, default=str))
  return 0


if __name__ == '__main__':
  sys.exit(main())
