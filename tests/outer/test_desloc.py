"""Tests of loc_opt.outer.desloc: DES-LOC, Local Adam and MT-DAO."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loc_opt import outer
from loc_opt import parallel
from loc_opt.outer.desloc import find_state_field
from tests import optax_conformance as conf
from tests.outer import _helpers as helpers

M = helpers.M


def params16():
  k1, k2 = jax.random.split(jax.random.key(3))
  return {'w': jax.random.normal(k1, (16, 8)),
          'b': 0.1 * jax.random.normal(k2, (8,))}


def run_workers(tx, steps, m=M, runner=parallel.vmap_workers, keep=()):
  """Trains m workers with tx (sync=None); returns (stacked params, state),
  or with ``keep`` a dict ``{steps taken: (params, state)}`` of those."""
  fn = jax.jit(runner(helpers.train_step(tx)))
  params = helpers.stack(params16(), m)
  state = jax.vmap(tx.init)(params)
  kept = {}
  for i in range(steps):
    params, state = fn(params, state, helpers.wide_batches(i, m))
    if i + 1 in keep:
      kept[i + 1] = (params, state)
  return kept if keep else (params, state)


def adam_mu_nu(state):
  """(mu, nu) of the optax.adam state inside a DeslocState."""
  adam_state = state.inner_state[0]
  return adam_state.mu, adam_state.nu


# ----------------------------------------------------------- conformance ---


def make_desloc(learning_rate):
  # Syncs params every step, mu every 2 and nu every 3: the conformance
  # runs (3 to 5 steps) cross every kind of sync, through an outer optimizer.
  return outer.desloc(optax.adam(learning_rate), sync_every=1,
                      state_sync_every={'mu': 2, 'nu': 3},
                      outer=optax.sgd(0.5, 0.9), axis_name=None)


def test_conformance(tmp_path):
  conf.check_all(make_desloc, tmp_path)


# ---------------------------------------------------------- equivalences ---


@pytest.mark.parametrize('average_at', ['before_update', 'after_update'])
def test_equal_periods_are_local_adam_written_out(average_at):
  """K_x = K_u = K_v = 3 equals hand-written Local Adam over 2+ rounds,
  with the states averaged before the step's moment update (the paper's
  order) or after its update; so do local_adam and MT-DAO with one slow
  momentum of weight 1."""
  lr, b1, b2, eps, k, steps = 1e-2, 0.9, 0.99, 1e-8, 3, 8
  before = average_at == 'before_update'
  tx = outer.desloc(optax.adam(lr, b1, b2, eps), sync_every=k,
                    state_sync_every={'mu': k, 'nu': k},
                    average_at=average_at)
  got, state = run_workers(tx, steps)

  # Each worker: plain Adam in NumPy; every k steps average x, m and v.
  p = jax.tree.map(np.asarray, helpers.stack(params16()))
  mom = jax.tree.map(np.zeros_like, p)
  vel = jax.tree.map(np.zeros_like, p)
  grad = jax.jit(jax.vmap(jax.grad(helpers.quad_loss)))
  def average(*trees):
    return (jax.tree.map(
        lambda x: np.broadcast_to(x.mean(0, keepdims=True), x.shape), tree)
            for tree in trees)

  for t in range(1, steps + 1):
    g = jax.tree.map(np.asarray, grad(p, helpers.wide_batches(t - 1)))
    if before and t % k == 0:
      p, mom, vel = average(p, mom, vel)
    mom = jax.tree.map(lambda a, x: b1 * a + (1 - b1) * x, mom, g)
    vel = jax.tree.map(lambda a, x: b2 * a + (1 - b2) * x * x, vel, g)
    p = jax.tree.map(
        lambda w, a, v: w - lr * (a / (1 - b1**t))
        / (np.sqrt(v / (1 - b2**t)) + eps), p, mom, vel)
    if not before and t % k == 0:
      p, mom, vel = average(p, mom, vel)
  conf.assert_trees_close(got, p, rtol=1e-5, atol=1e-6)
  mu, nu = adam_mu_nu(state)
  conf.assert_trees_close(mu, mom, rtol=1e-5, atol=1e-7)
  conf.assert_trees_close(nu, vel, rtol=1e-5, atol=1e-9)
  assert int(state.num_syncs[0]) == steps // k

  alias_tx = outer.local_adam(optax.adam(lr, b1, b2, eps), sync_every=k,
                              average_at=average_at)
  # local_adam is this transform: the same step jaxpr, so bit-identical.
  assert helpers.step_jaxpr(alias_tx) == helpers.step_jaxpr(tx)
  alias, _ = run_workers(alias_tx, steps)
  conf.assert_trees_close(alias, got, rtol=0, atol=0)
  # MT-DAO with one slow momentum of weight 1 is Local Adam too.
  mt_dao, mt_state = run_workers(outer.mt_dao(
      lr, sync_every=k, slow_betas=(b1,), slow_weights=(1.0,), b2=b2,
      eps=eps, average_at=average_at), steps)
  conf.assert_trees_close(mt_dao, got, rtol=1e-6, atol=1e-7)
  assert int(mt_state.num_syncs[0]) == steps // k


def test_outer_sgd_one_equals_plain_averaging():
  kwargs = dict(sync_every=2, state_sync_every={'mu': 4, 'nu': 6})
  plain, s1 = run_workers(outer.desloc(optax.adam(1e-2), **kwargs), 12)
  sgd, s2 = run_workers(
      outer.desloc(optax.adam(1e-2), outer=optax.sgd(1.0), **kwargs), 12)
  conf.assert_trees_close(plain, sgd, rtol=1e-6, atol=1e-7)
  conf.assert_trees_close(s1.inner_state, s2.inner_state, rtol=1e-6,
                          atol=1e-7)
  # A real outer optimizer does move elsewhere.
  nesterov, _ = run_workers(outer.desloc(
      optax.adam(1e-2), outer=optax.sgd(0.7, 0.9, nesterov=True), **kwargs),
                            12)
  assert not np.allclose(nesterov['w'], plain['w'], atol=1e-4)


def test_one_worker_is_the_inner_optimizer():
  inner = optax.adam(1e-2)
  got, _ = run_workers(outer.desloc(inner, sync_every=2), 6, m=1)
  want, state = params16(), inner.init(params16())

  @jax.jit
  def step(params, state, batch):
    u, state = inner.update(jax.grad(helpers.quad_loss)(params, batch), state,
                            params)
    return optax.apply_updates(params, u), state

  for i in range(6):
    want, state = step(want, state,
                       helpers.worker(helpers.wide_batches(i, 1), 0))
  conf.assert_trees_close(helpers.worker(got, 0), want, rtol=1e-6, atol=1e-7)


def test_each_state_is_averaged_only_when_due():
  # After the step (average_at='after_update') a synced state is the same
  # on every worker; in the default order it is then updated with each
  # worker's gradient (test_reference checks that order's numbers).
  tx = outer.desloc(optax.adam(1e-2), sync_every=2,
                    state_sync_every={'mu': 4, 'nu': 8},
                    average_at='after_update')

  def spread(tree):
    return max(float(np.abs(x - x[:1]).max()) for x in jax.tree.leaves(tree))

  snaps = run_workers(tx, 8, keep=(3, 4, 8))
  params, state = snaps[3]  # counts 0..2: params synced at 1
  mu, nu = adam_mu_nu(state)
  assert spread(mu) > 1e-4 and spread(nu) > 1e-6 and spread(params) > 1e-4
  params, state = snaps[4]  # count 3: params and mu
  mu, nu = adam_mu_nu(state)
  # params: anchor - theta applied to theta, within one rounding.
  assert spread(params) < 1e-6 and spread(mu) == 0 and spread(nu) > 1e-6
  params, state = snaps[8]  # count 7: params, mu and nu
  mu, nu = adam_mu_nu(state)
  assert spread(params) < 1e-6 and spread(mu) == 0 and spread(nu) == 0


def test_state_outside_its_period_follows_the_inner_rule():
  """On a params-only sync step, mu and nu follow Adam's rule from each
  worker's own previous state (they are not averaged)."""
  tx = outer.desloc(optax.adam(1e-2, b1=0.9, b2=0.99), sync_every=2,
                    state_sync_every={'mu': 4, 'nu': 4})
  snaps = run_workers(tx, 2, keep=(1, 2))
  params, state = snaps[1]
  g = jax.vmap(jax.grad(helpers.quad_loss))(params, helpers.wide_batches(1))
  mu0, nu0 = adam_mu_nu(state)
  _, state = snaps[2]  # count 1: params only
  mu1, nu1 = adam_mu_nu(state)
  conf.assert_trees_close(
      mu1, jax.tree.map(lambda m, x: 0.9 * m + 0.1 * x, mu0, g), rtol=1e-6)
  conf.assert_trees_close(
      nu1, jax.tree.map(lambda v, x: 0.99 * v + 0.01 * x * x, nu0, g),
      rtol=1e-6, atol=1e-12)


def test_eval_params_are_the_last_synced_mean():
  tx = outer.desloc(optax.adam(1e-2), sync_every=3)
  snaps = run_workers(tx, 4, keep=(2, 3, 4))
  params, state = snaps[3]
  ev = jax.vmap(outer.desloc_eval_params)(state, params)
  # The step of count 2 averaged the parameters before its inner update.
  mean = jax.tree.map(lambda x: np.broadcast_to(x.mean(0), x.shape),
                      snaps[2][0])
  conf.assert_trees_close(ev, mean, rtol=0, atol=1e-6)  # one rounding
  more, state = snaps[4]
  # An inner step leaves the stored mean as it was (no arithmetic): exact.
  conf.assert_trees_close(
      jax.vmap(outer.desloc_eval_params)(state, more), ev, rtol=0, atol=0)
  assert not np.allclose(more['w'], params['w'], atol=1e-4)
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params16())
  state = tx.init(bf16)
  assert state.anchor['w'].dtype == jnp.float32
  assert outer.desloc_eval_params(state, bf16)['w'].dtype == jnp.bfloat16


# ------------------------------------------------------------------ plan ---


def test_plan_phases():
  plan = outer.desloc_plan(2, {'mu': 4, 'nu': 8})
  assert [plan(c) for c in range(8)] == [
      False, ('params',), False, ('mu', 'params'), False, ('params',), False,
      ('mu', 'nu', 'params')]
  default = outer.desloc_plan(2)  # K_u = 6, K_v = 12
  assert default(5) == ('mu', 'params') and default(11) == (
      'mu', 'nu', 'params')
  assert default.num_syncs(0, 12) == 6
  assert outer.desloc_plan(3, {'slow': 3, 'nu': 3})(2) == (
      'nu', 'params', 'slow')


def test_plan_programs_equal_cond_program():
  periods = {'mu': 4, 'nu': 6}
  tx = outer.desloc(optax.adam(1e-2), sync_every=2,
                    state_sync_every=periods)
  plan = outer.desloc_plan(2, periods)
  steps = 12
  programs = {ph: jax.jit(parallel.vmap_workers(helpers.train_step(tx, ph)))
              for ph in plan.phases(steps)}
  assert len(programs) == 5
  params = helpers.stack(params16())
  state = jax.vmap(tx.init)(params)
  for count in range(steps):
    params, state = programs[plan(count)](params, state,
                                          helpers.wide_batches(count))
  want, want_state = run_workers(tx, steps)
  # The same arithmetic; XLA may fuse the separately compiled programs
  # differently (1 ulp, seen even on inner steps; a second moment of a
  # gradient near 0 then differs by up to 1e-5 relative, 7e-9 absolute).
  conf.assert_trees_close(params, want, rtol=1e-6, atol=1e-8)
  conf.assert_trees_close(state, want_state, rtol=1e-6, atol=1e-8)
  assert int(state.num_syncs[0]) == int(want_state.num_syncs[0]) == 6


# ------------------------------------------------------------- arguments ---


def test_missing_field_raises():
  tx = outer.desloc(optax.sgd(0.1, momentum=0.9), sync_every=2)
  with pytest.raises(ValueError, match="'mu'"):
    tx.init(params16())
  tx = outer.desloc(optax.adam(0.1), sync_every=2,
                    state_sync_every={'mu': 2, 'momentum': 4})
  with pytest.raises(ValueError, match="'momentum'"):
    tx.init(params16())


def test_adopt_and_chained_states_are_found():
  for inner in (optax.contrib.adopt(1e-3),
                optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
                optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)):
    state = outer.desloc(inner, sync_every=2).init(params16())
    assert len(find_state_field(state.inner_state, 'nu')) == 1


@pytest.mark.parametrize('bad', [0, -2, 2.5, True, None, float('inf')])
def test_bad_sync_every_raises(bad):
  with pytest.raises(ValueError, match='sync_every'):
    outer.desloc(optax.adam(0.1), sync_every=bad)
  with pytest.raises(ValueError, match='sync_every'):
    outer.desloc_plan(bad)


@pytest.mark.parametrize('bad', [0, -6, None, float('inf'), 6.0])
def test_bad_state_period_raises(bad):
  with pytest.raises(ValueError, match="'nu'"):
    outer.desloc(optax.adam(0.1), sync_every=2,
                 state_sync_every={'mu': 6, 'nu': bad})
  if bad is not None:  # None: mt_dao's default, K_v = K_x
    with pytest.raises(ValueError, match='nu_sync_every'):
      outer.mt_dao(0.1, sync_every=2, nu_sync_every=bad)


def test_bad_phase_raises():
  tx = outer.desloc(optax.adam(0.1), sync_every=2)
  params = params16()
  state = tx.init(params)
  with pytest.raises(ValueError, match='sync'):
    tx.update(params, state, params, sync=('slow',))
  with pytest.raises(ValueError, match='sync'):
    tx.update(params, state, params, sync=True)
  with pytest.raises(ValueError, match='state_sync_every'):
    outer.desloc(optax.adam(0.1), sync_every=2,
                 state_sync_every={'params': 2})


# ------------------------------------------------------------ on a mesh ---


@pytest.fixture(scope='module')
def mesh():
  return parallel.make_worker_mesh(M, data=2)


def test_shard_map_matches_vmap(mesh):
  tx = outer.desloc(optax.adam(1e-2), sync_every=2,
                    state_sync_every={'mu': 4, 'nu': 4},
                    outer=optax.sgd(0.7, 0.9, nesterov=True))
  want, want_state = run_workers(tx, 5)
  got, state = run_workers(
      tx, 5, runner=functools.partial(parallel.shard_map_workers, mesh=mesh))
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
  conf.assert_trees_close(adam_mu_nu(state), adam_mu_nu(want_state),
                          rtol=1e-6, atol=1e-7)
  assert state.count.sharding.spec == jax.P('worker')


def test_hlo_bytes_per_phase(mesh):
  tx = outer.desloc(optax.adam(1e-2), sync_every=2)
  params = helpers.stack(params16())
  state = jax.vmap(tx.init)(params)
  one = jax.eval_shape(tx.init, params16())
  n = 16 * 8 + 8
  payload = 4 * n

  def bytes_of(phase):
    compiled = jax.jit(parallel.shard_map_workers(
        helpers.train_step(tx, phase), mesh)).lower(
            params, state, helpers.wide_batches(0)).compile()
    return parallel.collective_bytes(compiled, mesh)

  assert bytes_of(False).cross_worker_bytes == 0
  for phase, payloads in [(('params',), 1), (('mu', 'params'), 2),
                          (('mu', 'nu', 'params'), 3)]:
    theory = outer.desloc_phase_bytes(one, phase)
    assert theory == payloads * payload
    sent = bytes_of(phase).cross_worker_bytes_per_worker
    assert 0.9 * theory <= sent <= 1.1 * theory, (phase, sent, theory)
  assert outer.desloc_phase_bytes(one, False) == 0

  # sync=None: one lax.cond per synced quantity, nothing unconditional.
  report = bytes_of(None)
  assert report.cross_worker_bytes == 0
  branches = sorted(report.branches.values())
  assert len(branches) == 3
  for b in branches:  # each cond: one branch moves a payload, one nothing
    assert sorted(b)[0] == 0
    assert 0.9 * payload * M <= sorted(b)[1] <= 1.1 * payload * M
