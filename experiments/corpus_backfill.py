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
reads no text (:data:`READS_NO_TEXT`); else, when its provenance names this
interpreter's Python, a clean commit and no ``--config.data.*`` flag, the
fingerprint of the data fields of its config as that commit wrote them
(:func:`config_data_at`, read from ``git archive`` of the commit), marked
``derived``; else None (unknown). Files that
have a record are left alone, unless ``--unknown_runs``: then their runs
without a fingerprint (trained before fingerprints were kept, and read back
since) get one where it can be known, and the record is made again (a
runless file whose text was unknown too).

  python -m experiments.corpus_backfill --unknown_runs \
    --results_dir=docs/results --only=claims_long
"""

import argparse
import datetime
import io
import json
import pathlib
import platform
import re
import subprocess
import sys
import tarfile
import tempfile
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


# Prints the data fields of a config file (argv: path[:arg]), run inside an
# archive of the commit that made a results file.
_PRINT_DATA = """
import importlib.util, json, sys
path, _, arg = sys.argv[1].partition(':')
spec = importlib.util.spec_from_file_location('config_at_commit', path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
config = module.get_config(arg) if arg else module.get_config()
print(json.dumps(config.data.to_dict(), default=list))
"""


def config_data_at(command: list[str], commit: str,
                   repo: pathlib.Path = tables.REPO) -> dict[str, Any] | None:
  """The data fields a program's run of ``command`` read at ``commit``.

  The config is ``--config=`` of the command, else the program's default
  (its ``DEFINE_config_file('config', ...)`` at that commit); it is loaded
  from an archive of the commit by this interpreter. None when the command
  sets data fields by flag (``--config.data.*``) or the commit or config
  cannot be read.
  """
  if any(a.startswith('--config.data') for a in command) or len(command) < 3:
    return None
  config = next((a.split('=', 1)[1] for a in command
                 if a.startswith('--config=')), None)

  def show(path):
    got = subprocess.run(['git', 'show', f'{commit}:{path}'], cwd=repo,
                         capture_output=True, text=True, check=False)
    return got.stdout if got.returncode == 0 else None

  if config is None:
    source = show(command[2].replace('.', '/') + '.py') or ''
    found = re.search(r"DEFINE_config_file\(\s*'config',\s*'([^']+)'", source)
    config = found and found.group(1)
  if not config:
    return None
  archive = subprocess.run(['git', 'archive', commit], cwd=repo,
                           capture_output=True, check=False)
  if archive.returncode != 0:
    return None
  with tempfile.TemporaryDirectory() as tmp:
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
      tar.extractall(tmp, filter='data')
    got = subprocess.run([sys.executable, '-c', _PRINT_DATA, config],
                         cwd=tmp, env={'PYTHONPATH': tmp, 'PATH': ''},
                         capture_output=True, text=True, check=False)
  return json.loads(got.stdout) if got.returncode == 0 else None


def _derive_runless(data: dict[str, Any], today: str) -> dict[str, Any] | None:
  """A runless file's corpus record where this machine can know its text."""
  from loc_opt import data as data_lib  # pylint: disable=g-import-not-at-top
  prov = data.get('provenance', {})
  python = prov.get('packages', {}).get('python')
  if (python != platform.python_version() or prov.get('dirty', True)
      or not prov.get('commit')):
    return None
  fields = config_data_at(data.get('command', []), prov['commit'])
  if (not fields or fields.get('dataset') != 'local_text'
      or fields.get('source_dirs') or fields.get('corpus_file')):
    return None
  fp = data_lib.corpus_fingerprint(fields)
  fp['derived'] = (
      f'recomputed {today} by experiments.corpus_backfill from the Python '
      f'{python} standard library of this machine: the file recorded Python '
      f'{python}, commit {prov["commit"][:10]} and no data flags, and the '
      'data fields are its config\'s at that commit, not its text')
  return {'fingerprints': [fp], 'unknown_runs': [], 'reads_text': True}


def backfill(data: dict[str, Any], today: str) -> dict[str, Any]:
  """The ``corpus`` record for results ``data`` (its runs get theirs)."""
  runs = data.get('runs', [])
  if not runs:
    module = data.get('command', ['', '', ''])[2].removeprefix(
        'experiments.')
    if module in READS_NO_TEXT:
      return {'fingerprints': [], 'unknown_runs': [], 'reads_text': False,
              'note': f'experiments.{module} reads no text'}
    derived = _derive_runless(data, today)
    if derived is not None:
      return derived
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
    record = data.get('corpus') if isinstance(data, dict) else None
    unknown = record is not None and (record.get('unknown_runs')
                                      or record.get('reads_text') is None)
    if not isinstance(data, dict) or (
        'corpus' in data and not (args.unknown_runs and unknown)):
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
