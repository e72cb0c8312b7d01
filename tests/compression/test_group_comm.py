"""Collectives inside worker groups (compression.GroupComm): gathers in the
members' order, bit-identical means on every member, any compressor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loc_opt import compression
from loc_opt import parallel


def _per_worker(fn, stacked):
  return jax.jit(parallel.vmap_workers(fn))(stacked)


def _values(m, shape=(5, 7), seed=0):
  # Spread magnitudes, so that the order of a sum changes its rounding.
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(m,) + shape)
          * 10.0 ** rng.integers(-4, 4, size=(m,) + shape)).astype(np.float32)


def test_all_gather_is_in_member_order():
  m, g = 6, 3
  x = np.arange(m, dtype=np.float32)[:, None] * np.ones((m, 2), np.float32)
  out = np.asarray(_per_worker(
      lambda v: compression.GroupComm('worker', group_size=g).all_gather(v),
      x))
  for w in range(m):
    first = w // g * g
    np.testing.assert_array_equal(out[w], x[first:first + g])


def test_group_mean_is_the_same_bits_on_every_member():
  m, g = 6, 3
  x = _values(m)
  out = np.asarray(_per_worker(
      lambda v: compression.GroupComm('worker', group_size=g).pmean(v), x))
  for w in range(m):
    first = w // g * g
    np.testing.assert_array_equal(out[w], out[first])
    np.testing.assert_allclose(out[w], x[first:first + g].mean(0),
                               rtol=1e-6, atol=1e-10)
  # The two groups stay apart.
  assert np.abs(out[0] - out[3]).max() > 0


def test_psum_pmax_and_size():
  m, g = 4, 2
  x = _values(m, (3,))

  def fn(v):
    comm = compression.GroupComm('worker', group_size=g)
    return comm.psum(v), comm.pmax(v), comm.size() + 0 * comm.index()

  total, top, size = map(np.asarray, _per_worker(fn, x))
  for w in range(m):
    first = w // g * g
    np.testing.assert_allclose(total[w], x[first:first + g].sum(0),
                               rtol=1e-6)
    np.testing.assert_array_equal(top[w], x[first:first + g].max(0))
  assert (size == g).all()


@pytest.mark.parametrize('scheme', ['int8', 'int8_sr',
                                    ('randomk', {'density': 0.25}),
                                    ('statistical', {'bits': 2})])
def test_compressors_average_inside_groups(scheme):
  # Any compressor runs on a GroupComm; the members agree bit for bit, also
  # with per-worker ('int8_sr') and shared ('randomk') randomness.
  m, g = 6, 3
  x = {'w': jnp.asarray(_values(m, (8, 64))), 'b': jnp.asarray(
      _values(m, (64,), seed=1))}
  compressor = compression.as_compressor(scheme)

  def fn(tree):
    comm = compression.GroupComm('worker', group_size=g)
    mean, _, _ = compressor.mean(tree, compressor.init(tree), comm,
                                 jax.random.key(3))
    return mean

  out = jax.tree.map(np.asarray, _per_worker(fn, x))
  for name, got in out.items():
    for w in range(m):
      np.testing.assert_array_equal(got[w], got[w // g * g], err_msg=name)
    assert np.abs(got[0] - got[3]).max() > 0, name


def test_identity_codec_equals_the_plain_group_mean():
  m, g = 6, 3
  x = jnp.asarray(_values(m, (4, 9)))
  compressor = compression.as_compressor('none')

  def fn(v):
    comm = compression.GroupComm('worker', group_size=g)
    return (compressor.mean(v, (), comm, jax.random.key(0))[0],
            comm.pmean(v))

  coded, plain = _per_worker(fn, x)
  # The payload path (gather, decode, sum) and the plain mean are other
  # operations: equal to float32 rounding.
  np.testing.assert_allclose(np.asarray(coded), np.asarray(plain),
                             rtol=1e-6, atol=1e-7)


def test_refusals():
  x = jnp.zeros((4, 8))
  two_phase = compression.make_compressor('int8', reduce='two_phase',
                                          workers=2)

  def fn(v):
    comm = compression.GroupComm('worker', group_size=2)
    return two_phase.mean(v, (), comm, jax.random.key(0))[0]

  with pytest.raises(NotImplementedError, match='two_phase'):
    _per_worker(fn, x)
  with pytest.raises(ValueError, match='does not divide'):
    _per_worker(
        lambda v: compression.GroupComm('worker', group_size=3).pmean(v), x)
