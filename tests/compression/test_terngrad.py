"""TernGrad: packing, unbiasedness, clipping, shared scale, bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loc_opt import compression
from loc_opt.compression.terngrad import pack_ternary
from loc_opt.compression.terngrad import unpack_ternary
from tests.compression._helpers import normal as _normal
from tests.compression._helpers import sharded_mean
from tests.compression._helpers import W
from tests.compression._helpers import worker_slice


def _mean_fn(comp):
  comm = compression.Comm('worker')
  return jax.vmap(lambda t, k: comp.mean(t, comp.init(t), comm, k)[:2],
                  in_axes=(0, None), axis_name='worker')


def test_pack_round_trip_and_size():
  codes = jnp.array([-1, 0, 1, 1, -1, -1, 0, 0, 1, 0, 0, -1], jnp.int8)
  packed = pack_ternary(codes)
  assert packed.dtype == jnp.uint8 and packed.shape == (3,)
  np.testing.assert_array_equal(unpack_ternary(packed), codes)
  big = np.random.default_rng(0).integers(-1, 2, 1_000_000).astype(np.int8)
  packed = pack_ternary(big)
  assert packed.size * packed.dtype.itemsize == 250_000
  np.testing.assert_array_equal(unpack_ternary(packed), big)
  comp = compression.terngrad()
  leaf = jax.ShapeDtypeStruct((1000, 1000), jnp.float32)
  assert comp.payload_bytes([leaf]) == 250_000 + 4


def test_unbiased_without_clipping():
  x = _normal(1, (W, 10, 7))
  keys = jax.random.split(jax.random.key(2), 3000)
  fn = jax.jit(jax.vmap(_mean_fn(compression.terngrad()), in_axes=(None, 0)))
  means, sent = fn({'w': x}, keys)
  means = np.asarray(means['w'], np.float64)
  sent = np.asarray(sent['w'], np.float64)
  for w in range(1, W):  # the same mean on every worker
    np.testing.assert_array_equal(means[:, w], means[:, 0])
  scale = float(jnp.abs(x).max())  # c = 0: s = max over workers of max|g|
  # Every worker sends values on the shared grid {-s, 0, s}.
  assert set(np.unique(np.round(sent / scale, 5))) <= {-1.0, 0.0, 1.0}
  # Draws are independent across workers (same input, different codes).
  same = fn({'w': jnp.broadcast_to(x[0], x.shape)}, keys)[1]['w']
  assert float(jnp.abs(same[:, 0] - same[:, 1]).max()) > 0
  # Unbiased: the mean over draws is within 4 standard errors everywhere.
  avg, want = means[:, 0].mean(0), np.asarray(x.mean(0))
  stderr = means[:, 0].std(0) / np.sqrt(len(keys))
  assert np.all(np.abs(avg - want) <= 4 * stderr + 1e-6), \
      np.max(np.abs(avg - want) / stderr)
  # Each worker's own ternary values are unbiased too.
  own_err = np.abs(sent.mean(0) - np.asarray(x))
  assert np.all(own_err <= 4 * sent.std(0) / np.sqrt(len(keys)) + 1e-6)


def test_std_scaler_clips_large_entries():
  x = jnp.concatenate([jnp.full((W, 1), 50.0),
                       _normal(3, (W, 99))], 1)
  comp = compression.terngrad(scaler_c=2.5)
  means, sent = jax.jit(_mean_fn(comp))([x], jax.random.key(4))
  scale = float(jnp.max(2.5 * jnp.std(x, axis=1)))  # pmax of c * std
  assert scale < 50.0
  np.testing.assert_allclose(sent[0][:, 0], scale, rtol=1e-6)  # clipped
  np.testing.assert_allclose(means[0][0, 0], scale, rtol=1e-6)
  assert set(np.unique(np.round(np.asarray(sent[0]) / scale, 5))) <= {
      -1.0, 0.0, 1.0}


def test_small_leaves_are_averaged_in_fp32():
  comp = compression.terngrad(min_size=16)
  tree = {'b': _normal(5, (W, 8)),
          'w': _normal(6, (W, 16))}
  means, _ = jax.jit(_mean_fn(comp))(tree, jax.random.key(7))
  np.testing.assert_allclose(means['b'][0], tree['b'].mean(0), rtol=1e-6)
  assert float(jnp.abs(means['w'][0] - tree['w'].mean(0)).max()) > 1e-3
  shapes = jax.tree.map(lambda a: a[0], tree)
  assert comp.payload_bytes(shapes) == 4 * 8 + 4 + 4


def test_rejects_negative_scaler():
  with pytest.raises(ValueError, match='scaler_c'):
    compression.terngrad(scaler_c=-1.0)


def test_shard_map_moves_packed_codes():
  comp = compression.terngrad()
  tree = {'w': _normal(8, (W, 256, 128)),
          'b': _normal(9, (W, 128))}
  out, want, report = sharded_mean(comp, tree)
  theory = comp.payload_bytes(worker_slice(tree))
  assert theory == (256 * 128 + 128) // 4 + 2 * 4
  got = report.cross_worker_bytes_per_worker
  assert got <= 1.1 * theory, report.summary()
  assert got < 0.07 * 4 * (256 * 128 + 128)
  assert 'u8' in {c.shape.split('[')[0] for c in report.collectives
                  if c.cross_worker}
  np.testing.assert_allclose(out['w'], want['w'], atol=1e-6)
  np.testing.assert_allclose(out['b'], want['b'], atol=1e-6)
