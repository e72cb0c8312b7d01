"""Tests of NoLoCo (loc_opt.outer.noloco): groups, math, programs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import outer
from loc_opt import parallel
from loc_opt.outer.noloco import noloco_group_ids
from tests import optax_conformance as conf
from tests.outer import _helpers as helpers

M = helpers.M


def model_params(m=M):
  """Distinct per-worker params: a 16x8 matrix and an 8-bias."""
  k1, k2 = jax.random.split(jax.random.key(3))
  return {'w': jax.random.normal(k1, (m, 16, 8)),
          'b': jax.random.normal(k2, (m, 8))}


_PROGRAMS = {}


def program(tx, sync, params, state, batch, mesh=None):
  """The compiled step of phase ``sync`` (cached: tests share programs)."""
  avals = tuple((x.shape, str(x.dtype))
                for x in jax.tree.leaves((params, state, batch)))
  key = (tx, sync, mesh, avals)
  if key not in _PROGRAMS:
    step = helpers.train_step(tx, sync)
    if mesh is None:
      mapped = parallel.vmap_workers(step)
    else:
      mapped = parallel.shard_map_workers(step, mesh)
    _PROGRAMS[key] = jax.jit(mapped).lower(params, state, batch).compile()
  return _PROGRAMS[key]


def run(tx, steps, params, *, plan=None, phase=None, mesh=None):
  """Trains the workers; phases from ``plan``, else ``phase`` every step."""
  num_workers = jax.tree.leaves(params)[0].shape[0]
  state = jax.vmap(tx.init)(params)
  for i in range(steps):
    sync = plan(i) if plan is not None else phase
    args = (params, state, helpers.wide_batches(i, num_workers))
    compiled = program(tx, sync, *args, mesh)
    if mesh is not None:  # e.g. a sync leaves its output spread over 'data'
      args = jax.device_put(args, compiled.input_shardings[0])
    params, state = compiled(*args)
  return params, state


# Shared by several tests, so that they share compiled programs.
TX = {n: outer.noloco(optax.sgd(0.1), sync_every=2, group_size=n)
      for n in (2, 4)}


# ----------------------------------------------------------------- groups ---


@pytest.mark.parametrize('m,n', [(4, 2), (8, 2), (8, 4), (6, 3), (4, 1),
                                 (4, 4)])
def test_groups_partition_the_workers(m, n):
  for r in range(6):
    groups = outer.noloco_groups(7, r, m, n)
    assert len(groups) == m // n
    assert all(len(g) == n and list(g) == sorted(g) for g in groups)
    assert sorted(r for g in groups for r in g) == list(range(m))
    assert list(groups) == sorted(groups)


def test_groups_follow_the_reference_rule():
  # rank perm[k] joins group k mod (M / n): groups are strided slices of perm.
  perm = np.asarray(jax.random.permutation(
      jax.random.fold_in(jax.random.key(5), 3), 8))
  want = {tuple(sorted(perm[g::4].tolist())) for g in range(4)}
  assert set(outer.noloco_groups(5, 3, 8, 2)) == want


@pytest.mark.parametrize('m,n', [(8, 2), (6, 3)])
def test_device_groups_equal_host_groups_on_every_worker(m, n):
  def ids(round_index):  # one worker's computation, round index traced
    return noloco_group_ids(11, round_index, m, n)

  rounds = jnp.arange(5)
  got = jax.jit(jax.vmap(jax.vmap(ids, axis_name='worker'), in_axes=0))(
      jnp.broadcast_to(rounds[:, None], (5, m)))
  for r in range(5):
    host = outer.noloco_groups(11, r, m, n)
    want = np.empty(m, np.int32)
    for g, members in enumerate(host):
      want[list(members)] = g
    for worker in range(m):  # every worker computed the same groups
      np.testing.assert_array_equal(got[r, worker], want)


def test_rounds_redraw_the_groups():
  draws = [outer.noloco_groups(0, r, 8, 2) for r in range(12)]
  assert len(set(draws)) >= 6
  assert outer.noloco_groups(0, 0, 8, 2) != outer.noloco_groups(1, 0, 8, 2)


def test_group_size_must_divide_workers():
  with pytest.raises(ValueError, match='group_size'):
    outer.noloco_groups(0, 0, 6, 4)
  with pytest.raises(ValueError, match='group_size'):
    outer.noloco_plan(5, num_workers=6, group_size=4)


def test_plan_phases():
  plan = outer.noloco_plan(3, num_workers=M, seed=2)
  assert [plan(c) for c in (0, 1, 3, 4, 6, 7)] == [False] * 6
  assert plan(2) == outer.noloco_groups(2, 0, M, 2)
  assert plan(5) == outer.noloco_groups(2, 1, M, 2)
  assert plan(299) == outer.noloco_groups(2, 99, M, 2)
  assert plan.num_syncs(0, 9) == 3
  assert plan.phases(6)[0] is False


# ------------------------------------------------------------------- math ---


def reference_noloco(params, grads, groups_by_round, sync_every, lr,
                     momentum, consensus):
  """NumPy NoLoCo with inner SGD lr 1: params [M, d], grads [T, M, d]."""
  theta = np.array(params, np.float64)
  phi, delta = theta.copy(), np.zeros_like(theta)
  for t, g in enumerate(grads):
    theta = theta - g
    if (t + 1) % sync_every:
      continue
    groups = groups_by_round[(t + 1) // sync_every - 1]
    pseudo = phi - theta
    new_phi = phi.copy()
    for group in groups:
      idx = list(group)
      mean_pseudo, mean_phi = pseudo[idx].mean(0), phi[idx].mean(0)
      for i in idx:
        delta[i] = (momentum * delta[i] - lr * mean_pseudo
                    - consensus * (phi[i] - mean_phi))
        new_phi[i] = phi[i] + delta[i]
    phi, theta = new_phi, new_phi.copy()
  return theta


@pytest.mark.parametrize('consensus', [0.3, None])
def test_hand_computed_syncs_with_consensus(consensus):
  # Inner SGD lr 1 on fixed gradients; H = 2, fixed groups per round.
  gamma = 0.7 if consensus is None else consensus  # default: gamma = beta
  rng = np.random.default_rng(0)
  params = rng.normal(size=(M, 3)).astype(np.float32)
  grads = rng.normal(size=(6, M, 3)).astype(np.float32)
  rounds = [((0, 2), (1, 3)), ((0, 1), (2, 3)), ((0, 3), (1, 2))]
  tx = outer.noloco(optax.sgd(1.0), sync_every=2, learning_rate=0.7,
                    momentum=0.5, consensus=consensus)

  def step(p, s, g, sync):
    u, s = tx.update({'w': g}, s, p, sync=sync)
    return optax.apply_updates(p, u), s

  p = {'w': jnp.asarray(params)}
  s = jax.vmap(tx.init)(p)
  for t in range(6):
    sync = rounds[t // 2] if t % 2 else False
    p, s = jax.jit(parallel.vmap_workers(
        functools.partial(step, sync=sync)))(p, s, jnp.asarray(grads[t]))
  want = reference_noloco(params, grads, rounds, 2, 0.7, 0.5, gamma)
  np.testing.assert_allclose(p['w'], want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(s.anchor['w'], want, rtol=1e-5, atol=1e-6)
  assert int(s.num_syncs[0]) == 3
  # One sync by hand: worker 0 with peer 2, delta starts at zero.
  p1 = {'w': jnp.asarray(params)}
  s1 = jax.vmap(tx.init)(p1)
  p1, _ = jax.jit(parallel.vmap_workers(
      functools.partial(step, sync=rounds[0])))(p1, s1,
                                                jnp.asarray(grads[0]))
  mean_pseudo = (grads[0, 0] + grads[0, 2]) / 2  # phi - (phi - g) = g
  mean_phi = (params[0] + params[2]) / 2
  hand = params[0] - 0.7 * mean_pseudo - gamma * (params[0] - mean_phi)
  np.testing.assert_allclose(p1['w'][0], hand, rtol=1e-6, atol=1e-6)


def test_one_group_of_all_workers_is_diloco_with_heavy_ball():
  params = helpers.stack(jax.tree.map(lambda x: x[0], model_params()))
  tx = outer.noloco(optax.adam(1e-2), sync_every=3, learning_rate=0.7,
                    momentum=0.5, group_size=M)
  got, state = run(tx, 9, params, plan=outer.noloco_plan(3, M, group_size=M))
  ref = loc_opt.diloco(optax.adam(1e-2), sync_every=3,
                       outer=optax.sgd(0.7, momentum=0.5))
  want, want_state = run(ref, 9, params)
  conf.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
  conf.assert_trees_close(state.anchor, want_state.anchor, rtol=1e-5,
                          atol=1e-6)
  # delta = -lr * v: the momenta agree too.
  conf.assert_trees_close(
      state.momentum,
      jax.tree.map(lambda v: -0.7 * v, want_state.outer_state[0].trace),
      rtol=1e-5, atol=1e-6)
  assert int(state.num_syncs[0]) == 3


def test_full_consensus_is_gossip_averaging_in_groups():
  # lr 1, momentum 0, consensus 1: phi_i <- mean over i's group of theta'.
  params = model_params()
  inner = optax.sgd(0.1)
  groups = ((0, 3), (1, 2))
  tx = outer.noloco(inner, sync_every=2, learning_rate=1.0, momentum=0.0,
                    consensus=1.0)
  got, _ = run(tx, 2, params, plan=lambda c: groups if c == 1 else False)
  local, _ = run(tx, 2, params, phase=False)
  for group in groups:
    mean = jax.tree.map(lambda x: x[np.array(group)].mean(0), local)
    for i in group:
      conf.assert_trees_close(jax.tree.map(lambda x: x[i], got), mean)
  # No global model: the two groups disagree.
  assert not np.allclose(got['w'][0], got['w'][1])


def test_plan_equals_on_device_decision():
  params = model_params()
  tx = outer.noloco(optax.adam(1e-2), sync_every=2, seed=3)
  plan = outer.noloco_plan(2, M, seed=3)
  assert plan(1) != plan(3)  # two pairings are exercised
  got, state = run(tx, 4, params, plan=plan)
  want, want_state = run(tx, 4, params)  # sync=None: lax.cond + gather
  # Equal up to a rounding of the differently fused programs.
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
  conf.assert_trees_close(state, want_state, rtol=1e-6, atol=1e-7)
  assert int(state.num_syncs[0]) == 2
  # sync=True: static timing, groups computed on device.
  dyn, _ = run(tx, 4, params, plan=lambda c: plan.is_sync(plan(c)))
  conf.assert_trees_close(dyn, want, rtol=1e-6, atol=1e-7)


def test_plan_equals_on_device_decision_groups_of_four():
  params = model_params(8)
  tx = outer.noloco(optax.sgd(0.1), sync_every=2, group_size=4, seed=1)
  plan = outer.noloco_plan(2, 8, group_size=4, seed=1)
  got, _ = run(tx, 2, params, plan=plan)
  want, _ = run(tx, 2, params)
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-7)


def test_shard_map_matches_vmap():
  params = model_params()
  plan = outer.noloco_plan(2, M)
  want, _ = run(TX[2], 2, params)
  got, state = run(TX[2], 2, params, plan=plan, mesh=helpers.worker_mesh())
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
  cond, _ = run(TX[2], 2, params, mesh=helpers.worker_mesh())
  conf.assert_trees_close(cond, want, rtol=1e-6, atol=1e-6)
  assert state.count.sharding.spec == jax.P('worker')


def test_eval_params_are_own_outer_params_in_param_dtype():
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), model_params())
  tx = TX[2]
  got, state = run(tx, 3, params, plan=outer.noloco_plan(2, M))
  assert state.anchor['w'].dtype == state.momentum['w'].dtype == jnp.float32
  assert got['w'].dtype == jnp.bfloat16
  evals = jax.vmap(outer.noloco_eval_params)(state, got)
  assert evals['w'].dtype == jnp.bfloat16
  np.testing.assert_array_equal(
      np.asarray(evals['w'], np.float32),
      np.asarray(state.anchor['w'].astype(jnp.bfloat16), np.float32))
  assert not np.allclose(np.asarray(evals['w'][0], np.float32),
                         np.asarray(got['w'][0], np.float32))


# ----------------------------------------------------------- arguments ---


@pytest.mark.parametrize('bad', [0, -2, 2.5, True])
def test_sync_every_must_be_a_positive_int(bad):
  with pytest.raises(ValueError, match='sync_every'):
    outer.noloco(optax.sgd(0.1), sync_every=bad)


def test_bad_group_size_raises():
  with pytest.raises(ValueError, match='group_size'):
    outer.noloco(optax.sgd(0.1), sync_every=2, group_size=0)
  with pytest.raises(ValueError, match='group_size'):
    outer.noloco(optax.sgd(0.1), sync_every=2, axis_name=None)
  tx = outer.noloco(optax.sgd(0.1), sync_every=2, group_size=3)
  with pytest.raises(ValueError, match='group_size'):
    run(tx, 1, model_params())


@pytest.mark.parametrize('bad', [((0, 1), (2, 2)), ((0, 1, 2, 3),),
                                 ((0, 1),), 'x'])
def test_bad_static_groups_raise(bad):
  tx = TX[2]
  with pytest.raises(ValueError, match='sync'):
    run(tx, 1, model_params(), phase=bad)


def make_single(learning_rate):
  return outer.noloco(optax.adam(learning_rate), sync_every=3, group_size=1,
                      axis_name=None)


def test_conformance(tmp_path):
  conf.check_all(make_single, tmp_path)


# ---------------------------------------------------------------- bytes ---


@pytest.mark.parametrize('group_size', [2, 4])
def test_sync_program_only_permutes_its_payload(group_size):
  mesh = helpers.worker_mesh()
  params = model_params()
  one = jax.tree.map(lambda x: x[0], params)
  tx = TX[group_size]
  plan = outer.noloco_plan(2, M, group_size=group_size)
  state = jax.vmap(tx.init)(params)

  def report(sync):
    compiled = program(tx, sync, params, state, helpers.wide_batches(0), mesh)
    return parallel.collective_bytes(compiled, mesh)

  inner = report(plan(0))
  assert inner.cross_worker_bytes_range == (0, 0)
  sync = report(plan(1))
  assert set(sync.by_kind(cross_worker=True)) == {'collective-permute'}
  assert not sync.conditionals
  # phi and Delta in fp32 to each of the n - 1 peers, spread over the
  # worker's 2 devices (not sent once per device).
  theory = outer.noloco_bytes(one) * (group_size - 1)
  assert theory == 2 * 136 * 4 * (group_size - 1)
  assert sync.cross_worker_bytes_per_worker == pytest.approx(theory,
                                                             rel=0.1)


def test_on_device_program_syncs_in_one_branch_by_all_gather():
  mesh = helpers.worker_mesh()
  params = model_params()
  state = jax.vmap(TX[2].init)(params)
  report = parallel.collective_bytes(
      program(TX[2], None, params, state, helpers.wide_batches(0), mesh), mesh)
  assert report.cross_worker_bytes == 0
  kinds = {c.kind for c in report.collectives if c.cross_worker}
  assert kinds == {'all-gather'}
  theory = outer.noloco_bytes(jax.tree.map(lambda x: x[0], params))
  # Each worker contributes its payload once, but receives M - 1 of them.
  assert report.cross_worker_bytes_range[1] == pytest.approx(theory * M,
                                                             rel=0.1)
