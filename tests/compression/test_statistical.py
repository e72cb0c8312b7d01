"""Row-wise statistical and linear quantizers (MuLoCo), error feedback with a
decay, name-based skip masks, and the bytes on the wire."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loc_opt import compression
from loc_opt.compression.statistical import decoded
from loc_opt.compression.statistical import linear_dequantize
from loc_opt.compression.statistical import linear_quantize
from loc_opt.compression.statistical import statistical_dequantize
from loc_opt.compression.statistical import statistical_quantize
from tests.compression import _helpers as helpers

W = helpers.W


def _rows(seed=0, shape=(16, 96)):
  x = np.random.default_rng(seed).standard_normal(shape)
  # rows of different scales and offsets, one with an outlier
  x = x * np.linspace(0.1, 3.0, shape[0])[:, None] + np.arange(shape[0])[
      :, None]
  x[3, 5] = 40.0
  return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize('bits,max_rel', [(2, 0.5), (4, 0.12), (8, 0.01)])
def test_round_trip_error_is_bounded_and_row_sums_are_kept(bits, max_rel):
  x = _rows()
  payload = statistical_quantize(x, bits)
  y = np.asarray(statistical_dequantize(payload))
  xn = np.asarray(x)
  centred = xn - xn.mean(1, keepdims=True)
  err = np.linalg.norm(y - xn, axis=1) / np.linalg.norm(centred, axis=1)
  rows_ok = np.arange(x.shape[0]) != 3  # the outlier's row
  assert np.all(err[rows_ok] < max_rel), (bits, err)
  # centroids keep every row's sum (and mean) exactly
  np.testing.assert_allclose(y.sum(1), xn.sum(1), rtol=1e-5, atol=1e-3)
  # interior bins: a value is within one bin width of its decoding
  n = 2 ** bits
  sigma = centred.std(1, ddof=1, keepdims=True)
  width = 2 * 3.0 * sigma / n
  codes = np.asarray(payload['codes'])
  interior = (codes > 0) & (codes < n - 1)
  assert np.all(np.abs(y - xn)[interior] <= (width + 1e-5)[
      np.nonzero(interior)[0], 0])


@pytest.mark.parametrize('bits', [2, 4, 8])
def test_each_bin_decodes_to_the_mean_of_its_members(bits):
  x = _rows(1, (6, 200))
  payload = statistical_quantize(x, bits, clip_sigmas=2.5)
  codes = np.asarray(payload['codes'])
  table = np.asarray(payload['table'])
  xn = np.asarray(x)
  shift = xn.mean(1)
  np.testing.assert_allclose(payload['shift'], shift, rtol=1e-6, atol=1e-6)
  sigma = (xn - shift[:, None]).std(1, ddof=1)
  want_codes = np.clip(np.round((xn - shift[:, None])
                                / (2 * 2.5 * sigma[:, None] / 2 ** bits)
                                + 2 ** bits / 2), 0, 2 ** bits - 1)
  assert np.mean(want_codes == codes) > 0.999  # ties may round apart
  for r in range(x.shape[0]):
    for j in range(2 ** bits):
      members = (xn[r] - shift[r])[codes[r] == j]
      want = members.mean() if members.size else 0.0
      np.testing.assert_allclose(table[r, j], want, rtol=1e-5, atol=1e-5)


def test_constant_rows_and_vectors_are_exact():
  x = {'c': jnp.full((3, 8), 2.5), 'v': jnp.arange(5.0), 's': jnp.ones(())}
  got = decoded(compression.statistical(2), x)
  np.testing.assert_allclose(got['c'], x['c'])
  assert got['v'].shape == (5,) and got['s'].shape == ()
  np.testing.assert_allclose(got['s'], 1.0)


def test_row_linear_hits_min_and_max_and_has_uniform_levels():
  x = _rows(2, (4, 64))
  payload = linear_quantize(x, 2)
  y = np.asarray(linear_dequantize(payload))
  np.testing.assert_allclose(y.min(1), np.asarray(x).min(1), rtol=1e-6)
  np.testing.assert_allclose(y.max(1), np.asarray(x).max(1), rtol=1e-5)
  step = (np.asarray(x).max(1) - np.asarray(x).min(1)) / 3
  assert np.all(np.abs(y - np.asarray(x)) <= step[:, None] / 2 + 1e-5)


def test_statistical_beats_linear_at_two_bits_on_heavy_tails():
  x = jnp.asarray(np.random.default_rng(3).standard_t(3, (32, 256)),
                  jnp.float32)
  s = decoded(compression.statistical(2), x)
  lin = decoded(compression.row_linear(2), x)
  assert (np.linalg.norm(s - x) < 0.7 * np.linalg.norm(lin - x))


def test_mean_is_the_mean_of_the_decoded_payloads_and_requantize_rounds():
  x = {'w': helpers.normal(0, (W, 12, 40)), 'b': helpers.normal(1, (W, 40))}
  for requantize in (False, True):
    c = compression.statistical(4, requantize=requantize)
    mean, sent, _ = helpers.one_mean(c, x, jax.vmap(c.init)(x))
    own = jax.vmap(lambda v: decoded(c, v))(x)
    for k in x:
      np.testing.assert_allclose(sent[k], own[k], rtol=1e-6, atol=1e-6)
      want = np.asarray(own[k]).mean(0)
      if requantize:
        want = decoded(c, {k: jnp.asarray(want)})[k]
      for m in range(W):
        np.testing.assert_allclose(mean[k][m], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('decay', [1.0, 0.9])
def test_error_feedback_recursion_with_decay(decay):
  c = compression.statistical(2)
  ef = compression.error_feedback(c, decay=decay)
  g = [{'w': helpers.normal(10 + t, (W, 8, 32))} for t in range(3)]
  state = jax.vmap(ef.init)(g[0])
  error = np.zeros((W, 8, 32), np.float32)
  for t in range(3):
    _, sent, state = helpers.one_mean(ef, g[t], state)
    p = np.asarray(g[t]['w']) + error
    want_sent = np.stack([np.asarray(decoded(c, jnp.asarray(p[m])))
                          for m in range(W)])
    np.testing.assert_allclose(sent['w'], want_sent, rtol=1e-5, atol=1e-5)
    error = decay * (p - want_sent)
    np.testing.assert_allclose(state.error['w'], error, rtol=1e-5,
                               atol=1e-5)
  assert ef.name == ('ef(statistical2)' if decay == 1.0
                     else 'ef0.9(statistical2)')


def test_decay_applies_to_classic_error_feedback_only():
  with pytest.raises(ValueError, match='decay'):
    compression.build_compressor('int8', error_feedback='ef21',
                                 ef_decay=0.9)
  with pytest.raises(ValueError, match='decay'):
    compression.error_feedback(compression.statistical(), decay=1.5)


def _lm_like(w=W):
  shapes = {'embed': {'embedding': (32, 16)},
            'layer_0': {'attn_norm': {'scale': (16,)},
                        'mlp': {'up': {'kernel': (16, 48)}}},
            'head': {'kernel': (16, 32)}}
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(
      s, tuple))
  return treedef.unflatten(
      [helpers.normal(i, (w,) + s) for i, s in enumerate(leaves)])


def test_skip_paths_send_norms_embeddings_and_head_in_fp32_without_ef():
  x = _lm_like()
  eligible = compression.skip_paths('norm', 'embed', 'head')
  c = compression.build_compressor(('statistical', {'bits': 2}),
                                   error_feedback='ef', ef_decay=0.9,
                                   eligible=eligible)
  state = jax.vmap(c.init)(x)
  assert len(jax.tree.leaves(state)) == 1  # one error buffer: the kernel
  mean, _, _ = helpers.one_mean(c, x, state)
  for path in (('embed', 'embedding'), ('layer_0', 'attn_norm', 'scale'),
               ('head', 'kernel')):
    got, want = mean, x
    for p in path:
      got, want = got[p], want[p]
    np.testing.assert_allclose(got[0], np.asarray(want).mean(0), rtol=1e-6,
                               atol=1e-6)
  kernel = mean['layer_0']['mlp']['up']['kernel']
  assert not np.allclose(
      kernel[0], np.asarray(x['layer_0']['mlp']['up']['kernel']).mean(0),
      atol=1e-3)
  one = helpers.worker_slice(x)
  plain = 4 * (32 * 16 + 16 + 16 * 32)
  assert c.payload_bytes(one) == plain + 16 * 12 + 4 * 16 * 5
  both = compression.all_of(eligible, compression.min_size(10_000))
  assert not both((), jnp.zeros((16, 48)))
  assert compression.all_of(None, None) is None


@pytest.mark.parametrize('name,kwargs', [
    ('statistical', {'bits': 2}), ('statistical', {'bits': 4}),
    ('statistical', {'bits': 8, 'requantize': True}),
    ('row_linear', {'bits': 2})])
def test_hlo_bytes_equal_payload_bytes_on_a_mesh(name, kwargs):
  x = _lm_like()
  c = compression.as_compressor((name, kwargs))
  got, want, report = helpers.sharded_mean(c, x)
  theory = c.payload_bytes(helpers.worker_slice(x))
  sent = report.cross_worker_bytes_per_worker
  assert theory <= sent <= theory + 16, (sent, theory)  # byte padding only
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
