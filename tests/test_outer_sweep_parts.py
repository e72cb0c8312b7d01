"""The outer-step sweep's parts without training: its --also entries, run
names, the naive delay's config and the seeds table."""

import pytest
from configs import diloco_lm
from experiments import _outer_sweep
from experiments import _runs
from experiments import tables


def test_also_entries_parse_settings_tuned_methods_and_seeds():
  got = _outer_sweep.parse_also(
      ['eager_naive@0.7:0.9', 'eager_naive@eager_diloco',
       'diloco@1.0:0.5:3', 'diloco@eager_diloco:2'], ['eager_diloco'])
  assert got == [('eager_naive', (0.7, 0.9), 1),
                 ('eager_naive', 'eager_diloco', 1),
                 ('diloco', (1.0, 0.5), 3), ('diloco', 'eager_diloco', 2)]


@pytest.mark.parametrize('bad', [
    'diloco', 'diloco@', '@0.7:0.9', 'diloco@0.7', 'diloco@co2',
    'diloco@0.7:0.9:0', 'diloco@0.7:0.9:2:1', 'diloco@a:b'])
def test_also_entries_name_a_bad_entry(bad):
  with pytest.raises(ValueError, match='--also entry'):
    _outer_sweep.parse_also([bad], ['eager_diloco'])


def test_run_names_keep_the_old_sweeps_names_at_seed_0():
  assert _outer_sweep.run_name('diloco', 2, 0.7, 0.9) == (
      'diloco_m2_lr0.7_mom0.9')
  assert _outer_sweep.run_name('eager_naive', 2, 1.0, 0.5, 2, '0.2M') == (
      '0.2M_eager_naive_m2_lr1_mom0.5_s2')


def test_naive_variant_runs_eager_updates_with_the_stale_average_alone():
  method, overrides = _outer_sweep.method_of('eager_naive')
  c = _runs.variant(_runs.outer_grid_point(diloco_lm.get_config(), method,
                                           2, 0.7, 0.9, 30), **overrides)
  assert (c.outer.method, c.outer.eager_diloco.naive) == ('eager_diloco',
                                                          True)
  assert (c.outer.learning_rate, c.outer.momentum) == (0.7, 0.9)
  assert _outer_sweep.method_of('diloco') == ('diloco', {})


def _row(method, lr, mom, seed, loss, role='search'):
  return {'method': method, 'workers': 2, 'learning_rate': lr,
          'momentum': mom, 'seed': seed, 'final_eval_loss': loss,
          'role': role}


def test_seeds_table_gives_each_settings_mean_and_gap_to_diloco():
  rows = [_row('eager_diloco', 1.0, 0.5, 0, 1.5),
          _row('diloco', 1.0, 0.5, 0, 1.4), _row('diloco', 1.0, 0.5, 1, 1.6),
          _row('eager_diloco', 1.0, 0.5, 1, 1.7),
          _row('eager_naive', 0.7, 0.9, 0, 2.0, 'also'),
          _row('eager_diloco', 0.4, 0.5, 0, 1.9)]
  data = {'results': {'rows': rows, 'pending': ['x']}}
  text = _outer_sweep.budget_seeds(data)
  lines = text.splitlines()
  eager = next(l for l in lines if l.startswith('| Eager updates'))
  # mean 1.6, std 0.1414; DiLoCo mean 1.5, std 0.1414: +6.67%, +0.7 std
  assert '1.5000, 1.7000 | 1.6000 +- 0.1414 | +6.67% (+0.7 std) |' in eager
  naive = next(l for l in lines if l.startswith('| naive'))
  assert naive.endswith('| 1 | 2.0000 | 2.0000 | +33.33% (+3.5 std) |')
  diloco = next(l for l in lines if l.startswith('| DiLoCo'))
  assert diloco.endswith('| 1.5000 +- 0.1414 |  |')
  assert 'Not run yet: x.' in text
  assert '1.9000' not in text  # a search point at one seed: tuning table


def test_tuning_table_shows_seed_0_only():
  rows = [_row('eager_diloco', 1.0, 0.5, 0, 1.5),
          _row('eager_diloco', 1.0, 0.5, 1, 1.2)]
  setup = {'num_steps': 1000, 'batch_size': 32, 'seq_len': 128,
           'sync_every': 30, 'devices': 1, 'nesterov': True, 'size': '0.2M',
           'num_params': 194960, 'inner_learning_rate': 0.012,
           'simulate_workers': True}
  text = tables.outer_sweep_main({'results': {'setup': setup, 'rows': rows}})
  assert text.startswith('0.2M LM (194,960 parameters), inner lr 0.012; '
                         '1000 steps')
  assert 'stacked on one device' in text and 'loss (seed 0):' in text
  assert '**1.5000**' in text and '1.2000' not in text
