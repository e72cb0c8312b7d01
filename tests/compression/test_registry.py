"""The registry: every scheme by name runs and moves what it claims.

For each codec and compressor of the registry, a data-parallel step with
``compressed_all_reduce`` is compiled on a 4-worker x 2-device mesh, and the
cross-worker bytes read from the compiled HLO are compared with the scheme's
theoretical payload (``payload_bytes``) and with fp32. Unknown names are
refused with the config field that gave them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loc_opt import compression
from loc_opt import parallel

W = 4
# A weight matrix, its bias and a norm scale: 33,024 parameters.
SHAPES = {'w': (128, 256), 'b': (256,), 'scale': (128,)}
N = sum(int(np.prod(s)) for s in SHAPES.values())

# name -> (factory kwargs, most bytes per worker as a fraction of fp32)
SCHEMES = {
    'none': ({}, 1.0),
    'int8': ({}, 0.26),
    'int8_sr': ({}, 0.26),
    'int4': ({}, 0.14),
    'int4_sr': ({}, 0.14),
    'fp8_e4m3': ({}, 0.26),
    'fp8_e4m3_sr': ({}, 0.26),
    'fp8_e5m2': ({}, 0.26),
    'fp8_e5m2_sr': ({}, 0.26),
    'fp4_e2m1': ({}, 0.14),
    'fp4_e2m1_sr': ({}, 0.14),
    'fp4_e3m0': ({}, 0.14),
    'fp4_e3m0_sr': ({}, 0.14),
    'two_bit': ({}, 0.09),
    'topk': ({'density': 0.01}, 0.03),
    'topk_chunked': ({'density': 0.01, 'chunk': 256}, 0.02),
    'randomk': ({'density': 0.01}, 0.02),
    'terngrad': ({}, 0.07),
    'powersgd': ({'rank': 2}, 0.04),
    'dgc': ({'density': 0.01}, 0.035),  # 1-D leaves go in fp32
    'statistical': ({}, 0.09),  # 2 bits + a 4-entry table per row
    'row_linear': ({}, 0.075),
}


def test_unknown_names_name_the_field():
  with pytest.raises(ValueError, match='outer.codec'):
    compression.make_compressor('int3', field='outer.codec')
  with pytest.raises(ValueError, match='error feedback'):
    compression.with_feedback(compression.from_codec(compression.int8()),
                              'ef3')


def test_every_registered_name_is_covered():
  assert set(SCHEMES) == set(compression.CODECS) | set(compression.COMPRESSORS)


def _params():
  return {k: jnp.zeros(s) for k, s in SHAPES.items()}


def _per_worker_grads():
  keys = jax.random.split(jax.random.key(0), len(SHAPES))
  return {k: jax.random.normal(key, (W,) + s)
          for key, (k, s) in zip(keys, SHAPES.items())}


@pytest.fixture(scope='module')
def mesh():
  return parallel.make_worker_mesh(W, data=2)


@pytest.mark.parametrize('name', sorted(SCHEMES))
def test_scheme_moves_its_payload_across_workers(name, mesh):
  kwargs, ratio = SCHEMES[name]
  scheme = compression.make_compressor(name, **kwargs)
  tx = compression.compressed_all_reduce(scheme, 'worker')
  params = jax.tree.map(lambda x: jnp.broadcast_to(x, (W,) + x.shape),
                        _params())
  sharding = jax.NamedSharding(mesh, jax.P('worker'))
  params = jax.device_put(params, sharding)
  grads = jax.device_put(_per_worker_grads(), sharding)
  state = jax.jit(jax.vmap(tx.init))(params)
  step = jax.jit(parallel.shard_map_workers(tx.update, mesh))
  report = parallel.collective_bytes(
      step.lower(grads, state, params).compile(), mesh)
  theory = scheme.payload_bytes(_params())
  sent = report.cross_worker_bytes_per_worker
  assert sent <= 1.1 * theory, (name, sent, theory)
  assert sent >= 0.9 * theory, (name, sent, theory)
  assert sent <= ratio * 4 * N, (name, sent / (4 * N))

  mean, _ = step(grads, state, params)
  sim, _ = jax.jit(jax.vmap(tx.update, axis_name='worker'))(
      grads, state, params)
  for k in SHAPES:
    got = np.asarray(mean[k])
    assert np.all(np.isfinite(got)), name
    for m in range(1, W):  # every worker got the same mean
      np.testing.assert_array_equal(got[m], got[0])
    np.testing.assert_allclose(got, np.asarray(sim[k]), rtol=1e-4,
                               atol=1e-5)


def test_two_bit_top_k_moves_under_a_hundredth_of_fp32(mesh):
  """The issue's headline: 2-bit values of a 1% top-k with compact indices
  cost under 1/100 of the fp32 bytes, measured on the wire."""
  scheme = compression.make_compressor(
      'topk', density=0.01, chunk=4096, index_dtype='uint12',
      value_codec='two_bit')
  tx = compression.compressed_all_reduce(scheme, 'worker',
                                         error_feedback='ef')
  shapes = {'w': (512, 512)}
  params = {'w': jnp.zeros((W, 512, 512))}
  sharding = jax.NamedSharding(mesh, jax.P('worker'))
  params = jax.device_put(params, sharding)
  grads = jax.device_put(
      {'w': jax.random.normal(jax.random.key(1), (W, 512, 512))}, sharding)
  state = jax.jit(jax.vmap(tx.init))(params)
  step = jax.jit(parallel.shard_map_workers(tx.update, mesh))
  report = parallel.collective_bytes(
      step.lower(grads, state, params).compile(), mesh)
  n = 512 * 512
  theory = scheme.payload_bytes({'w': jax.ShapeDtypeStruct(shapes['w'],
                                                           jnp.float32)})
  sent = report.cross_worker_bytes_per_worker
  assert sent <= 1.1 * theory
  assert sent < 4 * n / 100, sent / (4 * n)


@pytest.mark.parametrize('name,kwargs', [('int8', {}),
                                         ('powersgd', {'rank': 2})])
def test_start_step_and_diloco_run_under_shard_map(name, kwargs, mesh):
  """A warm-up of fp32 steps (a `lax.cond` between a plain and a compressed
  mean) and DiLoCo's sync `lax.cond` both trace under shard_map, where the
  branches' worker-varying types must agree."""
  import loc_opt  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  scheme = compression.make_compressor(name, **kwargs)
  sharding = jax.NamedSharding(mesh, jax.P('worker'))
  params = jax.device_put(jax.tree.map(
      lambda x: jnp.broadcast_to(x, (W,) + x.shape), _params()), sharding)
  grads = jax.device_put(_per_worker_grads(), sharding)
  for tx in (compression.compressed_all_reduce(scheme, 'worker',
                                               start_step=1),
             loc_opt.diloco(optax.sgd(0.1), sync_every=2, codec=scheme)):
    state = jax.jit(jax.vmap(tx.init))(params)
    step = jax.jit(parallel.shard_map_workers(tx.update, mesh))
    sim = jax.jit(jax.vmap(tx.update, axis_name='worker'))
    s1, s2 = state, state
    for _ in range(3):
      u1, s1 = step(grads, s1, params)
      u2, s2 = sim(grads, s2, params)
      for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------- codecs by name ---
def test_as_compressor_takes_names_and_name_kwargs_pairs():
  assert compression.as_compressor('int8').name == 'int8'
  assert compression.as_compressor(
      ('int8', {'rounding': 'stochastic'})).name == 'int8_sr'
  assert compression.as_compressor('powersgd').name.startswith('powersgd')
  assert compression.as_compressor(None).name == 'none'
  tree = {'w': jax.ShapeDtypeStruct((1024,), jnp.float32)}
  assert (compression.as_compressor(('int8', {'block_size': 64}))
          .payload_bytes(tree) == 1024 + 4 * 16)


def test_as_compressor_refuses_unknown_names_listing_the_known_ones():
  with pytest.raises(ValueError, match=r"unknown codec 'int3'.*'int8'"):
    compression.as_compressor('int3')
  with pytest.raises(ValueError, match='my_field'):
    compression.as_compressor(('int3', {}), field='my_field')
  with pytest.raises(TypeError, match='kwargs'):
    compression.as_compressor(('int8', 64))
  with pytest.raises(TypeError, match='codec name'):
    compression.as_compressor(3)


def _named_vs_object_runs(make_tx, name, kwargs, obj, steps=4):
  """Trains 4 workers with ``make_tx(codec)`` under vmap, once with the
  codec given by name and once as an object; returns both param trees."""
  import optax  # pylint: disable=g-import-not-at-top
  out, jaxprs = [], []
  for codec in ((name, kwargs) if kwargs else name, obj):
    tx = make_tx(codec)
    params = jax.tree.map(lambda x: jnp.broadcast_to(x, (W,) + x.shape),
                          {'w': jnp.ones((16, 8)), 'b': jnp.zeros((8,))})
    state = jax.vmap(tx.init)(params)

    def step(p, s, g, tx=tx):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    fn = jax.jit(jax.vmap(step, axis_name='worker'))
    jaxprs.append(str(jax.make_jaxpr(jax.vmap(step, axis_name='worker'))(
        params, state, jax.tree.map(jnp.zeros_like, params))))
    for i in range(steps):
      grads = {'w': _normal_stack(i, (16, 8)), 'b': _normal_stack(i, (8,))}
      params, state = fn(params, state, grads)
    out.append(params)
  # The name builds the same codec: the same step jaxpr, so the runs are
  # bit-identical.
  assert jaxprs[0] == jaxprs[1]
  return out


def _normal_stack(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(
      (W,) + shape), jnp.float32)


@pytest.mark.parametrize('method', ['diloco', 'streaming_diloco',
                                    'eager_diloco', 'compressed_all_reduce'])
def test_every_function_that_takes_a_codec_takes_its_name(method):
  import loc_opt  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  makers = {
      'diloco': lambda c: loc_opt.diloco(optax.sgd(0.1), sync_every=2,
                                         codec=c),
      'streaming_diloco': lambda c: loc_opt.streaming_diloco(
          optax.sgd(0.1), sync_every=4, fragments={'w': 1, 'b': 0},
          codec=c),
      'eager_diloco': lambda c: loc_opt.eager_diloco(
          optax.sgd(0.1), sync_every=2, codec=c),
      'compressed_all_reduce': lambda c: optax.chain(
          compression.compressed_all_reduce(c, 'worker'), optax.sgd(0.1)),
  }
  named, obj = _named_vs_object_runs(
      makers[method], 'int8', {'block_size': 64},
      compression.int8_codec(64))
  for a, b in zip(jax.tree.leaves(named), jax.tree.leaves(obj)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match='unknown codec'):
    makers[method]('int3')
