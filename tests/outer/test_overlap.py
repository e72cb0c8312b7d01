"""Overlapped programs of Streaming DiLoCo, Eager updates and CO2: the
sync's collective is independent of the steps that overlap it (from the
compiled HLO), and the numbers are those of one program per step."""

import functools

import jax
import optax
import pytest

from loc_opt import outer
from loc_opt import parallel
from loc_opt.parallel import overlap
from tests import optax_conformance as conf
from tests.outer import _helpers as helpers


def window_step(tx):
  """``(carry, batch, phase) -> (carry, None)`` of stacked or per-worker
  ``(params, state)``."""

  def step(carry, batch, phase):
    params, state = carry
    return helpers.train_step(tx, phase)(params, state, batch), None

  return step


def start(tx):
  params = helpers.stack(conf.example_params())
  return params, jax.vmap(tx.init)(params)


TXS = {
    'streaming': lambda tau: outer.streaming_diloco(
        optax.adam(1e-2), sync_every=8, fragments={'w': 1, 'b': 0},
        overlap=tau),
    'eager': lambda _: outer.eager_diloco(optax.adam(1e-2), sync_every=3),
    'co2': lambda _: outer.co2(optax.sgd(0.1), sync_every=3),
}


@functools.cache
def compiled_window(name, tau, phases):
  """The window program of ``phases`` on the 4 x 2 worker mesh."""
  tx = TXS[name](tau)
  window = overlap.overlap_window(window_step(tx), phases)
  mesh = helpers.worker_mesh()
  fn = jax.jit(parallel.shard_map_workers(
      lambda carry, xs: window(carry, xs)[0], mesh))
  batches = tuple(helpers.worker_batches(i) for i in range(len(phases)))
  return fn.lower(start(tx), batches).compile(
      compiler_options=overlap.COMPILER_OPTIONS)


# The gradient computation's matmuls (forward and backward). Finer ops are
# not attributed to a step reliably: XLA merges identical ones of two
# steps (keeping one step's name) and fuses a step's small ops into the
# next one's kernels.
MATMULS = ('dot', 'convolution')


def user_steps(program, mesh=None):
  """Per cross-worker collective: the window steps of the matmuls that
  read its result, and of those that feed it (``mesh``: the program's, the
  4 x 2 worker mesh by default)."""
  flows = parallel.collective_dataflow(program, mesh or helpers.worker_mesh())
  assert flows, 'the program has no cross-worker collective'
  out = []
  for flow in flows:
    users = {k for n in flow.users_where(opcodes=MATMULS)
             for k in overlap.steps_of(n.op_name) or ()}
    operands = {k for n in flow.operands_where(opcodes=MATMULS)
                for k in overlap.steps_of(n.op_name) or ()}
    out.append((flow, users, operands))
  return out


def test_plan_window_phases():
  plan = outer.streaming_plan(8, 2, 2)  # stride 4: sends at counts 3, 7
  assert plan.window(3, 2) == ((1, None), False, (None, 1))
  assert plan.window(7, 2) == ((0, None), False, (None, 0))
  assert outer.eager_plan(4).window(3, 4) == (True, False, False, False)
  with pytest.raises(ValueError, match='starts with a sync'):
    plan.window(0, 2)


# Streaming DiLoCo, H = 8, P = 2, tau = 2: fragment 1 is sent at count 3,
# the next step is an inner step, and its merge lands at count 5.
WINDOW = ((1, None), False, (None, 1))


def test_streaming_window_collective_is_independent_of_overlapped_steps():
  program = compiled_window('streaming', 2, WINDOW)
  for flow, users, operands in user_steps(program):
    name = flow.node.name
    # No matmul of steps 1 and 2 (forward or backward) reads the result ...
    assert not users & {1, 2}, (name, users)
    # ... nor feeds the collective, which reads step 0's.
    assert operands == {0}, (name, operands)
  # The merge of step 2 does read it (the analysis sees consumption).
  flows = parallel.collective_dataflow(program, helpers.worker_mesh())
  big = max(flows, key=lambda f: f.collective.bytes_per_device)
  assert big.users_where(scope=overlap.step_scope(2))


def test_blocking_programs_are_flagged():
  # The step after the merge waits for the collective ...
  got = user_steps(compiled_window('streaming', 2, WINDOW + (False,)))
  assert any(3 in users for _, users, _ in got)
  # ... and so does the step after a sync that merges at once (tau = 0).
  got = user_steps(compiled_window('streaming', 0, ((1, 1), False)))
  assert any(1 in users for _, users, _ in got)


@pytest.mark.parametrize('name', ['eager', 'co2'])
def test_eager_and_co2_round_is_independent_of_the_average(name):
  program = compiled_window(name, 0, (True, False, False))
  for flow, users, operands in user_steps(program):
    assert not users & {1, 2}, (flow.node.name, users)
    assert operands == {0}, (flow.node.name, operands)


@pytest.mark.parametrize('name', ['eager', 'co2'])
def test_round_is_independent_under_the_all_reduce_combiner(name):
  # Compiled with XLA's all-reduce combiner (the default, not the windows'
  # COMPILER_OPTIONS). When the sync's reduction was a GSPMD-partitioned
  # pmean, the combiner merged CO2's send with a later step's data-axis
  # reduction, so it waited for that step's forward pass. worker_mean now
  # reduces inside a shard_map of its own over the worker's devices, and the
  # round stays independent either way; the windows keep the options.
  tx = TXS[name](0)
  window = overlap.overlap_window(window_step(tx), (True, False, False))
  mesh = helpers.worker_mesh()
  fn = jax.jit(parallel.shard_map_workers(
      lambda carry, xs: window(carry, xs)[0], mesh))
  batches = tuple(helpers.worker_batches(i) for i in range(3))
  program = fn.lower(start(tx), batches).compile()
  for flow, users, operands in user_steps(program):
    assert not users & {1, 2}, (flow.node.name, users)
    assert operands == {0}, (flow.node.name, operands)


def run_windows(tx, plan, steps, runner, overlap_steps):
  """``steps`` steps of stacked workers, each sync and the steps that
  overlap it as one program (``plan.window``), other steps one by one."""
  step = window_step(tx)
  carry, count = start(tx), 0
  programs = {}
  while count < steps:
    phases = (plan(count),)
    if plan.is_sync(phases[0]):
      phases = plan.window(count, overlap_steps)
    if phases not in programs:
      win = overlap.overlap_window(step, phases, scan_from=2)
      programs[phases] = jax.jit(runner(
          lambda c, xs, win=win: win(c, xs)[0]))
    xs = tuple(helpers.worker_batches(count + i) for i in range(len(phases)))
    carry = programs[phases](carry, xs)
    count += len(phases)
  return carry, programs


RUNNERS = {'vmap': parallel.vmap_workers,
           'shard_map': lambda f: parallel.shard_map_workers(
               f, helpers.worker_mesh())}


@pytest.mark.parametrize('runner', sorted(RUNNERS))
def test_streaming_window_numbers_equal_simulated(runner):
  # H = 4, P = 2, tau = 1: sends at counts 1, 3, 5, 7, each merged a step
  # later; the reference decides each phase on device (sync=None).
  tx = outer.streaming_diloco(optax.adam(1e-2), sync_every=4,
                              fragments={'w': 1, 'b': 0}, overlap=1)
  got, programs = run_windows(tx, outer.streaming_plan(4, 2, 1), 9,
                              RUNNERS[runner], 1)
  assert sorted(map(len, programs)) == [1, 2, 2]
  want = helpers.run_workers(tx, 9, runner=RUNNERS[runner])
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
  assert int(got[1].applies[0].sum()) == 4


def test_eager_window_numbers_equal_simulated():
  # [sync, inner, inner] twice, the inner steps under one lax.scan.
  tx = outer.eager_diloco(optax.adam(1e-2), sync_every=3)
  got, programs = run_windows(tx, outer.eager_plan(3), 8,
                              parallel.vmap_workers, 3)
  assert sorted(map(len, programs)) == [1, 3]
  want = helpers.run_workers(tx, 8)
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
  assert int(got[1].num_syncs[0]) == 2
