"""Results files name their corpus; experiments.tables --check compares it
with this machine's (experiments.tables.corpus_report)."""

import json
import platform
import subprocess

from experiments import _runs
from experiments import corpus_backfill
from experiments import tables
from loc_opt import data as data_lib
from loc_opt.data import corpus


def _source(tmp_path):
  root = tmp_path / 'src'
  for i in range(6):
    (root / f'm{i}.py').parent.mkdir(parents=True, exist_ok=True)
    (root / f'm{i}.py').write_text(f'x = {i}\n' * (i + 3))
  config = data_lib.get_config()
  config.source_dirs = (str(root),)
  return root, config


def _results(path, runs, record='auto'):
  value = {'provenance': {}, 'results': {}, 'runs': runs}
  if record == 'auto':
    record = _runs.corpus_record(runs)
  if record is not None:
    value['corpus'] = record
  path.write_text(json.dumps(value))


def test_report_names_other_text_unknown_runs_and_missing_records(tmp_path):
  root, config = _source(tmp_path)
  fp = data_lib.corpus_fingerprint(config)
  here = {'label': 'here', 'steps': 10, 'corpus': {**fp, 'from_step': 0}}
  results = tmp_path / 'results'
  results.mkdir()
  _results(results / 'same.json', [here])
  assert tables.corpus_report(results) == []
  # The same data fields, other bytes on this machine: a mismatch.
  (root / 'm0.py').write_text('changed\n')
  lines = tables.corpus_report(results)
  assert len(lines) == 1 and lines[0].startswith('same.json: made on')
  assert fp['sha256'][:12] in lines[0]
  assert data_lib.corpus_fingerprint(config)['sha256'][:12] in lines[0]
  # A run that never recorded its text, a file without a record, a corpus
  # that is not here.
  _results(results / 'old.json', [{'label': 'old', 'steps': 10,
                                   'corpus': None}])
  _results(results / 'bare.json', [], record=None)
  gone = {**fp, 'data': {**fp['data'], 'source_dirs': [str(tmp_path / 'x')]}}
  _results(results / 'gone.json', [{'label': 'g', 'steps': 10,
                                    'corpus': {**gone, 'from_step': 0}}])
  text = '\n'.join(tables.corpus_report(results))
  assert 'old.json: 1 run on an unrecorded corpus' in text
  assert 'bare.json: no corpus record' in text
  assert 'gone.json: made on' in text and 'not on this machine' in text
  assert tables.corpus_report(results, names=['old']) == [
      'old.json: 1 run on an unrecorded corpus']


def test_corpus_record_and_source_line_phrase(tmp_path):
  _, config = _source(tmp_path)
  fp = data_lib.corpus_fingerprint(config)
  runs = [{'label': 'a', 'steps': 8, 'corpus': {**fp, 'from_step': 0}},
          {'label': 'b', 'steps': 8, 'corpus': {**fp, 'from_step': 0}},
          {'label': 'c', 'steps': 8, 'corpus': {**fp, 'from_step': 8}},
          {'label': 'd', 'steps': 8, 'corpus': None}]
  record = _runs.corpus_record(runs)
  assert record['fingerprints'] == [fp]  # once, without from_step
  assert record['unknown_runs'] == ['c', 'd'] and record['reads_text']
  phrase = tables._corpus_phrase({'corpus': record})
  assert phrase == (f'; text: local files (sha256 `{fp["sha256"][:12]}`), '
                    '2 runs on unrecorded text')
  assert tables._corpus_phrase({'corpus': {'reads_text': False}}) == ''
  assert tables._corpus_phrase({}) == '; text: not recorded'


def test_backfill_derives_only_what_this_machine_can_know(tmp_path):
  here = platform.python_version()
  default = {'dataset': 'local_text', 'source_dirs': [],
             'max_bytes': 100_000}
  runs = [{'label': 'cpu', 'config': {'data': default},
           'provenance': {'packages': {'python': here}}},
          {'label': 'gpu', 'config': {'data': {**default, 'source_dirs':
                                               ['.copy/stdlib']}},
           'provenance': {'packages': {'python': '3.12.3'}}},
          {'label': 'other', 'config': {'data': default},
           'provenance': {'packages': {'python': '3.13.0'}}}]
  record = corpus_backfill.backfill({'runs': runs}, '2026-01-01')
  assert [r['corpus'] is None for r in runs] == [False, True, True]
  assert runs[0]['corpus']['sha256'] == data_lib.corpus_fingerprint(
      default)['sha256']
  assert 'recomputed 2026-01-01' in runs[0]['corpus']['derived']
  assert record['unknown_runs'] == ['gpu', 'other']
  assert '3.13.0' in record['note'] and '.copy/stdlib' in record['note']
  assert corpus_backfill.backfill(
      {'command': ['python', '-m', 'experiments.wire_bytes']},
      '2026-01-01')['reads_text'] is False
  # A run recorded only when read back after its last step is unknown until
  # --unknown_runs derives it.
  late = {'label': 'late', 'steps': 8, 'config': {'data': default},
          'provenance': {'packages': {'python': here}},
          'corpus': {**runs[0]['corpus'], 'from_step': 8}}
  path = tmp_path / 'late.json'
  path.write_text(json.dumps({'runs': [late], 'results': {},
                              'corpus': _runs.corpus_record([late])}))
  assert json.loads(path.read_text())['corpus']['unknown_runs'] == ['late']
  corpus_backfill.main([f'--results_dir={tmp_path}', '--unknown_runs'])
  data = json.loads(path.read_text())
  assert data['corpus']['unknown_runs'] == []
  assert data['runs'][0]['corpus']['from_step'] == 0
  assert 'derived' in data['runs'][0]['corpus']


def test_backfill_reads_a_runless_files_config_at_its_commit():
  """A timing benchmark's file has no runs: its text is its config's data
  fields at the commit that made it, read here only without data flags."""
  head = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=tables.REPO,
                        capture_output=True, text=True, check=True).stdout
  command = ['python', '-m', 'experiments.step_ab',
             '--config=configs/diloco_lm.py', '--config.model.num_layers=4']
  fields = corpus_backfill.config_data_at(command, head.strip())
  assert fields['max_bytes'] == 8_000_000 and fields['seq_len'] == 128
  here = platform.python_version()
  data = {'command': command, 'provenance': {
      'commit': head.strip(), 'dirty': False,
      'packages': {'python': here}}}
  record = corpus_backfill.backfill(data, '2026-01-01')
  assert record['reads_text'] is True and not record['unknown_runs']
  assert record['fingerprints'][0]['sha256'] == data_lib.corpus_fingerprint(
      fields)['sha256']
  assert 'derived' in record['fingerprints'][0]
  # A data flag, a dirty tree or another Python: the text stays unknown.
  assert corpus_backfill.config_data_at(
      command + ['--config.data.max_bytes=100'], head.strip()) is None
  for prov in ({'dirty': True}, {'packages': {'python': '3.13.0'}}):
    unknown = corpus_backfill.backfill(
        {**data, 'provenance': {**data['provenance'], **prov}}, '2026-01-01')
    assert unknown['reads_text'] is None and not unknown['fingerprints']
