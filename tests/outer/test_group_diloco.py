"""Tests of loc_opt.outer.group_diloco: a parameter group (a router) on a
sync period and outer optimizer of its own."""


import jax
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import parallel
from loc_opt.outer.group_diloco import group_diloco
from loc_opt.outer.group_diloco import group_diloco_plan
from loc_opt.outer.group_diloco import group_mask
from loc_opt.outer.group_diloco import ROUTER_PATTERN
from tests import optax_conformance as conf
from tests.outer import _helpers as helpers


def _run_planned(tx, plan, steps):
  """M workers of the 4 -> 3 model, each step's program picked by the
  plan (static phases)."""
  programs = {}
  params = helpers.stack(conf.example_params())
  state = jax.vmap(tx.init)(params)
  for i in range(steps):
    phase = plan(i)
    if phase not in programs:
      programs[phase] = jax.jit(parallel.vmap_workers(
          helpers.train_step(tx, sync=phase)))
    params, state = programs[phase](params, state,
                                    helpers.worker_batches(i))
  return params, state


def test_equal_periods_and_outer_optimizers_are_diloco():
  tx = group_diloco(optax.adam(1e-2), sync_every=3, group_sync_every=3,
                    pattern='^b$')
  got, state = _run_planned(tx, group_diloco_plan(3, 3), 7)
  want, _ = helpers.run_workers(
      loc_opt.diloco(optax.adam(1e-2), sync_every=3), 7)
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(state.num_syncs[0], [2, 2])


def test_group_syncs_on_its_own_period_with_its_own_outer_optimizer():
  """H = 4 for ``w``, H_g = 2 for ``b`` with plain averaging: after 2
  steps ``b`` is the workers' mean and equal on every worker while ``w``
  differs; after 4 both are synced."""
  tx = group_diloco(optax.sgd(0.1), sync_every=4, group_sync_every=2,
                    pattern='^b$', group_outer=optax.sgd(1.0))
  plan = group_diloco_plan(4, 2)
  assert [plan(i) for i in range(4)] == [False, ('group',), False,
                                         ('group', 'main')]
  p2, s2 = _run_planned(tx, plan, 2)
  for m in range(1, helpers.M):
    np.testing.assert_allclose(p2['b'][m], p2['b'][0], atol=1e-7)
  assert not np.allclose(p2['w'][1], p2['w'][0])
  # Plain averaging (outer SGD lr 1): the anchor is the workers' mean.
  local, _ = helpers.run_workers(optax.sgd(0.1), 2)
  np.testing.assert_allclose(p2['b'][0], local['b'].mean(0), atol=1e-6)
  np.testing.assert_allclose(s2.anchor['w'][0], conf.example_params()['w'])
  np.testing.assert_array_equal(s2.num_syncs[0], [0, 1])
  p4, s4 = _run_planned(tx, plan, 4)
  for m in range(1, helpers.M):
    conf.assert_trees_close(helpers.worker(p4, m), helpers.worker(p4, 0),
                            rtol=0, atol=1e-7)
  np.testing.assert_array_equal(s4.num_syncs[0], [1, 2])


def test_static_phases_equal_the_device_decision():
  tx = group_diloco(optax.adam(1e-2), sync_every=4, group_sync_every=2,
                    pattern='^b$')
  got, _ = _run_planned(tx, group_diloco_plan(4, 2), 6)
  want, _ = helpers.run_workers(tx, 6)
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-6)


def test_each_phase_sends_its_part_only():
  """The compiled programs on a worker mesh: the group's sync all-reduces
  ``b`` (3 floats), the main sync ``w`` (12), the inner step nothing
  (``parallel.worker_mean``: one copy per worker, not per data-parallel
  device)."""
  tx = group_diloco(optax.adam(1e-2), sync_every=4, group_sync_every=2,
                    pattern='^b$',
                    reduce_fn=parallel.worker_mean(parallel.WORKER))
  mesh = helpers.worker_mesh()
  params = helpers.stack(conf.example_params())
  state = jax.vmap(tx.init)(params)
  batch = helpers.worker_batches(0)
  sent = {}
  for phase in (False, ('group',), ('main',)):
    step = jax.jit(parallel.shard_map_workers(
        helpers.train_step(tx, sync=phase), mesh))
    report = parallel.collective_bytes(
        step.lower(params, state, batch).compile(), mesh)
    sent[phase] = report.cross_worker_bytes
  # b's 3 floats are padded to 4, a multiple of the worker's 2 devices.
  assert sent == {False: 0, ('group',): helpers.M * 4 * 4,
                  ('main',): helpers.M * 4 * 12}


@pytest.mark.parametrize('bad', [False, ('router',), ()])
def test_bad_phase_is_refused(bad):
  tx = group_diloco(optax.sgd(0.1), sync_every=2, group_sync_every=1,
                    pattern='^b$', axis_name=None)
  params = conf.example_params()
  state = tx.init(params)
  if bad is False:  # False is the inner phase: fine
    tx.update(params, state, params, sync=bad)
    return
  with pytest.raises(ValueError, match='sync must be'):
    tx.update(params, state, params, sync=bad)


def test_an_empty_group_is_diloco():
  """The default pattern on a model without routers: no group, DiLoCo."""
  tx = group_diloco(optax.adam(1e-2), sync_every=3, group_sync_every=2)
  got, _ = _run_planned(tx, group_diloco_plan(3, 2), 7)
  want, _ = helpers.run_workers(
      loc_opt.diloco(optax.adam(1e-2), sync_every=3), 7)
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-6)


def test_router_pattern_matches_the_moe_routers():
  from loc_opt.models import moe
  assert ROUTER_PATTERN == moe.ROUTER_PATTERN
  params = {'layer_0': {'mlp': {'router': {'kernel': 0}, 'up': 0}},
            'head': {'kernel': 0}}
  assert group_mask(params) == [False, True, False]
