"""Overlapped programs of Streaming DiLoCo, Eager updates and CO2: the
sync's collective is independent of the steps that overlap it (from the
compiled HLO), and the numbers are those of one program per step."""


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


def compiled_window(tx, phases):
  """The window program of ``phases`` on the 4 x 2 worker mesh."""
  window = overlap.overlap_window(window_step(tx), phases)
  mesh = helpers.worker_mesh()
  fn = jax.jit(parallel.shard_map_workers(
      lambda carry, xs: window(carry, xs)[0], mesh))
  batches = tuple(helpers.worker_batches(i) for i in range(len(phases)))
  return fn.lower(start(tx), batches).compile()


def user_steps(program, scope='jvp'):
  """Per cross-worker collective: the window steps of its users whose op
  name holds ``scope`` (``'jvp'``: the forward and backward pass), and the
  steps of its operands' gradient computation."""
  flows = parallel.collective_dataflow(program, helpers.worker_mesh())
  assert flows, 'the program has no cross-worker collective'
  out = []
  for flow in flows:
    users = {k for n in flow.users_where(scope=scope)
             for k in overlap.steps_of(n.op_name) or ()}
    operands = {k for n in flow.operands_where(scope='jvp')
                for k in overlap.steps_of(n.op_name) or ()}
    out.append((flow, users, operands))
  return out


def streaming(tau, h=6):
  return outer.streaming_diloco(
      optax.adam(1e-2), sync_every=h, fragments={'w': 1, 'b': 0},
      overlap=tau), outer.streaming_plan(h, 2, tau)


def test_plan_window_phases():
  _, plan = streaming(2, h=8)  # stride 4: sends at counts 3, 7, ...
  assert plan.window(3, 2) == ((1, None), False, (None, 1))
  assert outer.eager_plan(4).window(3, 4) == (True, False, False, False)
  with pytest.raises(ValueError, match='starts with a sync'):
    plan.window(0, 2)


@pytest.mark.parametrize('tau', [1, 2])
def test_streaming_window_collective_is_independent_of_overlapped_steps(
    tau):
  tx, plan = streaming(tau, h=8)
  phases = plan.window(3, tau)
  assert len(phases) == tau + 1
  for flow, users, operands in user_steps(compiled_window(tx, phases)):
    name = flow.node.name
    # No forward or backward pass of steps 1..tau reads the result ...
    assert not users & set(range(1, tau + 1)), (name, users)
    # ... nor feeds the collective, which reads step 0's.
    assert operands == {0}, (name, operands)
  # The merge of step tau does read it (the analysis sees consumption).
  flows = parallel.collective_dataflow(compiled_window(tx, phases),
                                       helpers.worker_mesh())
  big = max(flows, key=lambda f: f.collective.bytes_per_device)
  assert big.users_where(scope=overlap.step_scope(tau))


def test_blocking_programs_are_flagged():
  # The step after the merge waits for the collective ...
  tx, plan = streaming(1)
  phases = plan.window(2, 1) + (plan(4),)
  assert phases == ((1, None), (None, 1), False)
  got = user_steps(compiled_window(tx, phases))
  assert any(2 in users for _, users, _ in got)
  # ... and so does the step after a sync that merges at once (tau = 0).
  tx0, _ = streaming(0)
  got = user_steps(compiled_window(tx0, ((1, 1), False)))
  assert any(1 in users for _, users, _ in got)
  # CO2 without staleness reads the average at once too.
  co2 = outer.co2(optax.sgd(0.1), sync_every=3, stale=False)
  got = user_steps(compiled_window(co2, (True, False, False)))
  assert any({1, 2} <= users for _, users, _ in got)


# CO2's sync sets the parameters to the new anchor, which does not read
# the sync step's own gradient; XLA's all-reduce combiner then merges that
# step's within-worker (data-axis) reduction with a later step's, so on
# this mesh the send waits for part of a later step (the analysis reports
# it). Only Eager's operands come from step 0 alone.
@pytest.mark.parametrize('make,own', [
    (lambda: outer.eager_diloco(optax.adam(1e-2), sync_every=3), True),
    (lambda: outer.co2(optax.sgd(0.1), sync_every=3), False),
])
def test_eager_and_co2_round_is_independent_of_the_average(make, own):
  tx = make()
  for flow, users, operands in user_steps(
      compiled_window(tx, (True, False, False))):
    assert not users & {1, 2}, (flow.node.name, users)
    assert 0 in operands and (operands == {0} or not own), operands


def run_steps(tx, plan, steps, runner, window_at=()):
  """``steps`` steps of stacked workers, one program per phase, except the
  windows starting at the counts in ``window_at``, run as one program."""
  step = window_step(tx)
  carry, count = start(tx), 0
  programs = {}
  while count < steps:
    phases = (plan.window(count, window_at[count]) if count in window_at
              else (plan(count),))
    if phases not in programs:
      win = overlap.overlap_window(step, phases, scan_from=2)
      programs[phases] = jax.jit(runner(
          lambda c, xs, win=win: win(c, xs)[0]))
    xs = tuple(helpers.worker_batches(count + i) for i in range(len(phases)))
    carry = programs[phases](carry, xs)
    count += len(phases)
  return carry


RUNNERS = {'vmap': parallel.vmap_workers,
           'shard_map': lambda f: parallel.shard_map_workers(
               f, helpers.worker_mesh())}


@pytest.mark.parametrize('runner', sorted(RUNNERS))
def test_streaming_window_numbers_equal_step_by_step(runner):
  tx, plan = streaming(1, h=4)  # sends at counts 1, 3, 5, ...
  steps = 10
  windows = {c: 1 for c in range(steps - 1) if plan.is_sync(plan(c))}
  assert len(windows) == 4
  got = run_steps(tx, plan, steps, RUNNERS[runner], windows)
  want = run_steps(tx, plan, steps, RUNNERS[runner])
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
  assert int(got[1].applies[0].sum()) == 4


@pytest.mark.parametrize('runner', sorted(RUNNERS))
def test_eager_window_numbers_equal_step_by_step(runner):
  tx, plan = outer.eager_diloco(optax.adam(1e-2), sync_every=3), \
      outer.eager_plan(3)
  windows = {2: 3, 5: 3}  # [sync, inner, inner] twice, the inner scanned
  got = run_steps(tx, plan, 9, RUNNERS[runner], windows)
  want = run_steps(tx, plan, 9, RUNNERS[runner])
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
  assert int(got[1].num_syncs[0]) == 3


def test_window_moves_the_bytes_of_its_steps():
  tx, plan = streaming(1)
  phases = plan.window(2, 1)
  mesh = helpers.worker_mesh()
  params = start(tx)[0]
  want = sum(helpers.phase_report(tx, params, ph, mesh).cross_worker_bytes
             for ph in phases)
  got = parallel.collective_bytes(compiled_window(tx, phases), mesh)
  assert want > 0 and got.cross_worker_bytes == want
