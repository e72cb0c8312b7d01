"""The schedules benchmark's seeds: flag checks, run directories and the
tables' mean +- std over seeds (rendered from the committed results file
with seeds added, no training)."""

import json
import pathlib

import pytest

from experiments import _schedules
from experiments import _train_tables

_RESULTS = pathlib.Path(__file__).parent.parent / 'docs/results/schedules.json'


def test_parse_seeds_checks_values_and_runs():
  assert _schedules.parse_seeds(['0', '1'], ['cosine', 'wsd-s']) == (
      [0, 1], ['cosine', 'wsd-s'])
  with pytest.raises(ValueError, match='integers'):
    _schedules.parse_seeds(['0', 'x'], [])
  with pytest.raises(ValueError, match='distinct'):
    _schedules.parse_seeds(['1', '1'], [])
  with pytest.raises(ValueError, match=r"\['constant'\]"):
    _schedules.parse_seeds(['0'], ['cosine', 'constant'])


def test_seed_dir_keeps_the_first_seeds_name():
  assert _schedules.seed_dir('wsd 1-sqrt', 0, 0) == 'wsd_1-sqrt'
  assert _schedules.seed_dir('wsd 1-sqrt', 2, 0) == 'wsd_1-sqrt_s2'
  assert _schedules.seed_dir('cosine', 0, 1) == 'cosine_s0'


def test_seed_stats_is_mean_and_sample_std():
  assert _train_tables.seed_stats([1.5]) == (1.5,)
  mean, std, n = _train_tables.seed_stats([1.0, 2.0, 3.0])
  assert (mean, n) == (2.0, 3) and std == pytest.approx(1.0)


def test_tables_give_mean_and_std_over_seeds():
  data = json.loads(_RESULTS.read_text())
  res = data['results']
  budgets = res['budgets']
  cos = res['runs']['cosine']['final_eval_loss']
  res['seeds'] = [0, 1, 2]
  res['seed_losses'] = {'cosine': {'0': cos, '1': cos + 0.01,
                                   '2': cos + 0.02}}
  ev = res['runs']['wsd-s']['curve']['eval']
  res['seed_wsds'] = {'0': [ev[str(b)] for b in budgets],
                      '1': [ev[str(b)] + 0.02 for b in budgets]}
  main = _train_tables.schedules_main(data)
  assert f'| cosine | {cos + 0.01:.4f} ± 0.0100 (3 seeds) |' in main
  assert 'Seeds 0, 1, 2' in main
  wsds_row = next(line for line in _train_tables.schedules_budgets(
      data).splitlines() if line.startswith('| WSD-S'))
  b0 = ev[str(budgets[0])]
  assert f'{b0 + 0.01:.4f} ± {0.02 / 2 ** 0.5:.4f} (2 seeds)' in wsds_row


def test_chosen_runs_keeps_the_given_order_and_names_bad_runs():
  assert _schedules.chosen_runs(['wsd-s', 'constant main', 'wsd-s']) == [
      'wsd-s', 'constant main']
  with pytest.raises(ValueError, match=r"\['cosine 250'\]"):
    _schedules.chosen_runs(['cosine', 'cosine 250'])
  with pytest.raises(ValueError, match='not runs'):
    _schedules.chosen_runs([])
