"""Compressors, error feedback and the compressed all-reduce transform."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import compression
from loc_opt import parallel

W = 4


def _grads(step, shapes=((16, 24), (24,))):
  keys = jax.random.split(jax.random.key(step), len(shapes))
  return {f'p{i}': jax.random.normal(k, (W,) + s)
          for i, (k, s) in enumerate(zip(keys, shapes))}


def _run_transform(tx, steps=4, shapes=((16, 24), (24,))):
  """Runs ``tx`` on per-worker gradients under vmap; returns outputs."""
  params = {f'p{i}': jnp.zeros((W,) + s) for i, s in enumerate(shapes)}
  state = jax.vmap(tx.init)(params)
  update = jax.jit(jax.vmap(tx.update, axis_name='worker'))
  outs = []
  for t in range(steps):
    g = _grads(t, shapes)
    u, state = update(g, state, params)
    outs.append((g, u))
  return outs, state


def test_inner_axes_match_the_mesh():
  assert compression.comm.INNER_AXES == parallel.mesh.INNER_AXES


def test_identity_all_reduce_is_the_exact_mean():
  outs, _ = _run_transform(compression.compressed_all_reduce(
      compression.identity(), 'worker'))
  for g, u in outs:
    for k in g:
      np.testing.assert_allclose(
          u[k], np.broadcast_to(g[k].mean(0), g[k].shape), rtol=1e-6,
          atol=1e-7)


def test_every_worker_gets_the_same_lossy_mean():
  outs, _ = _run_transform(compression.compressed_all_reduce(
      compression.int8(block_size=32), 'worker'))
  for g, u in outs:
    for k in g:
      for m in range(1, W):
        np.testing.assert_array_equal(u[k][m], u[k][0])
      bound = float(jnp.abs(g[k]).max()) / 127 / 2
      assert np.abs(np.asarray(u[k][0] - g[k].mean(0))).max() <= bound * 1.01


def _one_mean(scheme, x, state):
  """``scheme.mean`` of the per-worker values ``x`` under vmap."""
  comm = compression.Comm('worker')
  key = jax.random.key(3)
  fn = jax.vmap(lambda v, s: scheme.mean(v, s, comm, key), axis_name='worker')
  return fn(x, state)


def test_error_feedback_invariant():
  ef = compression.error_feedback(compression.from_codec(
      compression.int8(block_size=16)))
  x = {'w': jnp.zeros((W, 64))}
  state = jax.vmap(ef.init)(x)
  for t in range(5):
    g = {'w': jax.random.normal(jax.random.key(t), (W, 64))}
    old = state.error['w']
    _, sent, state = _one_mean(ef, g, state)
    # old buffer + new input == transmitted + new buffer
    np.testing.assert_allclose(old + g['w'], sent['w'] + state.error['w'],
                               rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(state.error['w']).max()) > 0


def test_error_feedback_sends_what_round_to_nearest_drops():
  """With EF, the running sum of transmitted values tracks the running sum
  of inputs to within one buffer, while plain RTN drifts."""
  codec = compression.int8(block_size=64)
  ef = compression.error_feedback(compression.from_codec(codec))
  x = jnp.full((W, 64), 1e-3).at[:, 0].set(1.0)  # 1e-3 rounds to zero
  state = jax.vmap(ef.init)({'w': x})
  total_sent = 0.
  for _ in range(20):
    _, sent, state = _one_mean(ef, {'w': x}, state)
    total_sent = total_sent + sent['w']
  np.testing.assert_allclose(total_sent + state.error['w'], 20 * x,
                             rtol=1e-5)
  assert float(total_sent[0, 1]) > 0.5 * 20e-3  # the small entries got sent
  plain = compression.from_codec(codec)
  _, sent, _ = _one_mean(plain, {'w': x}, jax.vmap(plain.init)({'w': x}))
  assert float(sent['w'][0, 1]) == 0.0


def test_econtrol_with_eta_zero_is_ef21():
  base = compression.from_codec(compression.int8(block_size=8))
  a, b = compression.ef21(base), compression.econtrol(base, eta=0.0)
  x = {'w': jnp.zeros((W, 32))}
  sa, sb = jax.vmap(a.init)(x), jax.vmap(b.init)(x)
  for t in range(4):
    g = {'w': jax.random.normal(jax.random.key(t), (W, 32))}
    ma, _, sa = _one_mean(a, g, sa)
    mb, _, sb = _one_mean(b, g, sb)
    np.testing.assert_array_equal(ma['w'], mb['w'])
  with pytest.raises(ValueError, match='eta'):
    compression.econtrol(base, eta=2.0)


def test_ef21_estimate_converges_on_a_fixed_gradient():
  """EF21's shared estimate h approaches the true mean of a fixed gradient
  (it sends compressed *differences*, which shrink)."""
  ef21 = compression.ef21(compression.from_codec(
      compression.int8(block_size=8)))
  g = {'w': jax.random.normal(jax.random.key(0), (W, 32))}
  state = jax.vmap(ef21.init)(g)
  errs = []
  for _ in range(6):
    h, _, state = _one_mean(ef21, g, state)
    errs.append(float(jnp.abs(h['w'][0] - g['w'].mean(0)).max()))
  assert errs[-1] < 1e-3 * errs[0] + 1e-6


def test_partition_sends_small_leaves_exactly_and_keeps_no_buffer():
  scheme = compression.build_compressor(
      compression.int8(block_size=16), error_feedback='ef',
      eligible=compression.min_size(100))
  x = {'big': jnp.zeros((W, 12, 16)), 'bias': jnp.zeros((W, 12))}
  state = jax.vmap(scheme.init)(x)
  assert [e.shape for e in jax.tree.leaves(state.error)] == [(W, 12, 16)]
  g = {'big': jax.random.normal(jax.random.key(0), (W, 12, 16)),
       'bias': jax.random.normal(jax.random.key(1), (W, 12))}
  mean, _, _ = _one_mean(scheme, g, state)
  np.testing.assert_allclose(mean['bias'][0], g['bias'].mean(0), rtol=1e-6)
  assert scheme.payload_bytes({'big': x['big'][0], 'bias': x['bias'][0]}) \
      == compression.int8(16).payload_bytes(192) + 4 * 12


def test_start_step_uses_the_fp32_mean_first():
  tx = compression.compressed_all_reduce(
      compression.int8(block_size=16), 'worker', start_step=2,
      error_feedback='ef')
  outs, state = _run_transform(tx, steps=3)
  for t, (g, u) in enumerate(outs):
    err = float(jnp.abs(u['p0'][0] - g['p0'].mean(0)).max())
    assert (err < 1e-6) == (t < 2)
  assert int(state.count[0]) == 3


def test_unknown_names_name_the_field():
  with pytest.raises(ValueError, match='outer.codec'):
    compression.make_compressor('int3', field='outer.codec')
  with pytest.raises(ValueError, match='error feedback'):
    compression.with_feedback(compression.from_codec(compression.int8()),
                              'ef3')


def _mesh_step(tx, mesh, n=8192):
  """A compiled per-worker step applying ``tx`` on a mesh, and its inputs."""
  params = {'w': jnp.zeros((W, n // 64, 64)), 'b': jnp.zeros((W, 64))}
  sharding = jax.NamedSharding(mesh, jax.P('worker'))
  params = jax.device_put(params, sharding)
  state = jax.jit(jax.vmap(tx.init))(params)
  grads = jax.device_put(
      jax.tree.map(lambda p: jax.random.normal(jax.random.key(1), p.shape),
                   params), sharding)
  fn = jax.jit(parallel.shard_map_workers(
      lambda g, s, p: tx.update(g, s, p), mesh))
  return fn, (grads, state, params)


@pytest.mark.parametrize('scheme,ratio', [
    (compression.identity(), 1.0),
    (compression.int8(block_size=256), 0.28),
])
def test_compressed_all_reduce_bytes_on_a_mesh(scheme, ratio):
  mesh = parallel.make_worker_mesh(W, data=2)
  tx = compression.compressed_all_reduce(scheme, 'worker',
                                         error_feedback='ef')
  fn, args = _mesh_step(tx, mesh)
  report = parallel.collective_bytes(fn.lower(*args).compile(), mesh)
  expected = compression.as_compressor(scheme).payload_bytes(
      jax.tree.map(lambda x: x[0], args[2]))
  assert expected <= report.cross_worker_bytes_per_worker \
      <= 1.1 * expected
  assert report.cross_worker_bytes_per_worker <= ratio * 4 * (8192 + 64)
  got, _ = fn(*args)
  want, _ = jax.jit(jax.vmap(tx.update, axis_name='worker'))(*args)
  for k in got:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6)


def _diloco_run(codec=None, reduce_fn=None, steps=6):
  tx = loc_opt.diloco(optax.adam(1e-2), sync_every=2, codec=codec,
                      reduce_fn=reduce_fn)

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  p = {'w': jnp.ones((W, 50))}
  s = jax.vmap(tx.init)(p)
  run = jax.jit(jax.vmap(step, axis_name='worker'))
  for i in range(steps):
    g = {'w': jax.random.normal(jax.random.key(i), (W, 50))}
    p, s = run(p, s, g)
  return p, s


def test_diloco_identity_codec_equals_plain_diloco():
  plain, _ = _diloco_run()
  ident, _ = _diloco_run(codec=compression.identity())
  np.testing.assert_array_equal(plain['w'], ident['w'])
  lossy, state = _diloco_run(codec=compression.error_feedback(
      compression.from_codec(compression.int8(block_size=10))))
  np.testing.assert_allclose(lossy['w'], plain['w'], atol=5e-3)
  assert not np.array_equal(lossy['w'], plain['w'])
  # the error buffer persists across syncs and is per worker
  assert float(jnp.abs(state.codec_state.error['w']).max()) > 0
  assert int(state.num_syncs[0]) == 3
  with pytest.raises(ValueError, match='not both'):
    loc_opt.diloco(optax.sgd(1.), sync_every=2, codec=compression.int8(),
                   reduce_fn=lambda t: t)


def test_diloco_codec_bytes_on_a_mesh():
  mesh = parallel.make_worker_mesh(W, data=2)
  codec = compression.int8(block_size=256)
  tx = loc_opt.diloco(optax.sgd(0.1), sync_every=1, codec=codec)
  fn, args = _mesh_step(tx, mesh)
  report = parallel.collective_bytes(fn.lower(*args).compile(), mesh)
  params = jax.tree.map(lambda x: x[0], args[2])
  expected = loc_opt.outer.pseudo_gradient_bytes(params, codec=codec)
  lo, hi = report.cross_worker_bytes_range
  assert expected <= hi / W <= 1.1 * expected
  assert lo == 0  # the inner-only branch crosses no worker boundary
  assert expected < 0.26 * loc_opt.outer.pseudo_gradient_bytes(params)


@functools.cache
def _abstract(tx):
  return jax.eval_shape(tx.init, {'w': jnp.zeros((8, 8))})


def test_states_are_abstract_friendly():
  tx = compression.compressed_all_reduce(
      compression.int8(block_size=16), 'worker', error_feedback='econtrol')
  state = _abstract(tx)
  assert jax.tree.leaves(state)[0].dtype == jnp.int32
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state)[1:])


def test_two_phase_mean_matches_gather_within_two_roundings():
  codec = compression.int8(block_size=16)
  gather = compression.from_codec(codec)
  two = compression.from_codec(codec, reduce='two_phase', workers=W)
  x = {'w': jax.random.normal(jax.random.key(5), (W, 40, 24))}
  m1, _, _ = _one_mean(gather, x, ())
  m2, sent, _ = _one_mean(two, x, ())
  exact = x['w'].mean(0)
  step = float(jnp.abs(x['w']).max()) / 127
  for m in range(W):
    np.testing.assert_array_equal(m2['w'][m], m2['w'][0])
  assert float(jnp.abs(m1['w'][0] - exact).max()) <= step / 2 * 1.01
  assert float(jnp.abs(m2['w'][0] - exact).max()) <= step * 1.01
  assert float(jnp.abs(sent['w'] - x['w']).max()) <= step / 2 * 1.01
  with pytest.raises(ValueError, match='workers'):
    compression.from_codec(codec, reduce='two_phase')
  with pytest.raises(ValueError, match='built for 3'):
    _one_mean(compression.from_codec(codec, reduce='two_phase', workers=3),
              x, ())


def test_two_phase_sends_about_two_payloads_whatever_the_workers():
  mesh = parallel.make_worker_mesh(W, data=2)
  codec = compression.int8(block_size=256)
  scheme = compression.from_codec(codec, reduce='two_phase', workers=W)
  tx = compression.compressed_all_reduce(scheme, 'worker')
  fn, args = _mesh_step(tx, mesh, n=32768)
  report = parallel.collective_bytes(fn.lower(*args).compile(), mesh)
  expected = scheme.payload_bytes(jax.tree.map(lambda x: x[0], args[2]))
  sent = report.cross_worker_bytes_per_worker
  assert expected <= sent <= 1.1 * expected, (sent, expected)
  assert 'all-to-all' in report.by_kind(cross_worker=True)
  got, _ = fn(*args)
  want, _ = jax.jit(jax.vmap(tx.update, axis_name='worker'))(*args)
  for k in got:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_schemes_with_their_own_feedback_refuse_a_second_one():
  for scheme in (compression.powersgd(rank=2), compression.dgc(0.01),
                 compression.error_feedback(compression.from_codec(
                     compression.int8()))):
    assert scheme.feedback
    with pytest.raises(ValueError, match='own error feedback'):
      compression.build_compressor(scheme, error_feedback='ef')
  assert not compression.powersgd(rank=2, error_feedback=False).feedback
  compression.build_compressor(compression.powersgd(rank=2))


def test_packed_all_gather_is_one_collective_with_the_same_result():
  tree = {'idx': jnp.arange(12, dtype=jnp.uint16).reshape(3, 4),
          'val': jnp.linspace(-1.0, 1.0, 7, dtype=jnp.float32),
          'code': jnp.arange(5, dtype=jnp.uint8),
          'shift': jnp.float32(0.5)}

  def per_worker(t):
    comm = compression.Comm('worker')
    return comm.all_gather_packed(t), comm.all_gather(t)

  # Different values on every worker.
  stacked = jax.tree.map(
      lambda x: jnp.stack([x + i for i in range(W)]).astype(x.dtype), tree)
  packed, plain = jax.jit(parallel.vmap_workers(per_worker))(stacked)
  for a, b in zip(jax.tree.leaves(packed), jax.tree.leaves(plain)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  mesh = parallel.make_worker_mesh(4, data=2)
  compiled = jax.jit(parallel.shard_map_workers(
      lambda t: per_worker(t)[0], mesh)).lower(stacked).compile()
  report = parallel.collective_bytes(compiled, mesh)
  cross = [c for c in report.collectives if c.cross_worker]
  assert [c.kind for c in cross] == ['all-gather']
  payload = 24 + 28 + 5 + 4  # bytes of the tree
  assert payload <= report.cross_worker_bytes_per_worker <= payload + 8
