"""Metric backends: CSV rows and resume, W&B without the package (a clear
error) and with a stand-in module (no network), and config validation."""

import csv
import json
import sys
import types

import ml_collections
import pytest

from loc_opt.train import metrics


def _config(backends):
  c = ml_collections.ConfigDict()
  c.logging = ml_collections.ConfigDict({'backends': backends})
  return c


def _rows(path):
  with open(path, newline='') as f:
    return list(csv.DictReader(f))


def test_csv_widens_for_new_metrics_and_truncates_on_resume(tmp_path):
  w = metrics.MetricWriter(tmp_path, backends=('jsonl', 'csv'))
  w.write(2, {'train/loss': 3.0})
  w.write(4, {'train/loss': 2.5, 'eval/loss': 2.7})
  w.write(6, {'train/loss': float('nan')})
  w.close()
  rows = _rows(tmp_path / 'metrics.csv')
  assert [r['step'] for r in rows] == ['2', '4', '6']
  assert rows[0]['eval/loss'] == '' and float(rows[1]['eval/loss']) == 2.7
  assert rows[2]['train/loss'] == 'nan'
  assert not (tmp_path / 'tensorboard').exists()
  # Resume from step 4: the row of step 6 (after the checkpoint) goes.
  w = metrics.MetricWriter(tmp_path, resume_step=4, backends=('jsonl', 'csv'))
  w.write(6, {'train/loss': 2.0})
  w.close()
  rows = _rows(tmp_path / 'metrics.csv')
  assert [(r['step'], r['train/loss']) for r in rows] == [
      ('2', '3.0'), ('4', '2.5'), ('6', '2.0')]
  steps = [json.loads(l)['step'] for l in
           (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert steps == [2, 4, 6]


def test_default_backends_are_jsonl_and_tensorboard(tmp_path):
  assert metrics.check_logging(ml_collections.ConfigDict()) == (
      'jsonl', 'tensorboard')
  w = metrics.MetricWriter(tmp_path)
  w.write(1, {'a': 1.0})
  w.close()
  assert (tmp_path / 'tensorboard').is_dir()
  assert not (tmp_path / 'metrics.csv').exists()


@pytest.mark.parametrize('backends, match', [
    (('jsonl', 'mlflow'), r"unknown \['mlflow'\]"),
    (('csv',), "must include 'jsonl'"),
])
def test_bad_backends_are_named(backends, match):
  with pytest.raises(ValueError, match=match):
    metrics.check_logging(_config(backends))


def test_wandb_missing_says_what_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, 'wandb', None)  # import wandb fails
  with pytest.raises(ImportError, match='pip install wandb'):
    metrics.check_logging(_config(('jsonl', 'wandb')))


class _FakeRun:

  def __init__(self, **kwargs):
    self.init_kwargs, self.logged, self.finished = kwargs, [], False

  def log(self, scalars, step):
    self.logged.append((step, dict(scalars)))

  def finish(self):
    self.finished = True


def test_wandb_logs_each_step_and_resumes_the_same_run(tmp_path,
                                                       monkeypatch):
  runs = []
  fake = types.ModuleType('wandb')
  fake.init = lambda **kw: runs.append(_FakeRun(**kw)) or runs[-1]
  monkeypatch.setitem(sys.modules, 'wandb', fake)
  settings = {'wandb_project': 'p', 'wandb_name': '', 'wandb_mode': 'offline'}
  for step in (1, 2):
    w = metrics.MetricWriter(tmp_path / 'run', resume_step=step - 1,
                             backends=('jsonl', 'wandb'), settings=settings,
                             run_config={'seed': 0})
    w.write(step, {'train/loss': 1.0 / step})
    w.close()
  first, second = runs
  assert first.init_kwargs['id'] == second.init_kwargs['id']  # resumed
  assert first.init_kwargs['project'] == 'p'
  assert first.init_kwargs['name'] == 'run'  # the workdir's name
  assert first.init_kwargs['mode'] == 'offline'
  assert first.init_kwargs['config'] == {'seed': 0}
  assert first.logged == [(1, {'train/loss': 1.0})]
  assert second.logged == [(2, {'train/loss': 0.5})]
  assert first.finished and second.finished
