"""Tests for experiments.profile_step and its analysis, experiments._profile
(where the CPU step's time goes)."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from experiments import _profile
from experiments import _train_tables

_ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_overlapping_ops_share_their_time():
  # a alone for 10, a and b together for 10, b alone for 5; c never ran.
  got = _profile.shared_times([(0, 20, 'a'), (10, 25, 'b'),
                                   (30, 30, 'c')])
  assert got == {'a': 15.0, 'b': 10.0}
  # Two events of the same op back to back, and one nested in another
  # thread's op: the shares still add up to the busy time.
  got = _profile.shared_times([(0, 10, 'a'), (10, 20, 'a'),
                                   (0, 20, 'b'), (5, 15, 'c')])
  assert sum(got.values()) == pytest.approx(20.0)
  assert got['b'] > got['c']


def _compiled_text():
  def f(x, w):
    with jax.named_scope('attention_core'):
      s = jax.nn.softmax(jnp.einsum('bqd,bkd->bqk', x, x))
    with jax.named_scope('gelu'):
      h = jax.nn.gelu(s @ x @ w, approximate=True)
    with jax.named_scope('optimizer'):
      return h * 0.5 + 1.0
  x = jnp.ones((2, 16, 8))
  w = jnp.ones((8, 32))
  return jax.jit(f).lower(x, w).compile().as_text()


def test_ops_are_sorted_into_matmuls_and_scopes_with_their_flops():
  hlo = _compiled_text()
  names = [m.group(1) for m in _profile.INSTRUCTION.finditer(
      hlo[hlo.index('ENTRY'):])]
  rows = _profile.categorize(hlo, {n: 1.0 for n in names})
  assert list(rows) == list(_profile.CATEGORIES)
  # The scores (2 x 16 x 16 x 8 multiply-adds) are under attention_core;
  # s @ x (2 x 16 x 8 x 16) and @ w (2 x 16 x 32 x 8), under gelu, are
  # matmuls outside it.
  assert rows['attention matmuls']['gflop'] * 1e9 == 2 * 2 * 16 * 16 * 8
  assert rows['dense matmuls']['gflop'] * 1e9 == pytest.approx(
      2 * 2 * 16 * 8 * 16 + 2 * 2 * 16 * 32 * 8)
  # The softmax's other ops, GELU and the optimizer's arithmetic go by
  # their scopes; every timed op lands in exactly one row.
  assert rows['attention, other']['ops'] >= 1
  assert rows['GELU']['ops'] >= 1
  assert rows['optimizer and guard']['ops'] >= 1
  assert sum(r['ops'] for r in rows.values()) == len(names)
  assert sum(r['ms'] for r in rows.values()) == len(names)
  extra = _profile.categorize(hlo, {'ThunkExecutor::Execute': 5.0})
  assert sum(r['ms'] for r in extra.values()) == 0


_UNFUSED = """HloModule m

ENTRY %main (a: f32[3,5], b: f32[5,7]) -> f32[3,7] {
  %a = f32[3,5]{1,0} parameter(0)
  %b = f32[5,7]{1,0} parameter(1)
  ROOT %dot.1 = f32[3,7]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/jvp(attention_core)/dot_general"}
}
"""


def test_an_unfused_dot_reads_its_operands_shapes_from_the_module():
  rows = _profile.categorize(_UNFUSED, {'dot.1': 2.0})
  assert rows['attention matmuls'] == {'ms': 2.0, 'gflop': 2 * 3 * 7 * 5 / 1e9,
                                       'ops': 1}


def test_scopes_match_whole_names_in_the_name_stack():
  assert _profile._in_scope('head', 'jit(step)/vmap(jvp(head))/dot')
  assert _profile._in_scope('loss', 'jit(step)/loss/exp')
  assert not _profile._in_scope('head', 'jit(step)/heads/transpose')
  assert not _profile._in_scope('embed', 'jit(step)/embedding/x')


def test_table_gives_each_category_per_size():
  cats = {c: {'ms': 1.0, 'gflop': 0.0, 'ops': 1}
          for c in _profile.CATEGORIES}
  cats['dense matmuls'] = {'ms': 10.0, 'gflop': 2.0, 'ops': 4}
  size = {'median_step_ms': 20.0, 'traced_step_ms': 25.0,
          'all_cpus_median_step_ms': 11.0, 'all_cpus': 2,
          'num_params': 1000, 'categories': cats,
          'lone_matmul_gflops': 250.0}
  text = _train_tables.profile_step_main({'results': {
      'steps': 3, 'categories': _profile.CATEGORIES,
      'sizes': {'459k': size}}})
  assert '| dense matmuls | 10.0 ms (40%), 200 GFLOP/s |' in text
  assert '| step on 2 cores | 11.0 ms |' in text
  # 25 traced - (10 + 7 x 1) in the categories
  assert '| outside ops (dispatch, host) | 8.0 ms |' in text


def test_profile_of_the_smallest_lm_is_written(tmp_path):
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.profile_step', '--sizes=459k',
       '--steps=2', f'--workdir={tmp_path}'],
      cwd=_ROOT, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  written = json.loads((tmp_path / 'profile_step.json').read_text())
  row = written['results']['sizes']['459k']
  assert row['cpus'] == 1 and row['num_params'] == 459_392
  cats = row['categories']
  # The matmuls are found and hold most of the step's FLOPs.
  assert cats['dense matmuls']['gflop'] > cats['attention matmuls'][
      'gflop'] > 0
  assert all(cats[c]['ms'] > 0 for c in ('RMSNorm', 'GELU',
                                         'optimizer and guard'))
  # The ops' shares add up to no more than the traced step.
  assert sum(c['ms'] for c in cats.values()) <= row['traced_step_ms'] * 1.01
  assert '| attention matmuls |' in proc.stdout


def test_unknown_sizes_are_refused():
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.profile_step', '--sizes=9B'],
      cwd=_ROOT, capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode != 0 and "unknown --sizes ['9B']" in proc.stderr


def test_a_config_without_the_transformer_is_refused():
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.profile_step',
       '--config=configs/diloco_lm.py:mlp'],
      cwd=_ROOT, capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode != 0
  assert "the config's model is 'mlp'" in proc.stderr
