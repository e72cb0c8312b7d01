"""The bytes-at-quality frontier study's configs, front and headline
(experiments.frontier, experiments._frontier_tables), without training."""

import pathlib

import jax
import pytest

from configs import diloco_lm
from experiments import _frontier_tables
from experiments import _registry
from experiments import _frontier_runs as frontier
from loc_opt.train import experiment as exp_lib


@pytest.mark.parametrize('name', list(frontier.RUNS))
def test_every_run_is_a_valid_m4_config(name):
  base = diloco_lm.get_config()
  for run, value in frontier.points([name], tune=True):
    c = frontier.config_of(base, run, value, num_steps=2400, dp_lr=1.2e-2,
                           inner_lr=3e-3, devices=jax.device_count())
    exp_lib.validate_config(c, jax.device_count())
    assert c.mesh.workers == 4 and c.num_steps == 2400
    knob = frontier.RUNS[run][3]
    if knob is not None:
      section, _, field = knob[0].replace('__', '.').rpartition('.')
      holder = c
      for part in section.split('.'):
        holder = holder[part]
      assert holder[field] == value
  assert frontier.run_dir_name('diloco_h30_fp32', 0.7) == 'diloco_h30_fp32'
  assert frontier.run_dir_name('diloco_h30_fp32', 0.4) == \
      'diloco_h30_fp32_0.4'


def test_outer_lrs_replace_only_the_outer_learning_rate_knob():
  lrs = [1.0, 0.7]
  got = frontier.points(['diloco_h30_int8', 'demo', 'dp'], True, lrs)
  assert got == [('diloco_h30_int8', 1.0), ('demo', 32), ('dp', None),
                 ('diloco_h30_int8', 0.7), ('demo', 8)]
  assert frontier.run_dir_name('diloco_h30_int8', 1.0, lrs) == \
      'diloco_h30_int8'
  assert frontier.run_dir_name('diloco_h30_int8', 0.7, lrs) == \
      'diloco_h30_int8_0.7'
  assert frontier.run_dir_name('demo', 8, lrs) == 'demo_8'


def test_each_results_name_has_its_tables_and_figure():
  source = (pathlib.Path(__file__).parents[1] / 'experiments'
            / 'frontier.py').read_text()
  for name, path in _frontier_tables.NAMES.items():
    assert f"'{name}'" in source  # the program's --results_name
    assert _registry.RENDERERS[(name, 'headline')] is \
        _frontier_tables.frontier_headline
    assert _registry.FIGURES[name][1] == path


def _row(name, family, loss, nbytes, run=None):
  return {'name': name, 'run': run or name, 'family': family,
          'label': name, 'final_eval_loss': loss,
          'cross_worker_bytes': nbytes}


def test_front_and_the_largest_reduction_within_each_margin():
  rows = [_row('dp', 'data-parallel', 1.00, 1_000_000),
          _row('a', 'DiLoCo', 1.015, 40_000),
          _row('a_0.4', 'DiLoCo', 1.010, 40_000, run='a'),  # a's best
          _row('b', 'DiLoCo', 1.04, 5_000),
          _row('c', 'DiLoCo', 1.20, 1_000),
          _row('d', 'NoLoCo', 1.05, 80_000)]  # beaten by b on both
  setup = {'num_steps': 2400, 'batch_size': 32, 'seq_len': 128,
           'workers': 4}
  res = _frontier_tables.results(rows, setup, ['e'])
  assert res['front'] == ['c', 'b', 'a_0.4', 'dp']
  w2, w5 = res['within']
  assert (w2['name'], w2['reduction']) == ('a_0.4', 25.0)
  assert (w5['name'], w5['reduction']) == ('b', 200.0)
  text = _frontier_tables.frontier_main({'results': res})
  assert 'within 2% of data-parallel\'s loss the largest reduction of ' \
      'cross-worker bytes is 25x' in text
  assert '200x (b, 1.0400)' in text and 'Not run yet: e.' in text
  # Nothing within a margin, and no data-parallel row yet.
  res = _frontier_tables.results(rows[:1] + rows[4:5], setup, [])
  text = _frontier_tables.sentence({'results': res})
  assert 'no method is within 2%' in text
  assert 'the closest is c at +20.0% with 1,000x fewer bytes' in text
  assert _frontier_tables.frontier_headline({'results': res}) == text + '\n'
  res = _frontier_tables.results(rows[:1], setup, ['a'])  # data-parallel only
  assert 'closest' not in _frontier_tables.sentence({'results': res})
  res = _frontier_tables.results(rows[1:], setup, [])
  assert _frontier_tables.sentence({'results': res}).startswith(
      'No data-parallel run yet')
