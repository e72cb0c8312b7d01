"""Decoupled DiLoCo's numerics: the merge, the transform, its bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import compression
from loc_opt import outer
from tests import optax_conformance as conf
from tests.outer import _helpers as helpers

M = 3


# ----------------------------------------------------------- fragments ---
def test_balanced_fragments_bin_pack_whole_tensors():
  params = {f'x{i}': jnp.zeros(n) for i, n in
            enumerate([100, 60, 50, 40, 10])}
  ids = outer.balanced_fragments(params, 2)
  # largest first into the lighter bin: 100 | 60, 50 -> 1 (110), 40 -> 0
  # (140), 10 -> 1 (120)
  assert ids == {'x0': 0, 'x1': 1, 'x2': 1, 'x3': 0, 'x4': 1}
  loads = [sum(np.prod(params[k].shape) for k, v in ids.items() if v == p)
           for p in range(2)]
  n, p_count, largest = sum(loads), 2, 100
  assert max(loads) <= n / p_count + (1 - 1 / p_count) * largest
  with pytest.raises(ValueError, match='more than the 5 parameter leaves'):
    outer.balanced_fragments(params, 6)


def test_balanced_fragments_peak_is_bounded_against_the_optimum():
  # Four leaves of 2 into 3 fragments: [4, 2, 2], 1.5 x the even split
  # N / P = 8 / 3 (so no 4/3 bound against N / P), equal to the optimum 4,
  # within Graham's (4/3 - 1/(3P)) x optimum and N / P + (1 - 1/P) s_max.
  params = {f'x{i}': jnp.zeros(2) for i in range(4)}
  ids = outer.balanced_fragments(params, 3)
  loads = sorted((sum(2 for v in ids.values() if v == p) for p in range(3)),
                 reverse=True)
  assert loads == [4, 2, 2]
  assert max(loads) == 1.5 * 8 / 3
  assert max(loads) <= (4 / 3 - 1 / 9) * 4
  assert max(loads) <= 8 / 3 + (1 - 1 / 3) * 2


def test_token_weight_is_tokens_squared_over_steps():
  w = outer.token_weight(jnp.array([12., 0., 6.]), jnp.array([3., 0., 3.]))
  np.testing.assert_allclose(w, [48., 0., 12.])


# --------------------------------------------------------------- merge ---
def _merge(deltas, weights, **kwargs):
  return outer.merge_stacked([jnp.asarray(d, jnp.float32) for d in deltas],
                             jnp.asarray(weights, jnp.float32), **kwargs)


def test_rda_keeps_the_norm_where_the_average_shrinks_it():
  r = 2.
  e = np.eye(3) * r  # three orthogonal deltas of norm r, one per learner
  rda = _merge([e], [1., 1., 1.], direct=[False])[0]
  avg = _merge([e], [1., 1., 1.], direct=[True])[0]
  np.testing.assert_allclose(np.linalg.norm(rda), r, rtol=1e-6)
  np.testing.assert_allclose(np.linalg.norm(avg), r / np.sqrt(3), rtol=1e-6)
  np.testing.assert_allclose(rda / r, np.ones(3) / np.sqrt(3), rtol=1e-6)
  # Equal deltas: RDA is the delta itself, whatever the weights.
  d = np.array([[1., -2., 0.5]] * 3)
  np.testing.assert_allclose(_merge([d], [1., 5., 2.], direct=[False])[0],
                             d[0], rtol=1e-6)


def test_rda_with_opposite_deltas():
  d = np.array([[1., 2., -1.], [-1., -2., 1.], [0., 0., 0.]])
  # Equal weights: the directions cancel; the weighted average (0) instead,
  # and nothing is NaN.
  out = _merge([d], [1., 1., 0.], direct=[False])[0]
  np.testing.assert_array_equal(out, np.zeros(3))
  # Unequal weights: the mean direction is phi(d) / 3, not degenerate; the
  # radius is the weighted mean of the norms (all |d|).
  out = _merge([d], [2., 1., 0.], direct=[False])[0]
  np.testing.assert_allclose(out, d[0], rtol=1e-6)


def test_rda_scope_leaf_or_fragment_and_direct_pieces():
  rng = np.random.default_rng(0)
  a, b, emb = (rng.normal(size=(M, n)) for n in (4, 2, 3))
  w = np.array([1., 2., 3.])
  out = _merge([a, b, emb], w, direct=[False, False, True])
  want_emb = (w[:, None] * emb).sum(0) / w.sum()
  np.testing.assert_allclose(out[2], want_emb, rtol=1e-5)

  def rda(x):
    n = np.linalg.norm(x, axis=1)
    u = (w[:, None] * x / n[:, None]).sum(0) / w.sum()
    return (w * n).sum() / w.sum() * u / np.linalg.norm(u)

  np.testing.assert_allclose(out[0], rda(a), rtol=1e-5)
  np.testing.assert_allclose(out[1], rda(b), rtol=1e-5)
  whole = _merge([a, b], w, direct=[False, False], scope='fragment')
  joint = rda(np.concatenate([a, b], axis=1))
  np.testing.assert_allclose(np.concatenate(whole), joint, rtol=1e-5)
  # 'average' ignores direct: every piece is the weighted average.
  avg = _merge([a], w, direct=[False], merge='average')[0]
  np.testing.assert_allclose(avg, (w[:, None] * a).sum(0) / w.sum(),
                             rtol=1e-5)


def test_no_weight_merges_to_zero():
  out = _merge([np.ones((M, 2))], [0., 0., 0.], direct=[False])[0]
  np.testing.assert_array_equal(out, np.zeros(2))


# ----------------------------------------------------------- transform ---
def _run(tx, phases, inputs=None, m=M, steps=None):
  """Trains ``m`` learners of the 4 -> 3 model; ``phases[t]`` is step
  ``t``'s phase and ``inputs[t]`` its per-learner kwargs (stacked)."""
  steps = len(phases) if steps is None else steps
  params = helpers.stack(conf.example_params(), m)
  state = jax.vmap(tx.init)(params)
  for t in range(steps):
    kwargs = {} if inputs is None else inputs[t]

    def step(p, s, batch, kw, sync=phases[t]):
      g = jax.grad(helpers.quad_loss)(p, batch)
      u, s = tx.update(g, s, p, sync=sync, **kw)
      return optax.apply_updates(p, u), s

    params, state = jax.vmap(step, axis_name='worker')(
        params, state, helpers.worker_batches(t, m), kwargs)
  return params, state


_FRAGS = {'w': 0, 'b': 1}


def test_every_learner_uniform_average_equals_streaming_diloco():
  h, steps = 4, 12
  plan = outer.streaming_plan(h, 2, 0)
  tx = loc_opt.decoupled_diloco(optax.adam(1e-2), fragments=_FRAGS,
                                merge='average', weighting='uniform')
  ref = outer.streaming_diloco(optax.adam(1e-2), sync_every=h,
                               fragments=_FRAGS, overlap=0)
  phases = [False if plan(t) is False else (plan(t)[0], None)
            for t in range(steps)]
  got, state = _run(tx, phases)
  want, want_state = _run(ref, [plan(t) for t in range(steps)])
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
  conf.assert_trees_close(state.anchor, want_state.anchor, rtol=1e-6,
                          atol=1e-7)
  np.testing.assert_array_equal(state.merges[0], [3, 3])


def _masks(t, **kw):
  base = {'active': np.ones(M, bool), 'admitted': np.ones(M, bool),
          'receive': np.zeros((M, 2), bool), 'rejoin': np.zeros(M, bool)}
  base.update({k: np.asarray(v) for k, v in kw.items()})
  return base


def test_left_out_learner_has_weight_zero_and_rejoins_from_global():
  tx = loc_opt.decoupled_diloco(optax.sgd(0.1), fragments=_FRAGS,
                                merge='average', weighting='tokens')
  # Steps 0-2: learner 2 is down (inactive); step 2 merges fragment 0
  # without it; step 3 it rejoins.
  down = np.array([True, True, False])
  inputs = [_masks(0, active=down), _masks(1, active=down),
            _masks(2, active=down, admitted=down,
                   receive=np.array([[1, 0]] * M, bool)),
            _masks(3, active=down, rejoin=~down)]
  phases = [False, False, (0, None), False]
  params0 = helpers.stack(conf.example_params(), M)
  p2, s2 = _run(tx, phases, inputs, steps=2)
  # learner 2 never moved; the others took two plain SGD steps
  np.testing.assert_array_equal(p2['w'][2], params0['w'][2])
  assert not np.allclose(p2['w'][0], params0['w'][0])
  np.testing.assert_array_equal(s2.steps_since[:, 0], [2, 2, 0])
  p3, s3 = _run(tx, phases, inputs, steps=3)
  # the merge of fragment 0 over learners 0 and 1 only (equal tokens)
  local = [p2['w'][i] - 0.1 * jax.grad(helpers.quad_loss)(
      helpers.worker(p2, i), helpers.worker(helpers.worker_batches(2), i)
  )['w'] for i in range(2)]
  theta0 = params0['w'][0]
  delta = np.mean([theta0 - x for x in local], axis=0)
  momentum = delta
  want = theta0 - 0.7 * (delta + 0.9 * momentum)
  for i in range(M):
    np.testing.assert_allclose(s3.anchor['w'][i], want, rtol=1e-5)
    np.testing.assert_allclose(p3['w'][i], want, rtol=1e-5)
  np.testing.assert_array_equal(s3.left_out, [0, 0, 1])
  np.testing.assert_array_equal(s3.steps_since[:, 0], [0, 0, 0])
  p4, s4 = _run(tx, phases, inputs, steps=4)
  # learner 2 rejoined: the global fragments, counters 0, no step taken
  conf.assert_trees_close(helpers.worker(p4, 2),
                          helpers.worker(s4.anchor, 2), rtol=0, atol=0)
  np.testing.assert_array_equal(s4.steps_since[2], [0, 0])
  np.testing.assert_array_equal(s4.inner_steps, [4, 4, 0])


def test_token_weights_follow_the_steps_since_receipt():
  tx = loc_opt.decoupled_diloco(optax.sgd(0.1), fragments=_FRAGS,
                                merge='average', outer=optax.sgd(1.))
  # learner 0 steps 3 times, learner 1 once, learner 2 twice; then merge
  act = [np.array(a, bool) for a in ([1, 1, 1], [1, 0, 1], [1, 0, 0])]
  inputs = [_masks(t, active=a) for t, a in enumerate(act)]
  inputs[-1]['receive'] = np.zeros((M, 2), bool)
  params, _ = _run(tx, [False, False, False], inputs)
  _, state = _run(tx, [False, False, (0, None)], inputs)
  steps = np.array([3., 1., 2.])
  w = steps  # tokens^2 / steps with one token per step
  theta0 = helpers.stack(conf.example_params(), M)['w'][0]
  delta = sum(w[i] * (theta0 - params['w'][i]) for i in range(M)) / w.sum()
  np.testing.assert_allclose(state.anchor['w'][0], theta0 - delta,
                             rtol=1e-5, atol=1e-7)


def test_peer_rejoin_copies_a_live_learners_inner_state():
  tx = loc_opt.decoupled_diloco(optax.adam(1e-2), fragments=_FRAGS,
                                rejoin_state='peer')
  act = np.array([True, True, False])
  inputs = [_masks(0, active=act), _masks(1, active=act),
            _masks(2, active=~act, rejoin=~act)]
  _, state = _run(tx, [False, False, (None, 1)], inputs)
  mu = state.inner_state[0].mu['w']
  np.testing.assert_array_equal(mu[2], mu[1])
  assert int(state.inner_state[0].count[2]) == 2
  fresh = loc_opt.decoupled_diloco(optax.adam(1e-2), fragments=_FRAGS,
                                   rejoin_state='fresh')
  _, state = _run(fresh, [False, False, False], inputs)
  assert int(state.inner_state[0].count[2]) == 0


def test_error_feedback_keeps_its_scale_when_the_token_weight_changes():
  # Two identical learners with a constant true delta; tokens per step 8,
  # then 1 (the weight c_tokens^2 / c_steps drops 64x). The merged delta
  # through 2-bit statistical quantization with error feedback must stay
  # as close to the true delta after the drop as before it (the residual
  # in weighted units made the first merge after the drop ~20x |delta|
  # off). A rejoin restarts the learner's codec state.
  m, h, lr = 2, 2, 0.01
  g = {'w': jax.random.normal(jax.random.key(1), (16, 8)),
       'b': jax.random.normal(jax.random.key(2), (8,))}
  codec = compression.error_feedback(compression.statistical(2))
  tx = loc_opt.decoupled_diloco(
      optax.sgd(lr), fragments={'w': 0, 'b': 0}, merge='average',
      weighting='tokens', codec=codec, outer=optax.sgd(1.))
  params = helpers.stack(jax.tree.map(jnp.zeros_like, g), m)
  state = jax.vmap(tx.init)(params)

  def make(sync):
    def step(p, s, tokens, rejoin):
      u, s = tx.update(g, s, p, sync=sync, tokens=tokens, rejoin=rejoin)
      return optax.apply_updates(p, u), s
    return jax.jit(jax.vmap(step, axis_name='worker', in_axes=(0, 0, None,
                                                                0)))

  steps = {False: make(False), True: make((0, None))}
  true = jax.tree.map(lambda x: lr * h * x, g)
  errors, none = [], np.zeros(m, bool)
  for r in range(8):
    tokens = jnp.float32(8. if r < 4 else 1.)
    before = state.anchor
    for t in range(h):
      params, state = steps[t == h - 1](params, state, tokens, none)
    merged = jax.tree.map(lambda a, b: a[0] - b[0], before, state.anchor)
    errors.append(float(optax.tree.norm(optax.tree.sub(merged, true))
                        / optax.tree.norm(true)))
  assert max(errors[4:]) < 1.5 * max(errors[:4]), errors
  error = jax.tree.leaves(state.codec_state[0].error)
  assert all(float(jnp.abs(e).max()) > 0 for e in error)
  _, state = steps[False](params, state, tokens, np.array([False, True]))
  for e in jax.tree.leaves(state.codec_state[0].error):
    assert float(jnp.abs(e[0]).max()) > 0
    np.testing.assert_array_equal(e[1], np.zeros_like(e[1]))


def test_token_weights_refuse_a_codec_state_they_cannot_rescale():
  ef21 = compression.ef21(compression.statistical(2))
  params = conf.example_params()
  tx = loc_opt.decoupled_diloco(optax.sgd(.1), fragments=_FRAGS, codec=ef21)
  with pytest.raises(ValueError, match='only compression.error_feedback'):
    tx.init(params)
  loc_opt.decoupled_diloco(optax.sgd(.1), fragments=_FRAGS, codec=ef21,
                           weighting='uniform').init(params)


def test_bad_arguments_name_the_field():
  with pytest.raises(ValueError, match='merge must be one of'):
    loc_opt.decoupled_diloco(optax.sgd(1.), num_fragments=2, merge='sum')
  with pytest.raises(ValueError, match='needs num_fragments'):
    loc_opt.decoupled_diloco(optax.sgd(1.))
  tx = loc_opt.decoupled_diloco(optax.sgd(1.), fragments=_FRAGS)
  p = conf.example_params()
  s = tx.init(p)
  with pytest.raises(ValueError, match='static phase sync='):
    tx.update(p, s, p)
  with pytest.raises(ValueError, match='sync must be False or'):
    tx.update(p, s, p, sync=(2, None))


def test_hlo_bytes_of_a_merge_are_the_fragment_once():
  mesh = helpers.worker_mesh()
  params = {'embed': {'embedding': jnp.zeros((32, 16))},
            'w1': jnp.zeros((64, 16)), 'w2': jnp.zeros((32, 16))}
  ids = outer.balanced_fragments(params, 2)
  assert ids == {'embed': {'embedding': 1}, 'w1': 0, 'w2': 1}
  stacked = helpers.stack(params, helpers.M)
  for merge in ('average', 'rda'):
    tx = loc_opt.decoupled_diloco(optax.sgd(0.1), num_fragments=2,
                                  merge=merge)
    assert helpers.phase_report(
        tx, stacked, False, mesh).cross_worker_bytes_range == (0, 0)
    for p, n in ((0, 64 * 16), (1, 2 * 32 * 16)):
      report = helpers.phase_report(tx, stacked, (p, None), mesh)
      # fp32 pieces once, plus the weight and, for RDA, one norm per
      # RDA leaf (the embedding is averaged directly)
      scalars = 1 + (0 if merge == 'average' else (1 if p == 0 else 1))
      lo, hi = report.cross_worker_bytes_range
      assert lo == report.cross_worker_bytes  # unconditional part
      per_worker = report.cross_worker_bytes_per_worker
      assert 4 * n <= per_worker <= 4 * n + 4 * scalars * 2, (p, per_worker)
  # Through a codec (error feedback per learner and fragment), the weighted
  # pieces cross as its payload; the scalars stay fp32.
  codec = compression.error_feedback(compression.from_codec(
      compression.int8()))
  tx = loc_opt.decoupled_diloco(optax.sgd(0.1), num_fragments=2, codec=codec)
  pieces = [params['w1']]
  payload = compression.as_compressor(codec).payload_bytes(pieces)
  report = helpers.phase_report(tx, stacked, (0, None), mesh)
  per_worker = report.cross_worker_bytes_per_worker
  assert payload <= per_worker <= 1.1 * payload + 64, (per_worker, payload)
  assert per_worker < 0.3 * 4 * 64 * 16
