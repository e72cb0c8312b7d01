"""Tests of loc_opt.outer.hierarchical_diloco: equivalences with flat
DiLoCo, groups that stay apart between global syncs, the plan, and bytes
that cross groups only on global syncs (from the compiled HLO)."""

import jax
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import parallel
from loc_opt.outer import hierarchical
from loc_opt.train import hierarchy
from tests import optax_conformance as conf
from tests.outer import _helpers as helpers

M = helpers.M


def _hier(h1, h2, g, **kwargs):
  return loc_opt.outer.hierarchical_diloco(
      optax.adam(1e-2), sync_every=h1, global_sync_every=h2, group_size=g,
      **kwargs)


def test_one_group_with_averaging_is_flat_diloco():
  # G = M and a plain-averaging group step: the global step at H2 = H1 is
  # DiLoCo's outer step on the mean pseudo-gradient.
  got, _ = helpers.run_workers(
      _hier(3, 3, M, group_outer=optax.sgd(1.0),
            outer=loc_opt.outer.nesterov_outer()), 10)
  want, _ = helpers.run_workers(
      loc_opt.diloco(optax.adam(1e-2), sync_every=3), 10)
  conf.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


def test_groups_of_one_are_flat_diloco_at_h2():
  got, _ = helpers.run_workers(
      _hier(2, 6, 1, group_outer=optax.sgd(1.0),
            outer=loc_opt.outer.nesterov_outer()), 13)
  want, _ = helpers.run_workers(
      loc_opt.diloco(optax.adam(1e-2), sync_every=6), 13)
  conf.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


def test_groups_agree_inside_and_differ_across_until_the_global_sync():
  tx = _hier(2, 6, 2)
  params, state = helpers.run_workers(tx, 4)  # two group syncs, no global
  w = np.asarray(params['w'])
  np.testing.assert_allclose(w[0], w[1], rtol=1e-6)
  np.testing.assert_allclose(w[2], w[3], rtol=1e-6)
  assert np.abs(w[0] - w[2]).max() > 1e-3
  assert int(state.num_global_syncs[0]) == 0
  assert int(state.num_syncs[0]) == 2
  params, state = helpers.run_workers(tx, 6)  # the global sync
  w = np.asarray(params['w'])
  for m in range(1, M):
    np.testing.assert_allclose(w[m], w[0], rtol=1e-6)
  assert int(state.num_global_syncs[0]) == 1


def test_plan_matches_the_on_device_decision():
  plan = loc_opt.outer.hierarchical_plan(2, 6)
  assert [plan(c) for c in range(6)] == [False, 'group', False, 'group',
                                         False, 'global']
  assert plan.phases(12) == (False, 'group', 'global')
  params, state, programs = helpers.run_planned(_hier(2, 6, 2), plan, 13)
  want, want_state = helpers.run_workers(_hier(2, 6, 2), 13)
  conf.assert_trees_close(params, want, rtol=1e-6, atol=1e-7)
  conf.assert_trees_close(state, want_state, rtol=1e-6, atol=1e-7)
  assert set(programs) == {False, 'group', 'global'}


def test_group_shifts_stay_in_groups():
  shifts = hierarchical.group_shifts(6, 3)
  assert len(shifts) == 2
  for perm in shifts:
    assert sorted(s for s, _ in perm) == list(range(6))
    assert sorted(d for _, d in perm) == list(range(6))
    assert all(s // 3 == d // 3 for s, d in perm)


def test_bad_arguments():
  with pytest.raises(ValueError, match='multiple of sync_every'):
    _hier(4, 6, 2)
  with pytest.raises(ValueError, match='group_size'):
    _hier(2, 4, 0)
  with pytest.raises(ValueError, match='does not divide'):
    helpers.run_workers(_hier(2, 4, 3), 2)
  with pytest.raises(ValueError, match='sync must be'):
    _hier(2, 4, 2).update(
        conf.example_params(), _hier(2, 4, 1, axis_name=None).init(
            conf.example_params()), conf.example_params(), sync=True)


def _reports(tx):
  params = helpers.stack(helpers.tile_params())
  return {phase: helpers.phase_report(tx, params, phase,
                                      helpers.worker_mesh())
          for phase in hierarchical.PHASES}


def test_bytes_cross_groups_only_on_global_syncs():
  n = sum(x.size for x in jax.tree.leaves(helpers.tile_params()))  # 136
  reports = _reports(_hier(2, 4, 2))
  assert reports[False].cross_worker_bytes_range == (0, 0)
  group, glob = reports['group'], reports['global']
  # Group sync: one shift inside each pair of workers, fp32, each element
  # once per worker; nothing joins the two groups.
  assert group.by_kind(cross_worker=True) == {
      'collective-permute': group.cross_worker_bytes}
  np.testing.assert_allclose(group.cross_worker_bytes / M, 4 * n, rtol=0.02)
  assert group.cross_group_bytes(2) == 0
  for c in group.collectives:
    if c.cross_worker:
      assert set(c.worker_groups) == {(0, 1), (2, 3)}
  # Global sync: the group shift, then an all-reduce that joins all.
  assert glob.cross_group_bytes(2) > 0
  between = glob.by_kind(cross_worker=True)
  np.testing.assert_allclose(between['all-reduce'] / M, 4 * n, rtol=0.02)
  np.testing.assert_allclose(glob.cross_group_bytes(2) / M, 4 * n,
                             rtol=0.02)
  # Flat DiLoCo: every sync crosses groups.
  flat = helpers.phase_report(
      loc_opt.diloco(optax.adam(1e-2), sync_every=4,
                     reduce_fn=parallel.worker_mean()),
      helpers.stack(helpers.tile_params()), True, helpers.worker_mesh())
  assert flat.cross_group_bytes(2) == flat.cross_worker_bytes > 0


@pytest.mark.parametrize('g', [1, 2])
def test_treeloco_representatives_give_the_same_model(g):
  # TreeLoCo's exchange among the groups' first workers is the same mean
  # over groups as the all-reduce (each group's members hold one anchor).
  got, state = helpers.run_workers(
      _hier(2, 4, g, global_exchange='representatives'), 9)
  want, want_state = helpers.run_workers(_hier(2, 4, g), 9)
  conf.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
  conf.assert_trees_close(state.anchor, want_state.anchor, rtol=1e-5,
                          atol=1e-6)
  # equal on every worker (up to an ulp: under vmap the per-worker outer
  # step is vectorized over workers, and XLA's CPU lanes may round apart)
  for leaf in jax.tree.leaves(state.anchor):
    np.testing.assert_allclose(leaf, np.broadcast_to(leaf[0], leaf.shape),
                               rtol=1e-6, atol=0)
  sharded, _ = helpers.run_sharded(
      _hier(2, 4, g, global_exchange='representatives'), 9)
  conf.assert_trees_close(sharded, want, rtol=1e-5, atol=1e-6)


def test_treeloco_bytes_between_groups_from_the_hlo():
  n = 4 * sum(x.size for x in jax.tree.leaves(helpers.tile_params()))
  flat = _reports(_hier(2, 4, 2))['global']
  tree = _reports(_hier(2, 4, 2, global_exchange='representatives'))
  glob = tree['global']
  # R = 2 groups: one shift between the two representatives (workers 0
  # and 2), n bytes each; the all-reduce's operands are n on every worker.
  crossing = [c for c in glob.collectives
              if c.branch is None and c.crosses_groups(2)]
  assert {c.kind for c in crossing} == {'collective-permute'}
  assert all(set(c.worker_groups) <= {(0, 2), (2, 0), (0,), (2,)}
             for c in crossing), [c.worker_groups for c in crossing]
  np.testing.assert_allclose(glob.cross_group_bytes(2), 2 * n, rtol=0.05)
  np.testing.assert_allclose(flat.cross_group_bytes(2), M * n, rtol=0.05)
  assert glob.cross_group_bytes(2) * 2 == pytest.approx(
      flat.cross_group_bytes(2), rel=0.05)  # G times fewer
  assert tree['group'].cross_group_bytes(2) == 0
  with pytest.raises(ValueError, match='takes no global codec'):
    _hier(2, 4, 2, global_exchange='representatives', codec='int8')
  with pytest.raises(ValueError, match='global_exchange must be one of'):
    _hier(2, 4, 2, global_exchange='tree')


def test_library_and_trainer_share_the_defaults():
  # The library's outer=None and the trainer's global step are one merge
  # (SGD rate 1, no momentum): a global sync at H2 = H1 with groups of one
  # and plain group steps lands on the workers' mean, as local SGD does.
  from configs import diloco_lm  # pylint: disable=g-import-not-at-top
  s = diloco_lm.get_config().outer.hierarchical_diloco
  assert (s.global_learning_rate, s.global_momentum) == (
      hierarchical.GLOBAL_LEARNING_RATE, hierarchical.GLOBAL_MOMENTUM) == (
          1.0, 0.0)
  got, _ = helpers.run_workers(_hier(2, 2, 1, group_outer=optax.sgd(1.0)), 6)
  want, _ = helpers.run_workers(
      loc_opt.outer.local_sgd(optax.adam(1e-2), sync_every=2), 6)
  conf.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
  c = diloco_lm.get_config()
  c.outer.hierarchical_diloco.global_momentum = 0.5
  outer = hierarchy.global_outer(c)
  p = {'w': np.ones(2, np.float32)}
  u, _ = outer.update({'w': np.ones(2, np.float32)}, outer.init(p), p)
  np.testing.assert_allclose(u['w'], -1.5)  # Nesterov: -(g + mu g)
  del c.outer.hierarchical_diloco['global_learning_rate']
  del c.outer.hierarchical_diloco['global_momentum']
  outer = hierarchy.global_outer(c)
  u, _ = outer.update({'w': np.ones(2, np.float32)}, outer.init(p), p)
  np.testing.assert_allclose(u['w'], -1.)  # absent: the library's merge


def test_two_link_wallclock():
  reports = _reports(_hier(2, 4, 2))
  fast, slow = parallel.Link(100.0), parallel.Link(1.0)
  group = hierarchy.two_level_seconds(reports['group'], 2, fast, slow)
  glob = hierarchy.two_level_seconds(reports['global'], 2, fast, slow)
  n = 4 * sum(x.size for x in jax.tree.leaves(helpers.tile_params()))
  # The group shift on the fast link: n bytes, one message.
  np.testing.assert_allclose(group, n * 8 / 100e9, rtol=0.05)
  # The global all-reduce over 4 workers on the slow link, plus the shift.
  want = 2 * 3 / 4 * n * 8 / 1e9 + n * 8 / 100e9
  np.testing.assert_allclose(glob, want, rtol=0.05)
  assert hierarchy.two_level_seconds(reports[False], 2, fast, slow) == 0
