"""Tests of robust aggregation (loc_opt.outer.robust, diloco's aggregate):
reference values against numpy, absent and non-finite workers, one
adversarial worker, and the all-gather in the compiled program."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import compression
from loc_opt import parallel
from loc_opt.outer import robust
from tests import optax_conformance as conf
from tests.outer import _helpers as helpers

M = helpers.M


# ------------------------------------------------------- reference values ---
def _values(seed=0, shape=(M, 5)):
  return np.asarray(jax.random.normal(jax.random.key(seed), shape))


def _np_trimmed(rows, trim):
  s = np.sort(rows, axis=0)
  return s[trim:len(rows) - trim].mean(axis=0)


def test_statistics_match_numpy():
  x = _values(shape=(5, 7))
  np.testing.assert_allclose(robust.median(jnp.asarray(x)),
                             np.median(x, axis=0), rtol=1e-6)
  np.testing.assert_allclose(robust.trimmed_mean(jnp.asarray(x), trim=1),
                             _np_trimmed(x, 1), rtol=1e-6)
  mask = np.array([True, False, True, True, False])
  np.testing.assert_allclose(robust.median(jnp.asarray(x), mask),
                             np.median(x[mask], axis=0), rtol=1e-6)
  # Three included: trim 1 leaves the median; trim 5 too (clamped).
  for trim in (1, 5):
    np.testing.assert_allclose(
        robust.trimmed_mean(jnp.asarray(x), mask, trim),
        np.median(x[mask], axis=0), rtol=1e-6)
  np.testing.assert_allclose(robust.trimmed_mean(jnp.asarray(x), trim=0),
                             x.mean(axis=0), rtol=1e-6)
  # No row included: zero.
  np.testing.assert_array_equal(
      robust.median(jnp.asarray(x), np.zeros(5, bool)), np.zeros(7))


def test_clip_scales_match_numpy():
  norms = np.array([1.0, 2.0, 3.0, 40.0])
  mask = np.array([True, True, True, True])
  bound = 1.5 * np.median(norms)
  want = np.minimum(1.0, bound / norms)
  np.testing.assert_allclose(robust.clip_scales(norms, mask, 1.5), want,
                             rtol=1e-6)
  # Excluded workers leave the median: bound 2 x median(1, 2) = 3.
  mask = np.array([True, True, False, False])
  np.testing.assert_allclose(robust.clip_scales(norms, mask, 2.0),
                             np.minimum(1.0, 3.0 / norms), rtol=1e-6)


def _average(rule, deltas, present=None, **kwargs):
  """The rule's average over M workers under vmap, and the flags."""
  avg = robust.averager(rule, **kwargs)
  comm = compression.Comm('worker')

  def one(delta, present):
    mean, _, _, included = avg(
        delta, (), present, compressor=None, comm=comm, seed=0,
        index=jnp.zeros([], jnp.int32),
        mean_fn=lambda t: jax.lax.pmean(t, 'worker'))
    return mean, included

  present = None if present is None else jnp.asarray(present)
  axes = (0, None if present is None else 0)
  return jax.vmap(one, in_axes=axes, axis_name='worker')(deltas, present)


@pytest.mark.parametrize('rule', ['median', 'trimmed_mean',
                                  'norm_clipped_mean'])
def test_worker_average_matches_numpy_leaving_out_bad_workers(rule):
  rows = np.concatenate([_values(1), _values(2)[:1]])  # 5 workers
  rows[1, 2] = np.nan  # not finite: left out
  present = np.array([True, True, True, False, True])  # 3: absent
  keep = np.array([True, False, True, False, True])
  deltas = {'a': jnp.asarray(rows[:, :3]), 'b': jnp.asarray(rows[:, 3:])}
  mean, included = _average(rule, deltas, present)
  np.testing.assert_array_equal(included, keep)
  good = rows[keep]
  if rule == 'median':
    want = np.median(good, axis=0)
  elif rule == 'trimmed_mean':
    want = _np_trimmed(good, 1)
  else:
    norms = np.linalg.norm(good, axis=1)
    scale = np.minimum(1.0, np.median(norms) / norms)
    want = (good * scale[:, None]).mean(axis=0)
  for m in range(5):  # every worker gets the same result
    np.testing.assert_allclose(
        np.concatenate([mean['a'][m], mean['b'][m]]), want, rtol=1e-5)


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match='aggregate'):
    loc_opt.diloco(optax.sgd(0.1), sync_every=2, aggregate='mode')
  # A gathering rule takes a stateless codec, not error feedback.
  with pytest.raises(ValueError, match='stateless codec'):
    loc_opt.diloco(optax.sgd(0.1), sync_every=2, aggregate='median',
                   codec=compression.error_feedback(compression.from_codec(
                       compression.int8())))
  loc_opt.diloco(optax.sgd(0.1), sync_every=2, aggregate='median',
                 codec='int8')
  with pytest.raises(ValueError, match='trim'):
    loc_opt.diloco(optax.sgd(0.1), sync_every=2, trim=-1)
  with pytest.raises(ValueError, match='clip_multiple'):
    loc_opt.diloco(optax.sgd(0.1), sync_every=2, clip_multiple=0.0)
  with pytest.raises(ValueError, match='trim=2 drops every one'):
    _average('trimmed_mean', _values(), trim=2)
  # The clipped mean takes a codec (it compresses the all-reduce).
  loc_opt.diloco(optax.sgd(0.1), sync_every=2,
                 aggregate='norm_clipped_mean', codec='int8')


# ---------------------------------------------------- adversarial worker ---
def _eval_loss(params):
  batches = [helpers.worker_batches(1000 + i) for i in range(4)]
  return float(np.mean([
      helpers.quad_loss(params, (x.reshape(-1, 4), y.reshape(-1, 3)))
      for x, y in batches]))


def _final_loss(aggregate, adversary, steps=120, **kwargs):
  """Anchor loss after ``steps`` of 4 workers (SGD inner, H = 5); with
  ``adversary`` worker 3 flips and scales its gradients by -10."""
  tx = loc_opt.diloco(optax.sgd(0.1), sync_every=5, aggregate=aggregate,
                      **kwargs)

  def step(params, state, batch):
    grads = jax.grad(helpers.quad_loss)(params, batch)
    bad = adversary & (jax.lax.axis_index('worker') == M - 1)
    grads = jax.tree.map(lambda g: jnp.where(bad, -10.0 * g, g), grads)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  fn = jax.jit(parallel.vmap_workers(step))
  params = helpers.stack(conf.example_params())
  state = jax.vmap(tx.init)(params)
  for i in range(steps):
    params, state = fn(params, state, helpers.worker_batches(i))
  anchor = helpers.worker(state.anchor, 0)
  return _eval_loss(anchor) if np.all(np.isfinite(jax.tree.leaves(
      anchor)[0])) else np.inf


def test_one_adversarial_worker_wrecks_the_mean_not_the_robust_rules():
  start = _eval_loss(conf.example_params())
  honest = _final_loss('mean', False)  # 5.04 -> 0.96
  assert honest < 0.3 * start
  assert _final_loss('mean', True) > start  # diverges (1e34)
  # median = trimmed_mean (k=1) for M = 4: 1.11; norm-clipped: 1.05.
  for rule in ('median', 'norm_clipped_mean'):
    got = _final_loss(rule, True)
    # Within 5% of the honest run's loss reduction.
    assert got - honest < 0.05 * (start - honest), (rule, got, honest)
  # The median through int8 payloads (every worker's, all-gathered and
  # decoded) keeps the adversary out as well.
  got = _final_loss('median', True, codec='int8')
  assert got - honest < 0.05 * (start - honest), ('median int8', got)


# ------------------------------------------------------------------ HLO ---
def test_gathered_rules_cost_an_all_gather_of_every_payload():
  params = helpers.stack(helpers.tile_params())
  n = sum(x.size for x in jax.tree.leaves(helpers.tile_params()))  # 136

  def sync_report(**kwargs):
    tx = loc_opt.diloco(optax.sgd(0.1), sync_every=4, **kwargs)
    return helpers.phase_report(tx, params, True, helpers.worker_mesh())

  mean = sync_report(reduce_fn=parallel.worker_mean()).by_kind(
      cross_worker=True)
  assert set(mean) == {'all-reduce'}
  np.testing.assert_allclose(mean['all-reduce'] / M, 4 * n, rtol=0.05)
  for rule in robust.GATHERED:
    report = sync_report(aggregate=rule)
    kinds = report.by_kind(cross_worker=True)
    # Each worker sends its payload (and its flag) once...
    assert set(kinds) == {'all-gather'}, kinds
    np.testing.assert_allclose(kinds['all-gather'] / M, 4 * (n + 1),
                               rtol=0.05)
    # ... and receives all M of them: (M - 1) n through its link.
    link = parallel.Link(1.0)
    ratio = (parallel.transfers_seconds(
        parallel.cross_worker_transfers(report), M, link)
             / parallel.collective_seconds('all-reduce', 4 * n, M, link))
    np.testing.assert_allclose(ratio, M / 2, rtol=0.05)
    # Through a codec the gather shrinks to its payloads (int8: 136 codes
    # padded to one block of 256 and its fp32 scale) plus the M flags.
    kinds = sync_report(aggregate=rule, codec='int8').by_kind(
        cross_worker=True)
    assert set(kinds) == {'all-gather'}, kinds
    # (The reader counts a few bytes of padding on top; the fp32 gather
    # of the same pseudo-gradient is 552 bytes.)
    assert 256 + 4 + 4 <= kinds['all-gather'] / M <= 256 + 4 + 4 + 16, kinds
    # A per-tensor codec: one payload (and scale) per leaf.
    fp4 = compression.fp4_codec('e3m0', block_size=None)
    kinds = sync_report(aggregate=rule, codec=fp4).by_kind(cross_worker=True)
    want = sum(fp4.payload_bytes(x.size)
               for x in jax.tree.leaves(helpers.tile_params()))
    assert want + 4 <= kinds['all-gather'] / M <= want + 4 + 16, (kinds,
                                                                 want)
  # The clipped mean: the all-reduce plus the M norms.
  clipped = sync_report(aggregate='norm_clipped_mean').by_kind(
      cross_worker=True)
  np.testing.assert_allclose(clipped['all-reduce'] / M, 4 * (n + 1),
                             rtol=0.05)
  assert clipped['all-gather'] / M <= 16


def test_inner_steps_move_nothing_and_the_sync_branch_gathers():
  params = helpers.stack(helpers.tile_params())
  n = sum(x.size for x in jax.tree.leaves(helpers.tile_params()))
  tx = loc_opt.diloco(optax.sgd(0.1), sync_every=4, aggregate='median')
  helpers.check_two_phase_bytes(tx, params, 4 * (n + 1))


def test_sharded_median_matches_vmap():
  tx = loc_opt.diloco(optax.adam(1e-2), sync_every=3, aggregate='median')
  want, _ = helpers.run_workers(tx, 7)
  got, _ = helpers.run_sharded(tx, 7)
  conf.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


def test_streaming_diloco_takes_a_rule():
  params = helpers.stack(conf.example_params())
  del params
  tx = loc_opt.streaming_diloco(
      optax.adam(1e-2), sync_every=4, fragments={'w': 0, 'b': 1},
      num_fragments=2, overlap=0, aggregate='median')
  got, _ = helpers.run_workers(tx, 8)
  # With every worker honest and 4 of them, the median of each fragment
  # is finite and the workers agree after the last sync of each fragment.
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(got))
  # Through a stateless codec, per fragment; error feedback is refused.
  tx = loc_opt.streaming_diloco(
      optax.adam(1e-2), sync_every=4, fragments={'w': 0, 'b': 1},
      num_fragments=2, overlap=0, aggregate='trimmed_mean', codec='int8')
  coded, _ = helpers.run_workers(tx, 8)
  conf.assert_trees_close(coded, got, rtol=0.05, atol=0.02)
  with pytest.raises(ValueError, match='stateless codec'):
    loc_opt.streaming_diloco(optax.adam(1e-2), sync_every=4,
                             num_fragments=2, fragments={'w': 0, 'b': 1},
                             aggregate='trimmed_mean',
                             codec=compression.error_feedback(
                                 compression.from_codec(
                                     compression.int8())))
