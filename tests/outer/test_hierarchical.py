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
      _hier(3, 3, M, group_outer=optax.sgd(1.0)), 10)
  want, _ = helpers.run_workers(
      loc_opt.diloco(optax.adam(1e-2), sync_every=3), 10)
  conf.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


def test_groups_of_one_are_flat_diloco_at_h2():
  got, _ = helpers.run_workers(
      _hier(2, 6, 1, group_outer=optax.sgd(1.0)), 13)
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
