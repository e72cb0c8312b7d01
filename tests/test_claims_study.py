"""The claims studies' own logic, without training: QSR's sync-count match,
rows imported from another machine, and how the tables name devices."""

import json

import pytest
from configs import local_sgd_lm
from experiments import _runs
from experiments import _claims
from experiments import tables


def _qsr_base(num_steps=120, base_period=5):
  c = local_sgd_lm.get_config('mlp')
  c.num_steps = num_steps
  return _runs.variant(c, outer__sync_every=base_period)


def test_qsr_alpha_makes_exactly_the_asked_syncs():
  base = _qsr_base()
  assert _claims.count_syncs(base) == 24  # constant H_base = 5 over 120 steps
  alpha = _claims.qsr_alpha_for(base, 8)
  assert _claims.count_syncs(_claims.qsr_config(base, alpha)) == 8
  # A little less alpha syncs more often: the smallest alpha was found.
  assert _claims.count_syncs(_claims.qsr_config(base, alpha * 0.999)) > 8


def test_qsr_refuses_a_count_it_cannot_make():
  # H_base during warmup (12 steps) alone makes 3 rounds of 5 before QSR
  # can stretch them, so 2 syncs over the run are out of reach.
  with pytest.raises(ValueError, match='syncs'):
    _claims.qsr_alpha_for(_qsr_base(), 2)


def test_qsr_lr_check_picks_the_lowest_loss_and_refuses_none():
  rows = [{'learning_rate': 0.012, 'final_eval_loss': 1.52},
          {'learning_rate': 0.024, 'final_eval_loss': 1.49}]
  assert _claims.best_lr(rows) == 0.024
  with pytest.raises(ValueError, match='no runs'):
    _claims.best_lr([])


def test_qsr_budget_table_pairs_each_seed_with_its_twin():
  setup = {'num_steps': 100, 'batch_size': 8, 'seq_len': 16, 'workers': 4,
           'devices': 1, 'base_period': 5, 'method': 'local_sgd',
           'size': '0.2M', 'simulated_workers': True, 'optimizer': 'adamw',
           'learning_rate': 0.024, 'schedule': 'warmup_cosine',
           'schedule_kwargs': {'warmup_steps': 0.1}}
  losses = {'constant_h5': (1.5, 1.6), 'qsr_10': (1.40, 1.52),
            'constant_h10': (1.45, 1.54)}
  rows = [{'name': n, 'rule': 'qsr' if n.startswith('qsr') else 'constant',
           'knob': 0.05 if n.startswith('qsr') else int(n[10:]),
           'pair': None if n == 'constant_h5' else 10, 'seed': seed,
           'syncs': 10, 'final_eval_loss': loss[seed]}
          for n, loss in losses.items() for seed in (0, 1)]
  check = [{'learning_rate': 0.012, 'final_eval_loss': 1.6, 'seed': 0},
           {'learning_rate': 0.024, 'final_eval_loss': 1.5, 'seed': 0}]
  text = tables.render('qsr_budget', 'main', {'results': {
      'setup': setup, 'rows': rows, 'lr_check': check,
      'pending': ['qsr_20_s0']}})
  # Paired differences -0.05 and -0.02: mean -0.035, sd 0.0212.
  assert '| QSR, alpha 0.05 | 10 | 1.4600 +- 0.0849 | 1.4000, 1.5200 | ' \
      '-2.34% | -0.0350 +- 0.0212 (2 seeds) |' in text
  assert '0.012: 1.6000, 0.024: 1.5000; the runs below use 0.024' in text
  assert 'stacked on one device' in text and 'qsr_20_s0' in text


def _row(size, method, knob, seed, loss, device):
  return {'name': _claims.run_name(size, method, knob, seed), 'size': size,
          'method': method, 'knob': knob, 'seed': seed, 'num_params': 10,
          'final_eval_loss': loss, 'cross_worker_bytes': 0, 'syncs': 0,
          'steps': 5, 'device': device, 'curve': {}}


def test_imported_rows_join_and_their_runs_keep_provenance(tmp_path):
  rows = [_row('2M', 'dp', 3e-3, 0, 1.3, 'H100 (highest)')]
  run = {'label': '2M data-parallel', 'config': {},
         'provenance': {'commit': 'c' * 40}}
  path = tmp_path / 'claims.json'
  path.write_text(json.dumps({'runs': [run], 'results': {'rows': rows}}))
  before = len(_runs.RUNS)
  try:
    # A file imported twice (or a row in two files) counts once.
    assert _claims.import_rows([str(path), str(path)]) == rows
    assert _runs.RUNS[before:] == [run]
  finally:
    del _runs.RUNS[before:]
  path.write_text(json.dumps({'results': {'rows': [
      dict(rows[0], size='3M')]}}))
  with pytest.raises(ValueError, match='3M'):
    _claims.import_rows([str(path)])
  path.write_text('{}')
  with pytest.raises(ValueError, match='not a claims.json'):
    _claims.import_rows([str(path)])


def test_claims_table_names_the_devices_of_each_size():
  rows = [_row('0.5M', 'dp', 3e-3, 0, 1.50, 'cpu'),
          _row('0.5M', 'diloco_m1', 0.4, 0, 1.55, 'cpu'),
          _row('2M', 'dp', 3e-3, 0, 1.30, 'H100 (highest)'),
          _row('2M', 'dp', 3e-3, 1, 1.32, 'H100 (highest)'),
          _row('2M', 'diloco_m4', 0.7, 0, 1.43, 'cpu')]
  setup = {'num_steps': 5, 'batch_size': 2, 'seq_len': 4, 'sync_every': 5,
           'outer_momentum': 0.9, 'inner_learning_rate': 3e-3,
           'knobs': {'dp': [3e-3], 'diloco_m1': [0.4], 'diloco_m4': [0.7]},
           'sizes': {'0.5M': {}, '2M': {}},
           'methods': {k: v[0] for k, v in _claims.METHODS.items()
                       if k != 'diloco_m2'}}
  text = _claims.claims_main({'results': {'setup': setup,
                                                'rows': rows}})
  lines = {line.split(' ')[1]: line for line in text.split('\n')
           if line.startswith('| 0.5M') or line.startswith('| 2M')}
  assert lines['0.5M'].endswith('| +3.33% |  | cpu |')
  assert '1.3100 ± 0.0100 (2 seeds) [0.003]' in lines['2M']
  assert lines['2M'].endswith('| +9.16% | H100 (highest): dp; cpu: '
                              'diloco_m4 |')


def test_source_line_lists_every_setup_the_runs_used():
  def run(jax_version, kind):
    return {'label': 'x', 'config': {}, 'provenance': {
        'commit': 'a' * 40, 'dirty': False,
        'packages': {'jax': jax_version, 'flax': 'f', 'optax': 'o'},
        'device': {'device_count': 1, 'device_kind': kind, 'host_cpus': 16}}}
  data = {'provenance': {'commit': 'a' * 40, 'dirty': False,
                         'time_utc': '2026-11-26T00:00:00+00:00',
                         'packages': {'jax': '0.12', 'flax': 'f',
                                      'optax': 'o'},
                         'device': {'device_count': 8, 'device_kind': 'cpu',
                                    'host_cpus': 2}},
          'runs': [run('0.12', 'cpu'), run('0.12', 'cpu'),
                   run('0.11', 'H100')]}
  line = ' '.join(tables.source_line('claims', data).split())
  assert 'jax 0.11, flax f, optax o; 1 x H100 devices, 16 host CPUs (1 runs)' \
      in line
  assert '1 x cpu devices, 16 host CPUs (2 runs)' in line


def test_diloco_settings_pair_the_outer_and_the_inner_lr():
  assert _claims.run_name('2M', 'diloco_m1', 0.4, 0) == '2M_diloco_m1_0.4_s0'
  assert (_claims.run_name('2M', 'diloco_m1', 0.4, 1, 6e-3)
          == '2M_diloco_m1_0.4_s1_i0.006')
  rows = [_row('0.5M', 'diloco_m1', 0.4, 0, 1.56, 'cpu'),
          dict(_row('0.5M', 'diloco_m1', 0.4, 0, 1.50, 'cpu'), inner_lr=6e-3),
          dict(_row('0.5M', 'diloco_m1', 0.4, 1, 1.52, 'cpu'), inner_lr=6e-3),
          _row('0.5M', 'diloco_m1', 0.4, 1, 1.40, 'cpu')]
  # Seed 0 picks the setting; the seeds of that setting only are averaged.
  assert _claims.claims_summary(rows, '0.5M', 'diloco_m1') == (
      (0.4, 6e-3), [1.50, 1.52])
  sweep = _claims.claims_sweep({'results': {
      'rows': rows, 'setup': {'methods': {'diloco_m1': 'DiLoCo M=1'}}}})
  assert '| outer lr 0.4, inner lr 0.006 | 1.5000 |' in sweep


def test_rows_written_before_devices_were_named_take_their_runs_device(
    tmp_path):
  row = _row('0.5M', 'dp', 3e-3, 0, 1.5, None)
  del row['device']
  run = {'label': 'x', 'workdir': f'/runs/{row["name"]}', 'config': {},
         'provenance': {'device': {'device_kind': 'cpu'}}}
  path = tmp_path / 'claims.json'
  path.write_text(json.dumps({'runs': [run], 'results': {'rows': [row]}}))
  before = len(_runs.RUNS)
  try:
    assert _claims.import_rows([str(path)])[0]['device'] == 'cpu'
  finally:
    del _runs.RUNS[before:]


def test_sweep_is_ordered_and_pending_runs_are_counted_per_method():
  rows = [dict(_row('2M', 'diloco_m1', 0.2, 0, 1.41, 'cpu'), inner_lr=6e-3),
          _row('2M', 'dp', 3e-3, 0, 1.31, 'cpu'),
          _row('0.5M', 'diloco_m1', 0.7, 0, 1.60, 'cpu'),
          _row('0.5M', 'diloco_m1', 0.4, 0, 1.55, 'cpu'),
          dict(_row('0.5M', 'diloco_m1', 0.2, 0, 1.58, 'cpu'),
               inner_lr=1.5e-3)]
  methods = {k: v[0] for k, v in _claims.METHODS.items()}
  sweep = _claims.claims_sweep({'results': {
      'rows': rows, 'setup': {'methods': methods,
                              'inner_learning_rate': 3e-3}}})
  order = [line.split(' | ')[2] for line in sweep.splitlines()[2:]]
  # size, then method, then inner lr (the config's 3e-3 in its place),
  # then outer lr.
  assert order == ['outer lr 0.2, inner lr 0.0015', 'outer lr 0.4',
                   'outer lr 0.7', 'inner lr 0.003',
                   'outer lr 0.2, inner lr 0.006']
  pending = ['0.5M_dp_0.00075_s0', '2M_diloco_m4_0.2_s0',
             '2M_diloco_m4_0.4_s0_i0.006', '2M_diloco_m1_0.1_s0',
             '8M_diloco_m1_0.2_s1', '8M_diloco_m1_0.2_s2',
             '8M_diloco_m4_0.4_s2_i0.006', 'something else']
  assert _claims._pending_summary(pending) == (
      '0.5M data-parallel: 1 setting of the grid; 2M DiLoCo M=4: 2 settings '
      'of the grid; 2M DiLoCo M=1: 1 setting of the grid; 8M DiLoCo M=1: '
      'seeds 1, 2 of the best setting; 8M DiLoCo M=4: seed 2 of the best '
      'setting; something else')


def test_compute_line_sums_the_recorded_wall_time_per_device():
  def run(kind, wall):
    return {'provenance': {'device': {'device_kind': kind},
                           'wall_seconds': wall}}
  runs = [run('cpu', 3000.0), run('cpu', 4200.0), run('H100', 90.0),
          {'provenance': {'unknown': 'finished before provenance'}}]
  line = _claims.compute_line(runs)
  assert line.startswith('Compute recorded: 1.5 min over 1 runs on H100; '
                         '2.00 h over 2 runs on cpu (')
  assert _claims.compute_line([]) == ''


def test_outer_sweep_grid_point_reaches_each_methods_outer_step():
  """The sweep's (lr, momentum) is what each method runs: shared fields for
  DiLoCo, cleared section for Eager updates, written into CO2's and
  NoLoCo's own sections (they do not fall back to the shared fields)."""
  from configs import diloco_lm  # pylint: disable=g-import-not-at-top
  from loc_opt.train import registry  # pylint: disable=g-import-not-at-top
  from loc_opt import outer as outer_lib  # pylint: disable=g-import-not-at-top
  base = diloco_lm.get_config()
  for method in ('diloco', 'eager_diloco', 'co2', 'noloco'):
    c = _runs.outer_grid_point(base, method, 2, 0.45, 0.15, 20)
    assert (c.outer.method, c.mesh.workers, c.mesh.data) == (method, 2, 4)
    assert (c.outer.learning_rate, c.outer.momentum) == (0.45, 0.15)
    assert c.outer.sync_every == 20
  eager = _runs.outer_grid_point(base, 'eager_diloco', 4, 0.45, 0.15, 30)
  assert eager.outer.eager_diloco.momentum is None
  co2 = _runs.outer_grid_point(base, 'co2', 4, 0.45, 0.15, 30)
  kwargs = registry.METHODS['co2'].library_kwargs(co2)[outer_lib.co2]
  assert (kwargs['outer_lr'], kwargs['momentum']) == (0.45, 0.15)
  noloco = _runs.outer_grid_point(base, 'noloco', 4, 0.45, 0.15, 30)
  kwargs = registry.METHODS['noloco'].library_kwargs(noloco)[outer_lib.noloco]
  assert kwargs['momentum'] == 0.15
  assert base.outer.co2.momentum != 0.15  # the base is left alone


def test_local_search_runs_neighbours_until_the_best_is_a_local_minimum():
  axes = [[0.9, 0.5, 0.3], [0.7, 0.4, 1.0, 0.2]]
  assert _claims.local_search(axes, {}) == [(0.9, 0.7)]  # the start
  # From the start: the momentum neighbour first, then the lr neighbours.
  assert _claims.local_search(axes, {(0.9, 0.7): 1.3}) == [
      (0.5, 0.7), (0.9, 0.4), (0.9, 1.0)]
  # A winning neighbour becomes the best; its own neighbours are wanted.
  losses = {(0.9, 0.7): 1.3, (0.5, 0.7): 1.2, (0.9, 0.4): 1.35,
            (0.9, 1.0): 1.4}
  assert _claims.local_search(axes, losses) == [
      (0.3, 0.7), (0.5, 0.4), (0.5, 1.0)]
  losses.update({(0.3, 0.7): 1.25, (0.5, 0.4): 1.21, (0.5, 1.0): 1.22})
  assert _claims.local_search(axes, losses) == []  # (0.5, 0.7) is a minimum
  # Settings off the grid (another inner lr, say) do not count.
  assert _claims.local_search([[1e-2, 5e-3]], {(3e-3,): 1.0}) == [(1e-2,)]


def test_claims_table_gaps_of_m2_and_outer_momentum_settings():
  rows = [_row('0.5M', 'dp', 6e-3, 0, 1.25, 'cpu'),
          dict(_row('0.5M', 'diloco_m2', 0.7, 0, 1.30, 'cpu'),
               outer_momentum=0.5),
          dict(_row('0.5M', 'diloco_m2', 0.7, 0, 1.40, 'cpu'),
               name='0.5M_diloco_m2_0.7_s0')]
  rows[1]['name'] = _claims.run_name('0.5M', 'diloco_m2', 0.7, 0, None, 0.5)
  assert rows[1]['name'] == '0.5M_diloco_m2_0.7_s0_m0.5'
  setup = {'num_steps': 2400, 'batch_size': 32, 'seq_len': 128,
           'sync_every': 30, 'outer_momentum': 0.9,
           'inner_learning_rate': 3e-3, 'sizes': {'0.5M': {}},
           'knobs': {'dp': [6e-3], 'diloco_m1': [0.7],
                     'outer_momenta': [0.9, 0.5],
                     'method_inner': {'diloco_m2': 3e-3}},
           'methods': {'dp': 'data-parallel', 'diloco_m2': 'DiLoCo M=2'},
           'search': 'local'}
  text = _claims.claims_main({'results': {
      'setup': setup, 'rows': rows,
      'pending': ['0.5M_diloco_m2_0.7_s1_m0.5']}})
  assert '| M=2 vs DP |' in text and '+4.00%' in text
  assert '[0.7, momentum 0.5]' in text and 'Local search' in text
  assert 'DiLoCo M=2: seed 1 of the best setting' in text


def test_claims_table_gives_each_size_its_steps_and_tokens_per_param():
  rows = [dict(_row('0.2M', 'dp', 1.2e-2, 0, 1.38, 'cpu'), steps=1000,
               num_params=200_000),
          dict(_row('0.5M', 'dp', 6e-3, 0, 1.25, 'cpu'), steps=2400,
               num_params=400_000)]
  setup = {'num_steps': 2400, 'batch_size': 32, 'seq_len': 128,
           'sync_every': 30, 'outer_momentum': 0.9,
           'inner_learning_rate': 3e-3,
           'knobs': {'dp': [6e-3], 'diloco_m1': [0.4]},
           'sizes': {'0.2M': {}, '0.5M': {}}, 'methods': {'dp': 'dp'}}
  text = _claims.claims_main({'results': {'setup': setup, 'rows': rows}})
  assert text.startswith('The steps column\'s steps x 32 x 128')
  assert '| 0.2M (200,000) | 1,000 (20.5) | 1.3800 (1 seed)' in text
  assert '| 0.5M (400,000) | 2,400 (24.6) | 1.2500 (1 seed)' in text


def test_method_inner_lrs_hold_per_size_or_everywhere():
  got = _claims.method_inner(
      ['diloco_m1=6e-3', '0.2M:diloco_m1=1.2e-2', '0.2M:diloco_m4=3e-3'],
      config_lr=3e-3)
  assert got == {(None, 'diloco_m1'): 6e-3, ('0.2M', 'diloco_m1'): 1.2e-2,
                 ('0.2M', 'diloco_m4'): None}  # None: the config's lr
  for bad in ('dp=1e-3', '3M:diloco_m1=1e-3', 'diloco_m1='):
    with pytest.raises(ValueError, match='SIZE'):
      _claims.method_inner([bad], config_lr=3e-3)


def test_steps_per_size_parse_and_refuse_what_is_not_a_size_or_a_count():
  assert _claims.size_steps(['0.2M=1000', '0.5M=2400']) == {
      '0.2M': 1000, '0.5M': 2400}
  for bad in ('3M=10', '0.2M=', '0.2M=-5', '0.2M=1e3'):
    with pytest.raises(ValueError, match='SIZE=STEPS'):
      _claims.size_steps([bad])
