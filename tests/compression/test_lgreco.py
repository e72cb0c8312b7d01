"""L-GreCo: the knapsack DP against brute force, measuring, per-leaf means."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loc_opt import compression
from loc_opt.compression import lgreco
from loc_opt.compression import quant
from tests.compression._helpers import normal as _normal
from tests.compression._helpers import sharded_mean
from tests.compression._helpers import W
from tests.compression._helpers import worker_slice


def _brute_force(errors, sizes, budget):
  """The cheapest choice with total error <= budget (None if none)."""
  best, best_bytes = None, np.inf
  for choice in itertools.product(*[range(c) for c in [errors.shape[1]] *
                                    errors.shape[0]]):
    err = lgreco.plan_error(errors, choice)
    size = lgreco.plan_bytes(sizes, choice)
    if err <= budget and size < best_bytes:
      best, best_bytes = choice, size
  return best, best_bytes


@pytest.mark.parametrize('seed', range(20))
def test_plan_is_optimal_on_integer_instances(seed):
  rng = np.random.default_rng(seed)
  layers, cands = 4, 3
  # Candidates from fine to coarse: more bytes, less error.
  sizes = np.sort(rng.integers(1, 50, (layers, cands)), axis=1)[:, ::-1]
  errors = np.sort(rng.integers(0, 12, (layers, cands)), axis=1)
  ref = 1
  budget = float(errors[:, ref].sum())
  choice = lgreco.lgreco_plan(errors, sizes, bins=max(int(budget), 1),
                              reference=ref)
  _, best_bytes = _brute_force(errors, sizes, budget)
  assert lgreco.plan_bytes(sizes, choice) == best_bytes
  assert lgreco.plan_error(errors, choice) <= budget
  assert lgreco.plan_bytes(sizes, choice) <= lgreco.uniform_bytes(sizes, ref)


def test_plan_beats_a_hand_made_uniform_choice():
  # Leaf 0 is small and sensitive, leaf 1 large and robust: spend the error
  # budget on leaf 1 and send leaf 0 finely.
  errors = np.array([[0.0, 4.0, 40.0], [0.0, 1.0, 2.0]])
  sizes = np.array([[20, 10, 1], [1000, 100, 10]])
  choice = lgreco.lgreco_plan(errors, sizes, reference=1)
  assert choice == (0, 2)
  assert lgreco.plan_bytes(sizes, choice) == 30 < 110
  # With the budget of the finest setting, only exact choices fit.
  assert lgreco.lgreco_plan(errors, sizes, reference=0) == (0, 0)
  with pytest.raises(ValueError, match='budget'):
    lgreco.lgreco_plan(errors + 1, sizes, budget=0.5)


@pytest.mark.parametrize('seed', range(10))
def test_plan_is_optimal_up_to_the_discretisation(seed):
  rng = np.random.default_rng(100 + seed)
  layers, cands, bins = 5, 3, 50
  sizes = np.sort(rng.uniform(1, 100, (layers, cands)), axis=1)[:, ::-1]
  errors = np.sort(rng.uniform(0, 10, (layers, cands)), axis=1)
  ref = 1
  budget = float(errors[:, ref].sum())
  choice = lgreco.lgreco_plan(errors, sizes, budget, bins, reference=ref)
  got = lgreco.plan_bytes(sizes, choice)
  assert lgreco.plan_error(errors, choice) <= budget * (1 + 1e-9)
  assert got <= lgreco.uniform_bytes(sizes, ref)
  _, opt = _brute_force(errors, sizes, budget)
  _, opt_tight = _brute_force(errors, sizes, budget - layers * budget / bins)
  assert opt <= got <= opt_tight


def test_errors_are_measured_per_leaf_and_candidate():
  low = jnp.outer(_normal(0, (40,)), _normal(1, (30,)))
  full = _normal(2, (40, 30))
  tree = {'a_low': low, 'b_full': full, 'c_bias': jnp.ones(30)}
  cands = [compression.powersgd(1), compression.powersgd(4), None,
           quant.int8_codec(block_size=30)]
  errors, sizes = lgreco.lgreco_errors(tree, cands)
  assert errors.shape == sizes.shape == (3, 4)
  np.testing.assert_array_equal(errors[:, 2], 0.0)  # fp32 is exact
  assert errors[0, 0] < 1e-6 * float(jnp.sum(low ** 2))  # rank 1 is exact
  # A power-iteration step cannot beat the truncated SVD (Eckart-Young).
  sv = np.linalg.svd(np.asarray(full, np.float64), compute_uv=False)
  for j, r in [(0, 1), (1, 4)]:
    assert np.sum(sv[r:] ** 2) * (1 - 1e-5) <= errors[1, j] <= np.sum(sv ** 2)
  assert errors[1, 1] < errors[1, 0]
  assert 0 < errors[1, 3] < errors[1, 1]  # int8 is much finer than rank 4
  assert sizes[1].tolist() == [4 * 70, 4 * 4 * 70, 4 * 1200, 1200 + 4 * 40]
  assert sizes[2].tolist() == [4 * 30, 4 * 30, 4 * 30, 30 + 4]  # a vector


def test_replan_builds_a_cheaper_per_leaf_compressor():
  # Leaf a: large and (nearly) rank 1. Leaf b: small, rank 8 with equal
  # singular values, so rank 4 leaves half of it and rank 8 is not worth
  # compressing (fp32, exact).
  low = jnp.outer(_normal(10, (128,)), _normal(11, (96,)))
  low = low + 1e-4 * _normal(12, (128, 96))
  u, _ = np.linalg.qr(_normal(13, (32, 8)))
  v, _ = np.linalg.qr(_normal(14, (24, 8)))
  tree = {'a': low, 'b': u @ v.T}
  cands = [compression.powersgd(1), compression.powersgd(2),
           compression.powersgd(4), compression.powersgd(8)]
  plan = lgreco.lgreco_replan(tree, cands, reference=2, bins=200)
  assert plan.budget == pytest.approx(plan.errors[:, 2].sum())
  np.testing.assert_allclose(plan.errors[1], [7, 6, 4, 0], atol=1e-4)
  assert plan.sizes.tolist() == [[896, 1792, 3584, 7168],
                                 [224, 448, 896, 4 * 768]]
  # Rank 1 on the large leaf frees bytes to send the small one exactly.
  assert plan.choice == (0, 3)
  assert lgreco.plan_error(plan.errors, plan.choice) <= plan.budget
  cost = plan.compressor.payload_bytes(tree)
  assert cost == lgreco.plan_bytes(plan.sizes, plan.choice) == 896 + 3072
  assert cost < lgreco.uniform_bytes(plan.sizes, 2) == 3584 + 896

  # The per-leaf compressor runs like any other; leaf i gets choice i, and
  # its state is threaded through (the second call is warm-started).
  comp = plan.compressor
  stacked = jax.tree.map(lambda x: jnp.stack([x] * W), tree)
  comm = compression.Comm('worker')
  fn = jax.jit(jax.vmap(lambda t, s: comp.mean(t, s, comm, jax.random.key(2)),
                        axis_name='worker'))
  state = jax.vmap(comp.init)(stacked)
  assert len(state) == 2
  total = 0.0
  for _ in range(2):
    mean, _, state = fn(stacked, state)
    np.testing.assert_allclose(mean['b'][0], tree['b'], atol=1e-6)  # fp32
    total = total + mean['a'][0]
  # PowerSGD's own error feedback on leaf a: what was not sent is kept.
  error = state[0].error[0][0]
  np.testing.assert_allclose(total + error, 2 * low, atol=1e-4)


def test_per_leaf_checks_the_leaf_count():
  comp = lgreco.per_leaf([None, None])
  with pytest.raises(ValueError, match='2 schemes for 3 leaves'):
    comp.init([jnp.ones(2)] * 3)


def test_shard_map_bytes_follow_the_choices():
  comp = lgreco.per_leaf([None, compression.powersgd(2),
                          quant.int8_codec(block_size=64)])
  tree = {'a': _normal(3, (W, 128)),
          'b': _normal(4, (W, 256, 128)),
          'c': _normal(5, (W, 64, 64))}
  out, want, report = sharded_mean(comp, tree)
  theory = comp.payload_bytes(worker_slice(tree))
  assert theory == 4 * 128 + 4 * 2 * (256 + 128) + 4096 + 4 * 64
  got = report.cross_worker_bytes_per_worker
  assert got <= 1.1 * theory, report.summary()
  assert got < 0.15 * 4 * (128 + 256 * 128 + 64 * 64)
  for name in tree:
    np.testing.assert_allclose(out[name], want[name], atol=1e-4)
