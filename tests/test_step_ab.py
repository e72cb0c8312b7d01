"""Tests for experiments.step_ab (config variants timed in one process)."""

import json
import pathlib
import subprocess
import sys

_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(*args, timeout=300):
  return subprocess.run(
      [sys.executable, '-m', 'experiments.step_ab',
       '--config=configs/diloco_lm.py:mlp', '--cpu_devices=8', *args],
      cwd=_ROOT, capture_output=True, text=True, timeout=timeout, check=False)


def test_variants_are_timed_alternately_and_written(tmp_path):
  proc = _run('--variant=base=', '--variant=wide=model.hidden=256',
              '--rounds=2', '--block=2', '--warmup=1', f'--workdir={tmp_path}')
  assert proc.returncode == 0, proc.stderr[-2000:]
  written = json.loads((tmp_path / 'step_ab.json').read_text())
  assert written['benchmark'] == 'step_ab' and written['provenance']
  assert written['results']['rounds'] == 2
  results = written['results']['variants']
  assert list(results) == ['base', 'wide']
  assert results['wide']['overrides'] == {'model.hidden': 256}
  for r in results.values():
    assert r['steps_timed'] == 4  # 2 rounds x 2 steps
    assert r['median_step_s'] > 0
    # 32 sequences x 128 tokens per step
    assert abs(r['tokens_per_s'] * r['median_step_s'] - 32 * 128) < 1e-6
  assert '| wide | `model.hidden=256` |' in proc.stdout


def test_bad_variants_are_refused_by_name():
  proc = _run('--variant=a=', timeout=120)
  assert proc.returncode != 0 and 'two or more --variant' in proc.stderr
  proc = _run('--variant=a=', '--variant=b=model.nope=1', '--rounds=1',
              '--block=1', timeout=300)
  assert proc.returncode != 0
  assert "variant 'b'" in proc.stderr and 'nope' in proc.stderr
  proc = _run('--variant=a=', '--variant=b=model.hidden', timeout=120)
  assert proc.returncode != 0 and "'model.hidden' is not FIELD=VALUE" in (
      proc.stderr)


def test_throughput_table_gives_medians_and_round_ratios():
  # experiments.benchmark_step_time --repeats: each figure the median of its
  # rounds, and each round's ratio to the same round's exogym run.
  from experiments import _train_tables  # pylint: disable=g-import-not-at-top

  def run(*rounds):
    ordered = sorted(rounds)
    return {'tokens_per_s': ordered[(len(ordered) - 1) // 2],
            'num_params': 10, 'rounds_tokens_per_s': list(rounds)}

  row = run(90.0, 100.0, 120.0) | {'exogym': run(50.0, 40.0, 60.0),
                                   'stacked': run(100.0, 110.0, 80.0)}
  text = _train_tables.step_time_throughput({'results': {'throughput': {
      'sync_every': 10, 'steps': 60, 'repeats': 3, 'sizes': {'459k': row},
      'levers': {}}}})
  assert '3 rounds of these runs' in text
  assert '| 459k | 10 | 100 | 50 (10) | 2.00 | 100 | 2.00 |' in text
  assert '459k 1.80, 2.50, 2.00 (2.00, 2.75, 1.33)' in text
  assert 'processes' not in text  # a layout not measured has no column
  row['processes'] = run(130.0, 120.0, 125.0)
  text = _train_tables.step_time_throughput({'results': {'throughput': {
      'sync_every': 10, 'steps': 60, 'repeats': 3, 'sizes': {'459k': row},
      'levers': {}}}})
  assert ('| 459k | 10 | 100 | 50 (10) | 2.00 | 100 | 2.00 | 125 | 2.50 |'
          in text)
  assert ('default layout (stacked) (processes): 459k 1.80, 2.50, 2.00 '
          '(2.00, 2.75, 1.33) (2.60, 3.00, 2.08)') in text
  assert 'then loc_opt with the workers stacked 2 per process' in text
