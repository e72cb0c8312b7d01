"""Tests of loc_opt.parallel.overlap: one function over a window of
steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loc_opt import parallel
from loc_opt.parallel import overlap


def step(carry, x, phase):
  """A step whose phase changes what it does: a 'sync' adds, else a
  decay; returns the carry before the step."""
  new = carry + x if phase == 'sync' else 0.9 * carry * x
  return new, carry


PHASES = ('sync', 'inner', 'inner', 'inner', 'sync', 'inner')


def one_by_one(carry, xs):
  ys = []
  for x, phase in zip(xs, PHASES):
    carry, y = step(carry, x, phase)
    ys.append(y)
  return carry, tuple(ys)


@pytest.mark.parametrize('scan_from', [None, 2, 3, 4])
def test_window_equals_steps_one_by_one(scan_from):
  xs = tuple(jnp.full((3,), 1.0 + 0.1 * k) for k in range(len(PHASES)))
  window = jax.jit(parallel.overlap_window(step, PHASES,
                                           scan_from=scan_from))
  got = window(jnp.arange(3.0), xs)
  want = one_by_one(jnp.arange(3.0), xs)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_scanned_runs_and_step_scopes_in_the_program():
  xs = tuple(jnp.full((3,), 2.0) for _ in PHASES)
  window = parallel.overlap_window(step, PHASES, scan_from=3)
  text = jax.jit(window).lower(jnp.zeros(3), xs).as_text(debug_info=True)
  # steps 1..3 are one scan; 0, 4 and 5 are traced on their own
  for scope in ('overlap_step0', 'overlap_step1_3', 'overlap_step4',
                'overlap_step5'):
    assert scope in text, scope
  assert 'overlap_step2' not in text
  assert overlap._runs(PHASES, 3) == [(0, 1), (1, 3), (4, 1), (5, 1)]
  assert overlap._runs(PHASES, None) == [(k, 1) for k in range(6)]


def test_steps_of_op_names():
  assert overlap.steps_of('jit(f)/overlap_step3/jvp()/dot_general') == \
      range(3, 4)
  assert overlap.steps_of('jit(f)/overlap_step1_3/while/body/mul') == \
      range(1, 4)
  assert overlap.steps_of('jit(f)/overlap_step12') == range(12, 13)
  assert overlap.steps_of('jit(f)/shard_map/add') is None
  assert overlap.step_scope(2) == 'overlap_step2'
  assert overlap.step_scope(1, 3) == 'overlap_step1_3'


def test_bad_windows_raise():
  with pytest.raises(ValueError, match='at least one phase'):
    parallel.overlap_window(step, ())
  with pytest.raises(ValueError, match='scan_from'):
    parallel.overlap_window(step, PHASES, scan_from=0)
  window = parallel.overlap_window(step, PHASES)
  with pytest.raises(ValueError, match='6 steps but got 2 inputs'):
    window(jnp.zeros(3), (jnp.ones(3), jnp.ones(3)))
