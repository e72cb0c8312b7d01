"""Tests of hierarchical_diloco's group-level codec: equivalence with the
fp32 group mean through an exact codec, members of a group that agree bit
for bit through a lossy one, the error-feedback recursion against numpy,
and group-sync bytes read from the compiled HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import compression
from loc_opt import parallel
from loc_opt.outer import hierarchical
from tests.outer import _helpers as helpers


def _hier(h1, h2, g, **kwargs):
  return loc_opt.outer.hierarchical_diloco(
      optax.adam(1e-2), sync_every=h1, global_sync_every=h2, group_size=g,
      **kwargs)


def test_exact_codec_is_the_fp32_group_mean():
  # Two group syncs and a global one; the identity codec ('none') takes the
  # payload path (encode, shift, decode) and must give the same values.
  # Another program (other collectives around the same sums): compared to
  # float32 rounding, far below any lossy codec's error.
  want, want_state = helpers.run_workers(_hier(2, 6, 2), 7)
  got, state = helpers.run_workers(_hier(2, 6, 2, group_codec='none'), 7)
  for a, b in zip(jax.tree.leaves((got, state.group_anchor)),
                  jax.tree.leaves((want, want_state.group_anchor))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                               atol=1e-7)
  # A lossy codec (int8) is far off at this tolerance: the check bites.
  lossy, _ = helpers.run_workers(_hier(2, 6, 2, group_codec='int8'), 7)
  assert not all(np.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(
      jax.tree.leaves(lossy), jax.tree.leaves(want)))


@pytest.mark.parametrize('m, g', [(4, 2), (6, 3)])
def test_int8_is_close_and_members_agree_bit_for_bit(m, g):
  steps = 4  # two group syncs, no global one
  want, _ = helpers.run_workers(_hier(2, 8, g), steps, m=m)
  got, state = helpers.run_workers(_hier(2, 8, g, group_codec='int8'),
                                   steps, m=m)
  # Members decode the same payloads in the same order, in one program:
  # the same operations, bit for bit.
  for tree in (got, state.group_anchor):
    for x in jax.tree.leaves(tree):
      x = np.asarray(x)
      for w in range(m):
        np.testing.assert_array_equal(x[w], x[w // g * g])
      assert np.abs(x[0] - x[g]).max() > 1e-4  # groups still apart
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    err = np.abs(np.asarray(a) - np.asarray(b)).max()
    assert 0 < err < 2e-3, err


@pytest.mark.parametrize('scheme', ['int8_sr', 'fp4_e3m0',
                                    ('statistical', {'bits': 2})])
def test_other_codecs_keep_members_equal(scheme):
  _, state = helpers.run_workers(
      _hier(2, 8, 2, group_codec=scheme, group_error_feedback='ef'), 4)
  # Every member decodes the same payloads in the same order, in one
  # program: the same operations, bit for bit.
  for x in jax.tree.leaves(state.group_anchor):
    x = np.asarray(x)
    np.testing.assert_array_equal(x[0], x[1])
    np.testing.assert_array_equal(x[2], x[3])
  # Each worker keeps its own residual.
  err = np.asarray(state.group_codec_state.error['w'])
  assert np.abs(err[0] - err[1]).max() > 0


def _int8_roundtrip(x):
  """numpy int8 absmax in blocks of 256 (the 'int8' codec's numbers)."""
  blocks = x.astype(np.float32).reshape(-1, 256)
  scale = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
  safe = np.where(scale > 0, scale, np.float32(1))
  codes = np.round(np.clip(blocks / safe, -127, 127))
  return (codes * scale).reshape(x.shape).astype(np.float32)


@pytest.mark.parametrize('decay', [1.0, 0.5])
def test_error_feedback_recursion(decay):
  # e_{t+1} = decay (delta_t + e_t - Q(delta_t + e_t)), and the group mean
  # is the mean of Q(delta_t + e_t) over the group.
  m, g, shape = 4, 2, (2, 256)
  compressor = hierarchical.group_compressor('int8', 'ef', decay)
  rng = np.random.default_rng(0)

  @jax.jit
  @parallel.vmap_workers
  def step(delta, codec_state, index):
    return hierarchical.group_codec_mean(
        {'w': delta}, codec_state, compressor, compression.Comm('worker'),
        g, 0, index)

  codec_state = jax.vmap(compressor.init)({'w': jnp.zeros((m,) + shape)})
  error = np.zeros((m,) + shape, np.float32)
  for t in range(3):
    delta = rng.normal(size=(m,) + shape).astype(np.float32)
    mean, codec_state = step(delta, codec_state, jnp.full((m,), t))
    p = delta + error
    sent = np.stack([_int8_roundtrip(p[w]) for w in range(m)])
    error = np.float32(decay) * (p - sent)
    np.testing.assert_allclose(np.asarray(codec_state.error['w']), error,
                               rtol=1e-5, atol=1e-6)
    for w in range(m):
      first = w // g * g
      np.testing.assert_allclose(np.asarray(mean['w'][w]),
                                 sent[first:first + g].mean(0),
                                 rtol=1e-5, atol=1e-6)


# Leaf sizes that fill whole int8 blocks on each of a worker's 2 devices,
# so the payload has no padding.
CODEC_PARAMS = {'w': (32, 64), 'v': (16, 32)}


@pytest.mark.parametrize('g', [2, 4])
@pytest.mark.parametrize('scheme', ['int8', ('int8', {'block_size': None}),
                                    ('statistical', {'bits': 2})])
def test_group_sync_bytes_are_the_codec_payload(g, scheme):
  params = {k: jnp.ones(s) for k, s in CODEC_PARAMS.items()}
  tx = _hier(2, 4, g, group_codec=scheme)
  report = helpers.phase_report(tx, helpers.stack(params), 'group',
                                helpers.worker_mesh())
  payload = compression.as_compressor(scheme).payload_bytes(params)
  assert report.by_kind(cross_worker=True) == {
      'collective-permute': report.cross_worker_bytes}
  assert report.cross_worker_bytes_per_worker == (g - 1) * payload
  assert report.cross_group_bytes(g) == 0
  for c in report.collectives:  # permute pairs, each inside one group
    if c.cross_worker:
      assert all(len({w // g for w in pair}) == 1
                 for pair in c.worker_groups), c.worker_groups
  # 4x fewer bytes than the fp32 group mean (int8), 14x (2-bit).
  n = sum(int(np.prod(s)) for s in CODEC_PARAMS.values())
  assert payload < 4 * n / 3.9


def test_bad_group_codec_arguments():
  with pytest.raises(ValueError, match='needs a group_codec'):
    _hier(2, 4, 2, group_error_feedback='ef')
  with pytest.raises(ValueError, match='group_codec'):
    _hier(2, 4, 2, group_codec='int9')
  with pytest.raises(ValueError, match='decay'):
    _hier(2, 4, 2, group_codec='int8', group_error_feedback='ef',
          group_ef_decay=1.5)
  with pytest.raises(ValueError, match='axis_name'):
    _hier(2, 4, 1, group_codec='int8', axis_name=None)
