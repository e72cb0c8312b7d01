"""The docs tables are what the committed results files render to.

Every table between ``<!-- results:<name>:<table> -->`` markers in
``docs/`` must equal what ``experiments.tables`` renders from
``docs/results/<name>.json``; every other Markdown table with a number in it
must be listed in HAND_WRITTEN with the reason it is not generated, so a new
hand-typed table of results fails here. Plain Python, no docs build.
"""

import json
import pathlib

import pytest

from experiments import _runs
from experiments import provenance
from experiments import regenerate
from experiments import tables

NOT_REGENERATED = ('from an earlier state of the code, not regenerated yet '
                   '(issue 17: rerun with python -m experiments.regenerate)')
REFERENCE = 'reference table of settings or formulas, not measurements'
STATUS = ('each claim\'s status, with figures quoted from the generated '
          'tables it links (claim 1\'s own are generated on the page)')
PRINTED = ('printed by the benchmark in the same run that wrote the results '
           'file beside it')

# (page under docs/, header row) -> why the table is typed by hand. Every
# table with that header on that page is covered.
HAND_WRITTEN = {
    ('decoupled_diloco.md', '| question | our default | the other reading '
     '(switch) |'): REFERENCE,
    ('decoupled_diloco.md', '| parameter | value | how it was set |'):
        REFERENCE,
    ('muloco.md', "| setting | paper / authors' code | "
     '`configs/muloco_lm.py` |'): REFERENCE,
    ('claims.md', '| # | claim | paper | command | status | evidence and '
     'why |'): STATUS,
    ('multihost.md', '| flag | behaviour |'): REFERENCE,
    ('moe.md', '| field | default | meaning |'): REFERENCE,
    ('moe.md', '| metric | meaning |'): REFERENCE,
    ('api/parallel_train.md', '| Piece | Paper | Config key | Bytes per '
     'sync, per worker | When to use |'): REFERENCE,
    ('resilience.md', '| item | what |'): REFERENCE,
    ('robust_aggregation.md', '| `aggregate` | what it computes | wire cost '
     'per sync (M workers, payload n) | codec |'): REFERENCE,
    ('sharding.md', '| field | values | effect |'): REFERENCE,
    ('sharding.md', '| value | per worker | where | sync program | '
     'checkpoint |'): REFERENCE,
    ('overlap.md', '| method | one program over | the collective\'s result '
     'feeds |'): REFERENCE,
    ('results/decoupled.md', '| run | merges | learners per merge | final '
     'eval loss | tokens (M) | simulated s | loss at K=1+grace time | loss '
     'at its tokens |'): PRINTED,
    ('results/dropout.md', '| run | syncs | workers left out | final eval '
     'loss | vs. no dropout |'): PRINTED,
    ('results/goodput.md', '| policy | 150k | 300k | 600k | 1.2M | 2.4M |'):
        PRINTED,
    ('results/goodput.md', '| M | N | N/M | ours: Decoupled | ours: elastic '
     'DP at N/M | paper: Decoupled | paper: elastic DP at N/M |'): PRINTED,
    ('results/hierarchical.md', '| run | final eval loss | MB/worker between '
     'groups | MB/worker inside groups | simulated s | utilization |'):
        PRINTED,
    ('results/muloco.md', '| run | final eval loss | total cross-worker '
     'bytes | bytes / worker / sync | bits / param / sync |'): PRINTED,
    ('results/goodput.md', '| M | 150k | 300k | 600k | 1.2M | 2.4M |'):
        PRINTED,
    ('results/goodput.md', '| M | N | useful | overwritten | lost at rejoin '
     '| down | idle | merges | skipped | per merge | wait |'): PRINTED,
    ('faults.md', '| where | what happens | counted in |'): REFERENCE,
    ('resilience.md', '| fault | what happens | exit code | test |'):
        'each fault, its exit code and the test that shows it: behaviour, '
        'not measurements',
    ('sharding.md', '| option | default | on CPU | on GPU / TPU | why |'):
        REFERENCE,
    ('sharding.md', '| size, remat | before | after | vs ideal before '
     '| after |'):
        'before / after of the fsdp x tensor rows across a code change: the '
        'after figures are the generated scale_sync table, the before ones '
        'its results file as committed before the change',
    ('sharding.md', '| `outer.method` | sync temp MiB before | after | sync '
     'within-worker MiB before | after (inner: 3,904) |'):
        'compile-only memory of a one-off probe at ~100M before and after '
        'the sharded sync (commands beside the table); the ~1B / ~8B '
        'figures are generated (scale_sync)',
}


def _pages():
  return [(str(p.relative_to(tables.DOCS)), p.read_text())
          for p in tables.docs_pages()]


@pytest.mark.parametrize('page', [p for p, text in _pages()
                                  if tables.marked(text)])
def test_marked_tables_equal_their_results(page):
  text = (tables.DOCS / page).read_text()
  for name, table, start, end in tables.marked(text):
    expected = tables.block(name, table)
    assert text[start:end] == expected, (
        f'docs/{page}: the table {name}:{table} differs from what '
        f'docs/results/{name}.json renders to; run python -m '
        'experiments.tables (or regenerate the results)')


def test_every_table_with_numbers_is_generated_or_listed():
  unlisted, seen = [], set()
  for page, text in _pages():
    for header, line in tables.unsourced_tables(text):
      if (page, header) in HAND_WRITTEN:
        seen.add((page, header))
      else:
        unlisted.append(f'docs/{page}:{line + 1}: {header}')
  assert not unlisted, (
      'tables with numbers that are neither generated from results (between '
      '<!-- results:name:table --> markers) nor listed in HAND_WRITTEN with '
      'a reason:\n' + '\n'.join(unlisted))
  stale = sorted(set(HAND_WRITTEN) - seen)
  assert not stale, f'HAND_WRITTEN entries without a table: {stale}'


def test_unregenerated_tables_say_so_in_the_docs():
  """A table from an earlier state of the code says so in its section,
  between the heading above it and the table."""
  silent = []
  for page, text in _pages():
    lines = text.split('\n')
    for header, first in tables.unsourced_tables(text):
      if HAND_WRITTEN.get((page, header)) != NOT_REGENERATED:
        continue
      top = max([i for i in range(first) if lines[i].startswith('#')],
                default=0)
      if 'not regenerated yet' not in ' '.join(lines[top:first]):
        silent.append(f'docs/{page}:{first + 1}: {header}')
  assert not silent, ('tables from an earlier state of the code whose '
                      "section does not say 'not regenerated yet':\n"
                      + '\n'.join(silent))


def test_published_results_files_carry_provenance():
  names = {name for _, text in _pages()
           for name, _, _, _ in tables.marked(text)}
  assert names, 'no generated tables in docs/'
  for name in sorted(names):
    data = tables.load(name)
    p = data['provenance']
    assert len(p['commit']) == 40 and isinstance(p['dirty'], bool)
    assert set(provenance.PACKAGES) <= set(p['packages'])
    assert p['packages']['python'] and p['device']['device_count'] >= 1
    assert data['wall_seconds'] > 0 and data['command'][:2] == ['python',
                                                                '-m']
    for run in data['runs']:
      assert run['config'] and 'commit' in run['provenance'], run['label']


def _fake_results(tmp_path, loss):
  data = {
      'format': _runs.FORMAT, 'benchmark': 'compare_dp_diloco',
      'command': ['python', '-m', 'experiments.compare_dp_diloco'],
      'provenance': {'commit': 'a' * 40, 'dirty': False,
                     'packages': {'jax': '1', 'flax': '2', 'optax': '3'},
                     'device': {'device_count': 8, 'device_kind': 'cpu',
                                'host_cpus': 2},
                     'time_utc': '2026-01-02T03:04:05+00:00'},
      'wall_seconds': 1.0,
      'runs': [{'label': 'data-parallel', 'config': {'a': 1},
                'provenance': {'commit': 'b' * 40, 'dirty': True}}],
      'results': {
          'setup': {'num_steps': 10, 'batch_size': 2, 'seq_len': 4,
                    'workers': 4, 'devices_per_worker': 2,
                    'outer_learning_rate': 0.7, 'outer_momentum': 0.9},
          'rows': [{'label': 'data-parallel', 'method': 'data_parallel',
                    'sync_every': 1, 'final_eval_loss': loss, 'steps': 10,
                    'syncs': 0, 'cross_worker_bytes': 2048}]}}
  (tmp_path / 'compare_dp_diloco.json').write_text(json.dumps(data))


def test_rerender_fills_and_detects_a_changed_number(tmp_path):
  _fake_results(tmp_path, 1.23456)
  page = ('intro\n\n<!-- results:compare_dp_diloco:main -->\nold\n'
          '<!-- /results -->\nafter\n')
  new = tables.rerender(page, tmp_path)
  assert '| data-parallel | 1 | **1.2346** | 2,048 (2.0 KiB) | 10 ' \
         'all-reduces |' in new
  assert '`bbbbbbbbbb` (dirty)' in new and new.endswith('after\n')
  assert tables.rerender(new, tmp_path) == new  # Rendering is stable.
  _fake_results(tmp_path, 1.5)
  assert tables.rerender(new, tmp_path) != new
  assert tables.unsourced_tables(new) == []
  assert len(tables.unsourced_tables(page + new.split('-->', 1)[1])) == 1


def test_bad_markers_and_names_are_refused(tmp_path):
  with pytest.raises(ValueError, match='missing'):
    tables.marked('<!-- results:x:main -->\n| a |\n')
  with pytest.raises(FileNotFoundError, match='nothing_here'):
    tables.load('nothing_here', tmp_path)
  (tmp_path / 'old.json').write_text('[1, 2]')
  with pytest.raises(ValueError, match='provenance'):
    tables.load('old', tmp_path)
  with pytest.raises(KeyError, match='no renderer'):
    tables.render('compare_dp_diloco', 'nope', {})


def test_tables_outside_markers_and_in_code_are_told_apart():
  text = ('| a | b |\n|---|---|\n| x | 1 |\n\n```\n| c | d |\n|---|---|\n'
          '| y | 2 |\n```\n\n| e | f |\n|:--|--:|\n| no | digits |\n')
  found = tables.markdown_tables(text)
  assert [(h, n) for h, _, _, n in found] == [('| a | b |', True),
                                              ('| e | f |', False)]
  assert tables.unsourced_tables(text) == [('| a | b |', 0)]


def test_every_benchmark_module_exists_and_names_its_page():
  for name, b in regenerate.BENCHMARKS.items():
    source = (tables.REPO / 'experiments' / f'{b.module}.py').read_text()
    assert f"'{name}'" in source, f'{b.module} does not write {name}.json'
    assert (tables.REPO / b.doc).exists(), name


def test_every_benchmark_writes_a_results_file():
  """Every program under experiments/ but the launcher and the helpers
  writes its numbers through _runs.write (which adds the provenance)."""
  helpers = {'__init__', '_runs', '_claims', '_ckpt_tables', '_profile',
             '_compress_tables', '_fault_tables', '_sharding_tables',
             '_small_tables', '_train_tables', 'provenance', 'tables',
             'regenerate', 'train', 'corpus_backfill',
             '_frontier_tables', '_registry', '_async_tables',
             '_frontier_runs', '_chaos_schedule', '_sync_chaos',
             '_chaos_predict', '_outer_sweep', '_schedules'}
  silent = [p.name for p in sorted((tables.REPO / 'experiments').glob('*.py'))
            if p.stem not in helpers and '_runs.write(' not in p.read_text()]
  assert not silent, f'benchmarks without a results file: {silent}'


def test_regenerate_refuses_unknown_benchmarks():
  with pytest.raises(SystemExit):
    regenerate.main(['--workdir=/nonexistent', '--only=nope'])


def test_provenance_record_round_trips(tmp_path):
  record = provenance.record(tmp_path, wall_seconds=1.5)
  assert provenance.read(tmp_path) == json.loads(json.dumps(record))
  assert record['wall_seconds'] == 1.5
  assert record['commit'] is None or len(record['commit']) == 40
  assert record['packages']['jax'] and record['device']['device_count'] == 8
  assert provenance.read(tmp_path / 'absent') is None


def test_write_records_runs_configs_and_provenance(tmp_path, monkeypatch):
  import ml_collections  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(_runs, 'RUNS', [])
  run_dir = tmp_path / 'run'
  record = provenance.record(run_dir, wall_seconds=2.0)
  config = ml_collections.ConfigDict({'num_steps': 3, 'outer': {'lr': 0.7}})
  _runs.remember(config, run_dir, 'a run', record,
                 {'final_eval_loss': 1.5, 'step': 3})
  _runs.remember(config, tmp_path / 'old', 'old run', None)
  _runs.write(tmp_path, 'bench', '| a |\n', {'rows': [1]}, extra=7)
  data = json.loads((tmp_path / 'bench.json').read_text())
  assert data['results'] == {'rows': [1]} and data['extra'] == 7
  assert data['benchmark'] == 'bench' and data['format'] == _runs.FORMAT
  assert data['provenance']['packages']['optax']
  first, second = data['runs']
  assert first['config'] == {'num_steps': 3, 'outer': {'lr': 0.7}}
  assert first['provenance']['wall_seconds'] == 2.0
  assert first['final_eval_loss'] == 1.5
  assert 'unknown' in second['provenance']
  assert (tmp_path / 'bench.md').read_text() == '| a |\n'
