"""``python -m loc_opt.plot`` on a tiny run (and a copy labelled as another
method): the PNGs, and the metrics they read (bytes, simulated clock, CSV)."""

import csv
import json
import math
import shutil

import pytest

from loc_opt import plot
from loc_opt.train import loop
from tests.train import _helpers

PNG = b'\x89PNG\r\n\x1a\n'


@pytest.fixture(scope='module')
def run_dir(tmp_path_factory):
  """A 12-step DiLoCo run logging to JSONL and CSV."""
  root = tmp_path_factory.mktemp('plot')
  config = _helpers.tiny_config(str(root / 'tfds'), **{
      'logging.backends': ('jsonl', 'csv')})
  loop.train_and_evaluate(config, root / 'diloco')
  return root / 'diloco'


def test_metrics_carry_bytes_and_simulated_clock(run_dir):
  records = [json.loads(l) for l in
             (run_dir / 'metrics.jsonl').read_text().splitlines()]
  summary = json.loads((run_dir / 'summary.json').read_text())
  last = records[-1]
  assert last['step'] == summary['step'] == 12
  assert last['comm/cross_worker_bytes_total'] == summary['cross_worker_bytes']
  # The logged clock is the summary's, less any collective still in flight
  # at the end (DiLoCo has none: it waits for each sync).
  for bw in ('1gbps', '100gbps'):
    assert math.isclose(last[f'wallclock/{bw}_seconds'],
                        summary['wallclock'][bw]['seconds'], rel_tol=1e-9)
  clock = [r['wallclock/1gbps_seconds'] for r in records]
  assert clock == sorted(clock) and clock[0] > 0
  # The slow link costs more time once a sync has happened.
  assert last['wallclock/1gbps_seconds'] > last['wallclock/100gbps_seconds']
  assert not (run_dir / 'tensorboard').exists()  # not among the backends


def test_csv_has_the_jsonl_values(run_dir):
  records = [json.loads(l) for l in
             (run_dir / 'metrics.jsonl').read_text().splitlines()]
  with open(run_dir / 'metrics.csv', newline='') as f:
    rows = list(csv.DictReader(f))
  assert [int(r['step']) for r in rows] == [r['step'] for r in records]
  for row, record in zip(rows, records):
    for key, value in record.items():
      assert float(row[key]) == pytest.approx(float(value))
    # eval/loss is logged at some steps only: empty elsewhere.
    if 'eval/loss' not in record:
      assert row['eval/loss'] == ''


def test_plot_command_writes_the_pngs(run_dir, tmp_path, capsys):
  other = tmp_path / 'dp'
  shutil.copytree(run_dir, other, ignore=shutil.ignore_patterns('checkpoints'))
  summary = json.loads((other / 'summary.json').read_text())
  (other / 'summary.json').write_text(
      json.dumps({**summary, 'method': 'data_parallel'}))
  assert plot.main([str(run_dir), str(other), '--out',
                    str(tmp_path / 'png')]) == 0
  names = {'loss_vs_step.png', 'loss_vs_bytes.png',
           'loss_vs_wallclock_1gbps.png', 'loss_vs_wallclock_100gbps.png'}
  written = capsys.readouterr().out.split()
  assert {p.rsplit('/', 1)[-1] for p in written} == names
  for name in names:
    data = (tmp_path / 'png' / name).read_bytes()
    assert data.startswith(PNG) and len(data) > 5000, name
  runs = [plot.read_run(run_dir), plot.read_run(other)]
  labels = plot._labels(runs)  # pylint: disable=protected-access
  assert labels == ['diloco', 'data_parallel']


def test_plot_errors_name_the_problem(tmp_path, capsys):
  assert plot.main([str(tmp_path), '--out', str(tmp_path / 'o')]) == 1
  assert 'has no metrics.jsonl' in capsys.readouterr().err
  with pytest.raises(ValueError, match='loss must be one of'):
    plot.plot_runs([tmp_path], tmp_path, loss='test')
