"""Tests of loc_opt.outer.async_local_sgd: Delayed Nesterov, DyLU, ticks."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import outer
from loc_opt import parallel
from tests import optax_conformance as conf
from tests.outer import _helpers as helpers

M = helpers.M


# ------------------------------------------------------ Delayed Nesterov ---
def pushes(num, shape=(5,)):
  key = jax.random.key(3)
  return [{'w': jax.random.normal(jax.random.fold_in(key, i), shape)}
          for i in range(num)]


def run_outer(tx, grads, phi):
  state = tx.init(phi)
  update = jax.jit(tx.update)
  trajectory = []
  for g in grads:
    u, state = update(g, state, phi)
    phi = optax.apply_updates(phi, u)
    trajectory.append(phi)
  return trajectory


def test_dn_buffer_one_is_nesterov():
  phi = {'w': jnp.arange(5.0)}
  grads = pushes(6)
  got = run_outer(outer.delayed_nesterov(0.3, 0.8, buffer_size=1), grads, phi)
  want = run_outer(optax.sgd(0.3, momentum=0.8, nesterov=True), grads, phi)
  for a, b in zip(got, want):
    conf.assert_trees_close(a, b, rtol=1e-6, atol=1e-6)


def test_dn_moves_one_nesterov_step_per_buffer_on_the_average():
  n, lr, beta = 3, 0.7, 0.9
  phi = {'w': jnp.arange(5.0)}
  grads = pushes(2 * n)
  got = run_outer(outer.delayed_nesterov(lr, beta, buffer_size=n), grads, phi)
  means = [jax.tree.map(lambda *g: sum(g) / n, *grads[i:i + n])
           for i in (0, n)]
  want = run_outer(optax.sgd(lr, momentum=beta, nesterov=True), means, phi)
  conf.assert_trees_close(got[n - 1], want[0], rtol=1e-6, atol=1e-6)
  conf.assert_trees_close(got[2 * n - 1], want[1], rtol=1e-6, atol=1e-6)
  # In between, each push moves phi by plain SGD on g / N (c = 0).
  step = jax.tree.map(lambda a, b: a - b, got[n + 1], got[n])
  conf.assert_trees_close(
      step, jax.tree.map(lambda g: -lr * g / n, grads[n + 1]), rtol=1e-5)


def test_dn_activation_spreads_the_momentum_analytically():
  # N = 2, c = 1/2, beta = 0.9, lr 1, pushes of 1 from zero momentum:
  # push 1 (no boundary): d = c b m + g/2 = 0.5; push 2 (boundary):
  # m = (1 + 1) / 2 = 1, d = (1 - cN + c) b m + g/2 = 0.45 + 0.5 = 0.95;
  # push 3: d = c b m + g/2 = 0.45 + 0.5 = 0.95; push 4: m = 0.9 + 1 = 1.9,
  # d = 0.5 * 0.9 * 1.9 + 0.5 = 1.355.
  tx = outer.delayed_nesterov(1.0, 0.9, buffer_size=2, activation=0.5)
  phi = {'w': jnp.zeros(2)}
  ones = [{'w': jnp.ones(2)}] * 4
  got = [float(p['w'][0]) for p in run_outer(tx, ones, phi)]
  np.testing.assert_allclose(np.diff([0.0] + got),
                             [-0.5, -0.95, -0.95, -1.355], rtol=1e-6)


@pytest.mark.parametrize('kwargs,name', [
    ({'buffer_size': 2, 'activation': 0.6}, 'activation'),
    ({'buffer_size': 4, 'activation': -0.1}, 'activation'),
    ({'buffer_size': 0}, 'buffer_size'),
    ({'buffer_size': 1.5}, 'buffer_size'),
    ({'momentum': 1.0}, 'momentum'),
])
def test_dn_validates_its_arguments(kwargs, name):
  with pytest.raises(ValueError, match=name):
    outer.delayed_nesterov(0.1, **kwargs)


def test_dn_activation_at_its_bound_is_accepted():
  outer.delayed_nesterov(0.1, buffer_size=4, activation=0.25)


def test_dn_conformance(tmp_path):
  conf.check_all(
      lambda learning_rate: outer.delayed_nesterov(
          learning_rate, 0.9, buffer_size=2, activation=0.25), tmp_path)


# -------------------------------------------------------- speeds, events ---
def test_dylu_periods():
  assert outer.dylu_periods((1, 1, 1, 0.5), 10) == (10, 10, 10, 5)
  assert outer.dylu_periods((1, 1, 1, 0.5), 10, dylu=False) == (10,) * 4
  # Any unit: steps per second, normalised by the fastest.
  assert outer.dylu_periods((4.0, 2.0, 1.0), 8) == (8, 4, 2)
  assert outer.dylu_periods((0.29, 1.0), 100) == (29, 100)  # no 28.99 floor
  assert outer.dylu_periods((1.0, 0.01), 10) == (10, 1)  # at least one step


@pytest.mark.parametrize('speeds', [(), (1.0, 0.0), (1.0, -1.0),
                                    (1.0, float('nan')), (1.0, True)])
def test_speeds_are_validated(speeds):
  with pytest.raises(ValueError, match='speeds'):
    outer.dylu_periods(speeds, 10)


@pytest.mark.parametrize('bad', [0, -1, 2.5, True])
def test_sync_every_is_validated(bad):
  with pytest.raises(ValueError, match='sync_every'):
    outer.dylu_periods((1.0,), bad)


def test_dylu_makes_a_straggler_finish_with_the_others():
  speeds, h, ticks = (1, 1, 1, 0.5), 10, 60
  events = outer.async_events(speeds, outer.dylu_periods(speeds, h), ticks)
  finish = [[k for k, e in enumerate(events) if w in e.finishing]
            for w in range(M)]
  for w in range(M):
    assert finish[w] == [9, 19, 29, 39, 49, 59]
  # Without DyLU the 2x straggler finishes every 2H ticks.
  events = outer.async_events(speeds, (h,) * M, ticks)
  assert [k for k, e in enumerate(events) if 3 in e.finishing] == [19, 39, 59]
  assert [k for k, e in enumerate(events) if 0 in e.finishing] == [
      9, 19, 29, 39, 49, 59]


def test_inner_steps_follow_speed_times_ticks():
  speeds = (2.0, 1.0, 2.0 / 3, 1.4)  # relative 1, 1/2, 1/3, 0.7
  events = outer.async_events(speeds, (3, 3, 3, 3), 30)
  for ticks in (1, 2, 7, 10, 30):
    steps = [sum(w in e.active for e in events[:ticks]) for w in range(M)]
    assert steps == [ticks, ticks // 2, ticks // 3, (7 * ticks) // 10]
  # Speed 1/2 steps on ticks 1, 3, 5, ...; finishing implies active.
  assert [k for k, e in enumerate(events[:8]) if 1 in e.active] == [1, 3, 5, 7]
  for e in events:
    assert set(e.finishing) <= set(e.active)
  # Every round is H_w steps: worker 3 finishes at its 3rd, 6th, ... step.
  done = [k for k, e in enumerate(events) if 3 in e.finishing]
  assert [sum(3 in e.active for e in events[:k + 1]) for k in done] == [
      3, 6, 9, 12, 15, 18, 21]


def test_plan_names_the_finishers():
  plan = outer.async_plan((1, 1, 1, 0.5), 4)
  assert [plan(c) for c in range(8)] == [False, False, False, (0, 1, 2, 3)] * 2
  plan = outer.async_plan((1, 1, 1, 0.5), 4, dylu=False)
  assert plan(3) == (0, 1, 2) and plan(7) == (0, 1, 2, 3)
  assert plan.phases(8) == (False, (0, 1, 2), (0, 1, 2, 3))
  assert plan.num_syncs(0, 8) == 2


# ------------------------------------------------------ async local SGD ---
def init_params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {'w': jax.random.normal(k1, (16, 8)) / 4,
          'b': jax.random.normal(k2, (8,))}


def run_workers(tx, ticks, plan=None, runner=parallel.vmap_workers,
                params=None, batches=helpers.wide_batches,
                loss=helpers.quad_loss):
  """Runs M workers for `ticks` ticks; with a plan, one program per phase."""
  programs = {}

  def program(phase):
    if phase not in programs:
      programs[phase] = jax.jit(runner(helpers.train_step(tx, phase, loss)))
    return programs[phase]

  params = helpers.stack(init_params()) if params is None else params
  state = jax.vmap(tx.init)(params)
  for k in range(ticks):
    phase = None if plan is None else plan(k)
    params, state = program(phase)(params, state, batches(k))
  return params, state, programs


def test_equal_speeds_first_round_equals_diloco():
  # The default outer is DN with lr 0.7, beta 0.9, N = M and c = 0: after M
  # pushes of one round it has made DiLoCo's outer Nesterov step.
  h = 3
  inner = optax.sgd(0.1)
  tx = outer.async_local_sgd(inner, speeds=(1.0,) * M, sync_every=h)
  got, state, _ = run_workers(tx, h)
  ref = loc_opt.diloco(inner, sync_every=h,
                       outer=optax.sgd(0.7, momentum=0.9, nesterov=True))
  want, ref_state, _ = run_workers(ref, h)
  anchor = jax.tree.map(lambda x: x[0], ref_state.anchor)
  for w in range(M):
    conf.assert_trees_close(
        jax.tree.map(lambda x, w=w: x[w], state.server_params), anchor,
        rtol=1e-5, atol=1e-6)
  # The last pusher pulls the final phi; the first one pulled after its own
  # push only (plain SGD on its delta / N), so it differs.
  conf.assert_trees_close(jax.tree.map(lambda x: x[M - 1], got), anchor,
                          rtol=1e-5, atol=1e-6)
  assert not np.allclose(got['w'][0], want['w'][0], atol=1e-4)
  np.testing.assert_array_equal(state.num_pushes, M)
  np.testing.assert_array_equal(state.version, [1, 2, 3, 4])
  np.testing.assert_array_equal(state.round_steps, 0)


def const_loss(params, batch):
  del batch
  return sum(jnp.sum(x) for x in jax.tree.leaves(params))  # gradient 1


def test_straggler_trace_is_analytic():
  # Inner SGD lr 1 on gradient 1: theta -= 1 per step. Outer SGD lr 1:
  # phi <- phi - delta. Speeds (1, 1/2), H = 2, no DyLU, phi0 = 0:
  # tick 1: w0 pushes 0 - (-2) = 2: phi = -2, w0 pulls -2 (version 1);
  # tick 3: w0 (from -2, at -4) pushes 2: phi = -4, w0 pulls -4; w1 (from 0,
  #   at -2, stepped on ticks 1 and 3) pushes 2 against its stale start:
  #   phi = -6, w1 pulls -6 (version 3).
  tx = outer.async_local_sgd(optax.sgd(1.0), speeds=(1.0, 0.5), sync_every=2,
                             dylu=False, outer=optax.sgd(1.0))
  params = helpers.stack({'w': jnp.zeros(3)}, 2)
  trace = []
  for ticks in range(1, 5):
    got, state, _ = run_workers(tx, ticks, params=params, loss=const_loss,
                                batches=lambda k: jnp.zeros(2))
    trace.append((got['w'][:, 0].tolist(),
                   state.server_params['w'][:, 0].tolist()))
  assert trace == [([-1, 0], [0, 0]), ([-2, -1], [-2, -2]),
                   ([-3, -1], [-2, -2]), ([-4, -6], [-6, -6])]
  np.testing.assert_array_equal(state.num_pushes, [3, 3])
  np.testing.assert_array_equal(state.version, [2, 3])
  np.testing.assert_array_equal(state.start_params['w'][:, 0], [-4, -6])
  np.testing.assert_array_equal(state.count, [4, 4])
  eval_params = outer.async_eval_params(
      jax.tree.map(lambda x: x[1], state), {'w': jnp.zeros(3, jnp.bfloat16)})
  assert eval_params['w'].dtype == jnp.bfloat16
  np.testing.assert_array_equal(eval_params['w'], -6)


def test_idle_worker_returns_zero_and_keeps_its_inner_state():
  tx = outer.async_local_sgd(optax.adam(1e-2), speeds=(1.0, 1.0, 1.0, 0.5),
                             sync_every=4)
  params = helpers.stack(init_params())
  got, state, _ = run_workers(tx, 1, params=params)
  adam = state.inner_state[0]
  np.testing.assert_array_equal(adam.count, [1, 1, 1, 0])
  np.testing.assert_array_equal(adam.mu['w'][3], 0)
  np.testing.assert_array_equal(got['w'][3], params['w'][3])
  assert not np.allclose(got['w'][0], params['w'][0])


# Heterogeneous workers without DyLU: worker 1 (speed 1/2) pushes every 4
# ticks, the others every 2, so the plan has phases False, (0, 2, 3) and
# (0, 1, 2, 3).
HETERO = dict(speeds=(1.0, 0.5, 1.0, 1.0), sync_every=2, dylu=False)
TICKS = 8


@pytest.fixture(scope='module')
def hetero():
  tx = outer.async_local_sgd(optax.adam(1e-2), **HETERO)
  return tx, run_workers(tx, TICKS)  # sync=None: decided on device


def test_plan_equals_on_device_decision(hetero):
  tx, (want, want_state, _) = hetero
  plan = outer.async_plan(**HETERO)
  got, got_state, programs = run_workers(tx, TICKS, plan=plan)
  assert set(programs) == {False, (0, 2, 3), (0, 1, 2, 3)}
  np.testing.assert_array_equal(want_state.num_pushes, 14)
  np.testing.assert_array_equal(want_state.version, [11, 12, 13, 14])
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
  conf.assert_trees_close(got_state, want_state, rtol=1e-6, atol=1e-6)


def test_dylu_transform_follows_its_periods():
  # DyLU gives worker 1 (speed 1/2) one step per round: all finish together.
  tx = outer.async_local_sgd(optax.sgd(1e-2), speeds=HETERO['speeds'],
                             sync_every=2)
  _, state, _ = run_workers(tx, 4)
  np.testing.assert_array_equal(state.num_pushes, 8)
  np.testing.assert_array_equal(state.version, [5, 6, 7, 8])


def compiled(tx, sync, mesh):
  params = helpers.stack(init_params())
  state = jax.vmap(tx.init)(params)
  step = parallel.shard_map_workers(helpers.train_step(tx, sync), mesh)
  return jax.jit(step).lower(params, state, helpers.wide_batches(0)).compile()


def test_only_pushing_phases_cross_workers(hetero):
  mesh = parallel.make_worker_mesh(M, data=2)
  tx, (want, want_state, _) = hetero
  params = init_params()
  payload = outer.push_bytes(params)
  assert payload == 4 * (16 * 8 + 8)
  for phase in (False, (0, 2, 3)):
    report = parallel.collective_bytes(compiled(tx, phase, mesh), mesh)
    want_bytes = outer.async_phase_bytes(params, phase)
    sent = report.cross_worker_bytes_per_worker
    if not phase:
      assert want_bytes == 0 and report.cross_worker_bytes == 0
      assert report.cross_worker_bytes_range == (0, 0)
    else:
      assert want_bytes == payload  # every worker sends its delta once
      assert 0.9 * payload <= sent <= 1.1 * payload, (phase, sent, payload)
  # sync=None: the all-gather sits in one branch of the lax.cond only.
  program = compiled(tx, None, mesh)
  report = parallel.collective_bytes(program, mesh)
  assert report.cross_worker_bytes == 0
  lo, hi = report.cross_worker_bytes_range
  assert lo == 0 and 0.9 * payload * M <= hi <= 1.1 * payload * M
  # ... and it runs on the mesh with the numbers of the vmap simulation.
  params = helpers.stack(init_params())
  state = jax.vmap(tx.init)(params)
  for k in range(TICKS):
    params, state = program(params, state, helpers.wide_batches(k))
  conf.assert_trees_close(params, want, rtol=1e-6, atol=1e-6)
  conf.assert_trees_close(state, want_state, rtol=1e-6, atol=1e-6)
  assert state.count.sharding.spec == jax.P('worker')


# ---------------------------------------------------- conformance, args ---
def make_single(learning_rate):
  return outer.async_local_sgd(optax.sgd(learning_rate), speeds=(3.0,),
                               sync_every=2, axis_name=None)


def test_one_worker_conformance(tmp_path):
  conf.check_all(make_single, tmp_path)


def test_one_worker_with_plain_outer_is_the_inner_optimizer():
  inner = optax.adam(1e-2)
  tx = outer.async_local_sgd(inner, speeds=(1.0,), sync_every=3,
                             outer=optax.sgd(1.0), axis_name=None)
  got, _ = conf.run(tx, conf.example_params(), 7)
  want, _ = conf.run(inner, conf.example_params(), 7)
  conf.assert_trees_close(got, want)


def test_bf16_params_keep_fp32_server():
  state = make_single(1e-2).init(conf.example_params(jnp.bfloat16))
  assert state.server_params['w'].dtype == jnp.float32
  assert state.start_params['w'].dtype == jnp.float32


def test_bad_phase_and_worker_count_raise():
  tx = outer.async_local_sgd(optax.sgd(0.1), speeds=(1.0, 0.5, 1.0),
                             sync_every=2)

  def trace(sync, m):
    params = jax.eval_shape(lambda: helpers.stack(init_params(), m))
    state = jax.eval_shape(jax.vmap(tx.init), params)
    jax.eval_shape(parallel.vmap_workers(helpers.train_step(tx, sync)),
                   params, state,
                   jax.eval_shape(lambda: helpers.wide_batches(0, m)))

  with pytest.raises(ValueError, match='speeds'):
    trace(False, 4)
  with pytest.raises(ValueError, match='axis_name'):
    outer.async_local_sgd(optax.sgd(0.1), speeds=(1.0, 0.5), sync_every=2,
                          axis_name=None)
  for bad in (True, (1, 0), (0, 3), (0, 0), 'all'):
    with pytest.raises(ValueError, match='sync'):
      trace(bad, 3)
  trace((0, 2), 3)  # a valid phase traces
