"""Tests of Streaming DiLoCo: schedule, fragments, overlap blend, bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import compression
from loc_opt import outer
from loc_opt import parallel
from tests import optax_conformance as conf
from tests.outer import _helpers as helpers

M = helpers.M


def make_streaming(learning_rate):
  return outer.streaming_diloco(
      optax.adam(learning_rate), sync_every=4, fragments={'w': 1, 'b': 0},
      overlap=1, axis_name=None)


def test_conformance(tmp_path):
  conf.check_all(make_streaming, tmp_path)


def test_one_fragment_no_overlap_is_diloco():
  kw = dict(sync_every=3, outer=loc_opt.outer.nesterov_outer(0.7, 0.9))
  got, state = helpers.run_workers(outer.streaming_diloco(
      optax.adam(1e-2), num_fragments=1, overlap=0, **kw), 10)
  want, want_state = helpers.run_workers(loc_opt.diloco(optax.adam(1e-2), **kw),
                                         10)
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
  conf.assert_trees_close(state.anchor, want_state.anchor, rtol=1e-6,
                          atol=1e-7)
  conf.assert_trees_close(state.outer_state[0][0].trace,
                          jax.tree.leaves(want_state.outer_state[0].trace),
                          rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(state.sends[:, 0], 3)
  assert int(want_state.num_syncs[0]) == 3


@pytest.mark.parametrize('h,p,tau', [(4, 2, 1), (6, 2, 0)])
def test_plan_matches_switch_program(h, p, tau):
  tx = outer.streaming_diloco(
      optax.adam(1e-2), sync_every=h, fragments={'w': p - 1, 'b': 0},
      overlap=tau)
  plan = outer.streaming_plan(h, p, tau)
  steps = 2 * h + tau + 1
  got, state, programs = helpers.run_planned(tx, plan, steps)
  want, want_state = helpers.run_workers(tx, steps)
  conf.assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
  conf.assert_trees_close(state, want_state, rtol=1e-6, atol=1e-7)
  # Inner, one send per fragment (and one apply per fragment with overlap).
  assert len(programs) == 1 + p * (2 if tau else 1)


@pytest.mark.parametrize('h,p,tau', [(12, 4, 0), (12, 3, 3), (8, 4, 1)])
def test_plan_syncs_each_fragment_once_per_period(h, p, tau):
  plan = outer.streaming_plan(h, p, tau)
  phases = [plan(c) for c in range(5 * h)]
  stride = h // p
  for start in range(0, 4 * h):
    window = phases[start:start + h]
    sends = [ph[0] for ph in window if ph and ph[0] is not None]
    applies = [ph[1] for ph in window if ph and ph[1] is not None]
    assert sorted(sends) == list(range(p)), (start, window)
    if start >= tau:
      assert sorted(applies) == list(range(p)), (start, window)
  for c, ph in enumerate(phases[:4 * h]):
    if ph and ph[0] is not None:  # sends at t = p S + k H, t = c + 1
      assert (c + 1) % stride == 0 and (c + 1) % h == ph[0] * stride
      assert phases[c + tau][1] == ph[0]  # lands tau steps later
  # A full period after the start holds P sends (the syncs) and P applies
  # (apply-only phases are not syncs).
  assert plan.num_syncs(h, 2 * h) == p
  assert sum(1 for ph in phases[h:2 * h] if ph) == p * (2 if tau else 1)


def lm_params(num_layers, shape=(4, 2)):
  """Parameters named like the reference LM's (embed, blocks, norm, head)."""
  params = {'embed': {'embedding': jnp.zeros(shape)},
            'final_norm': {'scale': jnp.zeros(shape[-1:])},
            'head': {'kernel': jnp.zeros(shape[::-1])}}
  for layer in range(num_layers):
    params[f'layer_{layer}'] = {
        'attn': {'query': {'kernel': jnp.zeros(shape)}},
        'mlp': {'wi': {'kernel': jnp.zeros(shape)}}}
  return params


def block_fragments(ids, num_layers):
  """{layer: fragment} from a fragment_ids tree (asserting both leaves of a
  block agree), and the fragments of the three non-block leaves."""
  out = {}
  for layer in range(num_layers):
    block = ids[f'layer_{layer}']
    assert block['attn']['query']['kernel'] == block['mlp']['wi']['kernel']
    out[layer] = block['attn']['query']['kernel']
  rest = {ids['embed']['embedding'], ids['final_norm']['scale'],
          ids['head']['kernel']}
  return out, rest


@pytest.mark.parametrize('layers,p,pattern,want', [
    (2, 3, 'strided', {0: 1, 1: 2}),
    (3, 3, 'strided', {0: 1, 1: 2, 2: 1}),
    (3, 3, 'sequential', {0: 1, 1: 1, 2: 2}),
    (5, 3, 'strided', {0: 1, 1: 2, 2: 1, 3: 2, 4: 1}),
    (5, 3, 'sequential', {0: 1, 1: 1, 2: 1, 3: 2, 4: 2}),
    (5, 4, 'sequential', {0: 1, 1: 1, 2: 2, 3: 2, 4: 3}),
    (5, 6, 'strided', {0: 1, 1: 2, 2: 3, 3: 4, 4: 5}),
    (2, 2, 'sequential', {0: 1, 1: 1}),
])
def test_fragment_ids_on_lm_names(layers, p, pattern, want):
  ids = outer.fragment_ids(lm_params(layers), p, pattern=pattern)
  blocks, rest = block_fragments(ids, layers)
  assert blocks == want
  assert rest == {0}


def test_fragment_ids_without_a_separate_non_block_fragment():
  ids = outer.fragment_ids(lm_params(5), 2, separate_non_block=False)
  blocks, rest = block_fragments(ids, 5)
  assert blocks == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0} and rest == {0}
  ids = outer.fragment_ids(lm_params(5), 2, separate_non_block=False,
                           pattern='sequential')
  assert block_fragments(ids, 5)[0] == {0: 0, 1: 0, 2: 0, 3: 1, 4: 1}
  one = outer.fragment_ids(lm_params(3), 1)
  assert set(jax.tree.leaves(one)) == {0}


def test_fragment_ids_ranks_sparse_block_numbers():
  params = {'layer_10': {'w': jnp.zeros(2)}, 'layer_7': {'w': jnp.zeros(2)},
            'head': jnp.zeros(2)}
  ids = outer.fragment_ids(params, 3)
  assert ids == {'layer_7': {'w': 1}, 'layer_10': {'w': 2}, 'head': 0}


@pytest.mark.parametrize('layers,p', [(2, 4), (0, 2), (5, 7)])
def test_fragment_ids_raise_on_empty_fragment(layers, p):
  with pytest.raises(ValueError, match='num_fragments'):
    outer.fragment_ids(lm_params(layers), p)


def test_model_without_blocks_gets_the_balanced_split():
  # An MLP's leaves match no block pattern: by default its whole leaves are
  # bin-packed by size (balanced_fragments), the same state as passing
  # that split.
  params = {'dense_0': {'kernel': jnp.zeros((4, 8)), 'bias': jnp.zeros(8)},
            'dense_1': {'kernel': jnp.zeros((8, 4)), 'bias': jnp.zeros(4)}}
  default = loc_opt.streaming_diloco(optax.sgd(0.1), sync_every=4,
                                     num_fragments=2, axis_name=None)
  ids = outer.balanced_fragments(params, 2)
  tx = loc_opt.streaming_diloco(optax.sgd(0.1), sync_every=4,
                                num_fragments=2, fragments=ids, axis_name=None)
  assert sorted(set(jax.tree.leaves(ids))) == [0, 1]
  assert outer.default_fragments(params, 2) == ids
  jax.tree.map(np.testing.assert_array_equal, default.init(params),
               tx.init(params))
  # pattern='balanced' (the trainer's outer.streaming_diloco.pattern) is
  # the same split.
  assert outer.fragment_ids(params, 2, pattern='balanced') == ids
  with pytest.raises(ValueError, match="pattern='balanced'"):
    outer.fragment_ids(params, 2)


def test_fragments_as_callable_and_tree_agree():
  params = lm_params(3)

  def by_path(path, leaf):
    del leaf
    name = jax.tree_util.keystr(path, simple=True, separator='/')
    return 1 if name.startswith('layer_') else 0

  tree = jax.tree_util.tree_map_with_path(by_path, params)
  sizes = outer.fragment_bytes(params, by_path)
  assert sizes == outer.fragment_bytes(params, tree)
  assert sizes == [4 * (8 + 2 + 8), 4 * 3 * 16]
  # fragment_bytes: fp4 payload (half a byte per value) + one fp32 scale
  # per tensor: fragment 0 holds tensors of 8, 2 and 8 values, fragment 1
  # six tensors of 8.
  fp4 = compression.fp4_codec('e3m0', block_size=None)
  assert outer.fragment_bytes(params, tree, codec=fp4) == [
      (4 + 4) + (1 + 4) + (4 + 4), 6 * (4 + 4)]
  assert outer.fragment_bytes(params, tree, jnp.bfloat16) == [36, 96]


@pytest.mark.parametrize('kwargs,match', [
    (dict(sync_every=10, num_fragments=3), 'multiple of num_fragments'),
    (dict(sync_every=12, num_fragments=3, overlap=4), 'overlap'),
    (dict(sync_every=12, num_fragments=3, overlap=-1), 'overlap'),
    (dict(sync_every=12, num_fragments=0), 'num_fragments'),
    (dict(sync_every=0, num_fragments=1), 'sync_every'),
    (dict(sync_every=12, fragments=lambda p, x: 0), 'num_fragments'),
    (dict(sync_every=12, num_fragments=2, alpha=1.5), 'alpha'),
])
def test_bad_arguments_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    outer.streaming_diloco(optax.sgd(0.1), **kwargs)
  if 'alpha' not in kwargs and 'fragments' not in kwargs:
    with pytest.raises(ValueError, match=match):
      outer.streaming_plan(kwargs['sync_every'],
                           kwargs.get('num_fragments', 1),
                           kwargs.get('overlap', 0))


def test_bad_fragments_and_phases_raise():
  params = conf.example_params()
  tx = outer.streaming_diloco(optax.sgd(0.1), sync_every=6,
                              num_fragments=3,
                              fragments={'w': 0, 'b': 1})
  with pytest.raises(ValueError, match='fragments'):
    tx.init(params)
  tx = outer.streaming_diloco(optax.sgd(0.1), sync_every=4,
                              fragments={'w': 0, 'b': 1}, overlap=1,
                              axis_name=None)
  state = tx.init(params)
  for bad in [True, (0, 0), (None, None), (2, None), 1]:
    with pytest.raises(ValueError, match='sync'):
      tx.update(params, state, params, sync=bad)


def test_overlap_blend_uses_current_local_params():
  # Two workers, inner SGD lr 1 on constant gradients g_m, outer SGD lr 0.5,
  # H = 4, P = 2, tau = 1, alpha = 0.5. Fragment 1 ('layer_0') sends at t = 2
  # (delta = 2 g_m) and lands at t = 3: phi_1 = th0 - 0.5 * 2 * gbar and
  # theta_1 = 0.5 (th0 - 3 g_m) + 0.5 phi_1 = th0 - 1.5 g_m - 0.5 gbar.
  # Fragment 0 ('head') sends at t = 4 (delta 4 g_m), lands at t = 5:
  # phi_0 = th0 - 2 gbar, theta_0 = 0.5 (th0 - 5 g_m) + 0.5 phi_0.
  tx = outer.streaming_diloco(
      optax.sgd(1.0), sync_every=4, num_fragments=2, overlap=1, alpha=0.5,
      outer=optax.sgd(0.5))
  th0 = {'head': jnp.array([1.0, -2.0]), 'layer_0': jnp.array([0.5, 3.0])}
  g = {'head': jnp.array([[1.0, 2.0], [3.0, -1.0]]),
       'layer_0': jnp.array([[-2.0, 0.5], [1.0, 1.5]])}
  gbar = jax.tree.map(lambda x: x.mean(0), g)
  step = helpers.grads_step(tx)
  params = helpers.stack(th0, 2)
  state = jax.vmap(tx.init)(params)
  seen = []
  for _ in range(5):
    params, state = step(params, state, g)
    seen.append((params, state))
  p3, s3 = seen[2]
  h0, l0, gh, gl = th0['head'], th0['layer_0'], g['head'], g['layer_0']
  np.testing.assert_allclose(p3['layer_0'],
                             l0 - 1.5 * gl - 0.5 * gbar['layer_0'], rtol=1e-6)
  np.testing.assert_allclose(s3.anchor['layer_0'][0],
                             l0 - gbar['layer_0'], rtol=1e-6)
  np.testing.assert_allclose(p3['head'], h0 - 3 * gh, rtol=1e-6)
  np.testing.assert_allclose(s3.anchor['head'][0], h0)
  p5, s5 = seen[4]
  phi0 = h0 - 2 * gbar['head']
  np.testing.assert_allclose(p5['head'], 0.5 * (h0 - 5 * gh) + 0.5 * phi0,
                             rtol=1e-6)
  np.testing.assert_allclose(
      p5['layer_0'], l0 - 3.5 * gl - 0.5 * gbar['layer_0'], rtol=1e-6)
  np.testing.assert_allclose(
      outer.streaming_eval_params(s5, p5)['head'][1], phi0, rtol=1e-6)
  np.testing.assert_array_equal(s5.sends[0], [1, 1])
  np.testing.assert_array_equal(s5.applies[0], [1, 1])


def test_only_the_applied_fragment_moves_its_outer_state():
  h, p, tau = 6, 3, 1
  tx = outer.streaming_diloco(
      optax.adam(1e-2), sync_every=h, num_fragments=p, overlap=tau,
      fragments=lambda path, x: {'w': 1, 'b': 2}[path[0].key] if x.ndim
      else 0)
  params = helpers.stack({'w': jnp.ones((4, 3)), 'b': jnp.ones(3),
                          'c': jnp.ones(())})
  state = jax.vmap(tx.init)(params)
  plan = outer.streaming_plan(h, p, tau)

  @jax.jit
  @parallel.vmap_workers
  def step(params, state, batch):
    x, _ = batch
    grads = jax.grad(lambda q: jnp.sum(jnp.tanh(x @ q['w']) * q['b'])
                     + q['c'] * x.sum())(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for i in range(2 * h + 1):
    new_params, new_state = step(params, state, helpers.worker_batches(i))
    phase = plan(i)
    applied = phase[1] if phase else None
    for q in range(p):
      before = jax.tree.leaves(state.outer_state[q])
      after = jax.tree.leaves(new_state.outer_state[q])
      same = all(np.array_equal(a, b) for a, b in zip(before, after))
      assert same == (q != applied), (i, q, phase)
    leaves_before = jax.tree.leaves(state.anchor)  # order: b, c, w
    leaves_after = jax.tree.leaves(new_state.anchor)
    for q, (a, b) in zip([2, 0, 1], zip(leaves_before, leaves_after)):
      assert np.array_equal(a, b) == (q != applied), (i, q, phase)
    params, state = new_params, new_state
  np.testing.assert_array_equal(state.sends[0], [2, 2, 2])
  np.testing.assert_array_equal(state.applies[0], [2, 2, 2])


def test_fp4_codec_sends_through_each_fragment():
  codec = compression.error_feedback(compression.as_compressor(
      compression.fp4_codec('e3m0', block_size=None)))
  tx = outer.streaming_diloco(
      optax.adam(1e-2), sync_every=4, fragments={'w': 1, 'b': 0},
      overlap=0, codec=codec)
  exact = outer.streaming_diloco(
      optax.adam(1e-2), sync_every=4, fragments={'w': 1, 'b': 0}, overlap=0)
  params, state = helpers.run_workers(tx, 2)  # fragment 1 ('w') synced once
  want, _ = helpers.run_workers(exact, 2)
  # Workers agree after the sync (one mean, the same operations on every
  # worker: bit for bit); fp4 lands near the exact mean.
  np.testing.assert_array_equal(params['w'][0], params['w'][3])
  np.testing.assert_allclose(params['w'], want['w'], atol=0.05)
  # The error buffer of 'w' holds the rounding error; 'b' was not sent.
  assert np.abs(state.codec_state[1].error[0]).max() > 0
  np.testing.assert_array_equal(state.codec_state[0].error[0], 0)


# ------------------------------------------------------------------ HLO ---
HLO_SHAPE = (32, 16)


def hlo_params():
  """Three equal fragments of 1,024 parameters (P = 3, strided)."""
  params = {'embed': {'embedding': jnp.zeros(HLO_SHAPE)},
            'head': {'kernel': jnp.zeros(HLO_SHAPE[::-1])}}
  for layer in range(4):
    params[f'layer_{layer}'] = {'w': jnp.zeros(HLO_SHAPE)}
  return params


def test_hlo_bytes_per_phase():
  mesh = parallel.make_worker_mesh(M, data=2)
  params = helpers.stack(hlo_params())
  p, h = 3, 6
  ids = outer.fragment_ids(hlo_params(), p)
  theory = outer.fragment_bytes(hlo_params(), ids)
  assert theory == [4096] * 3
  dense = loc_opt.diloco(optax.sgd(0.1), sync_every=h,
                         reduce_fn=parallel.worker_mean())
  total = helpers.phase_report(dense, params, True,
                               mesh).cross_worker_bytes_per_worker
  np.testing.assert_allclose(total, sum(theory), rtol=0.1)
  fp4 = compression.fp4_codec('e3m0', block_size=None)
  for codec in (None, fp4):
    tx = outer.streaming_diloco(optax.sgd(0.1), sync_every=h,
                                num_fragments=p, overlap=1, codec=codec)
    plan = outer.streaming_plan(h, p, 1)
    want = outer.fragment_bytes(hlo_params(), ids, codec=codec)
    got = {}
    # The send phases, and (once) the inner and an apply phase.
    phases = [ph for ph in plan.phases(2 * h) if ph and ph[0] is not None]
    if codec is None:
      phases += [False, (None, 0)]
    for phase in phases:
      report = helpers.phase_report(tx, params, phase, mesh)
      got[phase] = report.cross_worker_bytes_per_worker
      # The only conditional collectives: the recovery round for a
      # non-finite mean, whose fast branch moves nothing.
      assert report.cross_worker_bytes_range[0] == \
          report.cross_worker_bytes
      assert all(0 in b for b in report.branches.values())
    if codec is None:
      assert got[False] == got[(None, 0)] == 0
      for q in range(p):
        np.testing.assert_allclose(got[(q, None)], want[q], rtol=0.1)
    else:
      # Exact: each fragment holds two tensors of 512 values, sent as 512
      # bytes of fp4 codes and one fp32 scale per tensor.
      assert want == [1024 // 2 + 2 * 4] * p
      for q in range(p):
        assert got[(q, None)] == want[q]
    peak = max(got.values())
    if codec is None:
      np.testing.assert_allclose(peak / total, 1 / p, rtol=0.1)
    else:
      np.testing.assert_allclose(peak / total, 1 / (8 * p), rtol=0.1)


def test_switch_program_sends_only_inside_branches():
  mesh = parallel.make_worker_mesh(M, data=2)
  tx = outer.streaming_diloco(optax.sgd(0.1), sync_every=6,
                              num_fragments=3, overlap=0)
  report = helpers.phase_report(tx, helpers.stack(hlo_params()), None, mesh)
  assert report.cross_worker_bytes == 0
  (branches,) = [b for b in report.branches.values() if len(b) == 4]
  # Inner branch moves nothing; each fragment's branch its 4 KiB per worker,
  # and holds a nested conditional (the recovery round for a non-finite
  # mean: the fragment again, with each worker's weight) whose other
  # branch moves nothing.
  recovery = [b for b in report.branches.values() if len(b) == 2]
  assert len(recovery) == 3 and all(sorted(b)[0] == 0 for b in recovery)
  assert sorted(branches)[0] == 0
  np.testing.assert_allclose(np.array(sorted(branches)[1:]) / M, 2 * 4096,
                             rtol=0.1)


def test_dropout_and_non_finite_fragment_as_diloco():
  """P=1, tau=0 with an absent worker and a NaN worker equals diloco's
  mean over the rest; ``left_out`` counts both."""
  params = helpers.stack(conf.example_params())
  grads = jax.tree.map(
      lambda g: g * jnp.arange(1., M + 1).reshape((M,) + (1,) * (g.ndim - 1)),
      params)
  grads['w'] = grads['w'].at[3].set(jnp.nan)
  present = jnp.asarray([True, False, True, True])
  kwargs = dict(sync_every=1, outer=optax.sgd(0.7))
  results = []
  for tx, sync in ((outer.streaming_diloco(optax.sgd(0.1), num_fragments=1,
                                           overlap=0, **kwargs), (0, 0)),
                   (loc_opt.diloco(optax.sgd(0.1), **kwargs), True)):

    def step(p, s, g, present, tx=tx, sync=sync):
      u, s = tx.update(g, s, p, sync=sync, present=present)
      return optax.apply_updates(p, u), s

    results.append(jax.vmap(step, axis_name='worker')(
        params, jax.vmap(tx.init)(params), grads, present))
  (got, s_state), (want, d_state) = results
  conf.assert_trees_close(got, want, rtol=1e-6)
  np.testing.assert_array_equal(s_state.left_out, [0, 1, 0, 1])
  np.testing.assert_array_equal(d_state.left_out, [0, 1, 0, 1])
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(got))


# ------------------------------------------------------ stacked layers ---
def stacked_lm_params(num_layers, shape=(4, 2)):
  """:func:`lm_params` with the blocks stacked on a leading axis, named as
  the reference LM with ``model.scan_layers`` (``layers/...``)."""
  params = lm_params(0, shape)
  params['layers'] = {
      'attn': {'query': {'kernel': jnp.zeros((num_layers,) + shape)}},
      'mlp': {'wi': {'kernel': jnp.zeros((num_layers,) + shape)}}}
  return params


@pytest.mark.parametrize('layers,p,pattern', [
    (5, 3, 'strided'), (5, 4, 'sequential'), (2, 2, 'sequential'),
    (4, 3, 'sequential')])
def test_fragment_ids_split_stacked_leaves_like_blocks(layers, p, pattern):
  want, _ = block_fragments(
      outer.fragment_ids(lm_params(layers), p, pattern=pattern), layers)
  ids = outer.fragment_ids(stacked_lm_params(layers), p, pattern=pattern)
  rows = ids['layers']['attn']['query']['kernel']
  assert rows == ids['layers']['mlp']['wi']['kernel']
  assert rows == tuple(want[layer] for layer in range(layers))
  assert {ids['embed']['embedding'], ids['head']['kernel']} == {0}
  # Bytes follow the rows: the same fragments as the unrolled blocks.
  assert outer.fragment_bytes(stacked_lm_params(layers), ids) == \
      outer.fragment_bytes(lm_params(layers), outer.fragment_ids(
          lm_params(layers), p, pattern=pattern))
  with pytest.raises(ValueError, match='num_fragments'):
    outer.fragment_ids(stacked_lm_params(layers), layers + 2)


def test_bad_row_ids_raise():
  params = {'layers': {'w': jnp.zeros((3, 2))}, 'head': jnp.zeros(2)}
  tx = outer.streaming_diloco(optax.sgd(0.1), sync_every=4,
                              fragments={'layers': {'w': (1, 0)}, 'head': 0})
  with pytest.raises(ValueError, match='one per row'):
    tx.init(params)


DEPTH = 4


def deep_loss(params, batch):
  """A 4 -> 3 model with ``DEPTH`` tanh blocks, on the unrolled tree."""
  x, y = batch
  h = x @ params['embed']
  for layer in range(DEPTH):
    h = jnp.tanh(h @ params[f'layer_{layer}']['w'] + params[
        f'layer_{layer}']['b'])
  return jnp.mean((h @ params['head'] - y) ** 2)


def deep_params():
  keys = jax.random.split(jax.random.key(3), 2 + 2 * DEPTH)
  params = {'embed': jax.random.normal(keys[0], (4, 4)),
            'head': jax.random.normal(keys[1], (4, 3))}
  for layer in range(DEPTH):
    params[f'layer_{layer}'] = {
        'w': jax.random.normal(keys[2 + 2 * layer], (4, 4)) / 2,
        'b': jax.random.normal(keys[3 + 2 * layer], (4,)) / 4}
  return params


def stack_layers(params):
  """The unrolled tree with its blocks stacked under ``layers``."""
  blocks = [params[f'layer_{layer}'] for layer in range(DEPTH)]
  out = {k: v for k, v in params.items() if not k.startswith('layer_')}
  out['layers'] = jax.tree.map(lambda *x: jnp.stack(x), *blocks)
  return out


def unstack_layers(params, axis=0):
  """The inverse of :func:`stack_layers` (layers on axis ``axis``)."""
  out = {k: v for k, v in params.items() if k != 'layers'}
  for layer in range(DEPTH):
    out[f'layer_{layer}'] = jax.tree.map(
        lambda x, layer=layer: jnp.take(x, layer, axis=axis),
        params['layers'])
  return out


def run_deep(tx, params, steps, loss):
  step = jax.jit(parallel.vmap_workers(helpers.train_step(tx, loss=loss)))
  params = helpers.stack(params)
  state = jax.vmap(tx.init)(params)
  for i in range(steps):
    params, state = step(params, state, helpers.worker_batches(i))
  return params, state


def odd_rows(path, leaf):
  """Rows 0, 1, 3 of the stacked leaves in fragment 1 (a gather / scatter,
  not a slice), row 2 in fragment 2; the unrolled twin by block name."""
  name = jax.tree_util.keystr(path, simple=True, separator='/')
  if name.startswith('layers/'):
    return (1, 1, 2, 1)
  if name.startswith('layer_'):
    return 2 if name.startswith('layer_2') else 1
  del leaf
  return 0


@pytest.mark.parametrize('pattern,tau,codec', [
    ('strided', 1, None), ('sequential', 0, None), ('strided', 1, 'fp4'),
    (odd_rows, 1, None)])
def test_stacked_layers_train_as_unrolled(pattern, tau, codec):
  """Streaming DiLoCo over a tree whose blocks are stacked on a leading
  axis gives the numbers of the same blocks as separate leaves."""
  if codec == 'fp4':
    codec = compression.error_feedback(compression.as_compressor(
        compression.fp4_codec('e3m0', block_size=None)))

  def make(tree):
    fragments = pattern if callable(pattern) else outer.fragment_ids(
        tree, 3, pattern=pattern)
    return outer.streaming_diloco(
        optax.adam(3e-2), sync_every=6, num_fragments=3, overlap=tau,
        fragments=fragments, codec=codec,
        outer=loc_opt.outer.nesterov_outer(0.7, 0.9))

  steps = 2 * 6 + tau + 1
  want, want_state = run_deep(make(deep_params()), deep_params(), steps,
                              deep_loss)
  got, state = run_deep(make(stack_layers(deep_params())),
                        stack_layers(deep_params()), steps,
                        lambda p, b: deep_loss(unstack_layers(p), b))
  conf.assert_trees_close(unstack_layers(got, axis=1), want, rtol=1e-5,
                          atol=1e-6)
  conf.assert_trees_close(unstack_layers(state.anchor, axis=1),
                          want_state.anchor, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(state.sends, want_state.sends)
  # Workers agree on each fragment's anchor, which moved off the start.
  for leaf in jax.tree.leaves(state.anchor):
    np.testing.assert_allclose(leaf[0], leaf[-1], rtol=1e-6)
  start = stack_layers(deep_params())['layers']['w']
  moved = np.abs(np.asarray(state.anchor['layers']['w'][0]) - start)
  assert (moved.reshape(DEPTH, -1).max(1) > 0).all()


def stacked_hlo_params():
  """:func:`hlo_params` with the four blocks stacked: still three equal
  fragments of 1,024 parameters (P = 3, strided)."""
  return {'embed': {'embedding': jnp.zeros(HLO_SHAPE)},
          'head': {'kernel': jnp.zeros(HLO_SHAPE[::-1])},
          'layers': {'w': jnp.zeros((4,) + HLO_SHAPE)}}


@pytest.mark.parametrize('pattern', ['strided', 'sequential'])
def test_hlo_bytes_per_phase_with_stacked_layers(pattern):
  """Each send phase moves its own rows of the stacked leaf: 1 / P of
  DiLoCo's sync, read from the compiled HLO."""
  mesh = parallel.make_worker_mesh(M, data=2)
  params = helpers.stack(stacked_hlo_params())
  p, h = 3, 6
  ids = outer.fragment_ids(stacked_hlo_params(), p, pattern=pattern)
  assert ids['layers']['w'] == {'strided': (1, 2, 1, 2),
                                'sequential': (1, 1, 2, 2)}[pattern]
  theory = outer.fragment_bytes(stacked_hlo_params(), ids)
  assert theory == [4096] * 3
  dense = loc_opt.diloco(optax.sgd(0.1), sync_every=h,
                         reduce_fn=parallel.worker_mean())
  total = helpers.phase_report(dense, params, True,
                               mesh).cross_worker_bytes_per_worker
  np.testing.assert_allclose(total, sum(theory), rtol=0.1)
  tx = outer.streaming_diloco(optax.sgd(0.1), sync_every=h, num_fragments=p,
                              fragments=ids, overlap=1)
  got = {}
  for phase in [(q, None) for q in range(p)] + [False, (None, 1)]:
    report = helpers.phase_report(tx, params, phase, mesh)
    got[phase] = report.cross_worker_bytes_per_worker
    assert report.cross_worker_bytes_range[0] == report.cross_worker_bytes
  assert got[False] == got[(None, 1)] == 0
  for q in range(p):
    np.testing.assert_allclose(got[(q, None)], theory[q], rtol=0.1)
  np.testing.assert_allclose(max(got.values()) / total, 1 / p, rtol=0.1)
