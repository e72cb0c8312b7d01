"""PowerSGD: exactness on low-rank inputs, error feedback, warm start, bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loc_opt import compression
from loc_opt.compression.powersgd import compressed_rank
from tests.compression._helpers import mean_runner
from tests.compression._helpers import normal as _normal
from tests.compression._helpers import sharded_mean
from tests.compression._helpers import W
from tests.compression._helpers import worker_slice


def _run(compressor, trees, steps=1, key=jax.random.key(3)):
  """Runs ``steps`` calls under vmap; returns (mean, sent, state) per step."""
  state = jax.vmap(compressor.init)(trees[0])
  fn = mean_runner(compressor)
  out = []
  for i in range(steps):
    mean, sent, state = fn(trees[i % len(trees)], state,
                           jax.random.fold_in(key, i))
    out.append((mean, sent, state))
  return out


def _low_rank(seed, n, m, r, workers=W):
  """Per-worker matrices U B_w sharing one rank-r column space."""
  u = _normal(seed, (n, r))
  b = _normal(seed + 1000, (workers, r, m))
  return jnp.einsum('nr,wrm->wnm', u, b)


@pytest.mark.parametrize('method', ['qr', 'gram_schmidt'])
def test_mean_of_rank_r_inputs_is_exact_after_one_step(method):
  x = _low_rank(0, 32, 24, 2)
  tree = {'w': x, 'b': jnp.arange(W * 24.0).reshape(W, 24)}
  comp = compression.powersgd(rank=2, orthogonalize=method)
  (mean, _, state), = _run(comp, [tree])
  want = x.mean(0)
  scale = float(jnp.abs(want).max())
  for w in range(W):
    np.testing.assert_allclose(mean['w'][w], want, atol=1e-5 * scale)
    np.testing.assert_array_equal(mean['w'][w], mean['w'][0])
  np.testing.assert_allclose(mean['b'][0], tree['b'].mean(0), rtol=1e-6)
  # The error left behind is the part of each worker's matrix outside the
  # shared rank-2 approximation: M_w - mean, not zero.
  error = state.error[1]
  np.testing.assert_allclose(error, x - want, atol=1e-4 * scale)
  assert state.error[0] == () and state.query[0] == ()  # the bias: no state


def test_rank_one_fit_of_rank_two_matrix_is_not_exact():
  x = _low_rank(1, 32, 24, 2, workers=1)
  tree = {'w': jnp.broadcast_to(x, (W, 32, 24))}
  (mean, _, _), = _run(compression.powersgd(rank=1), [tree])
  assert float(jnp.abs(mean['w'][0] - x[0]).max()) > 1e-2


def test_error_feedback_compensates_over_steps():
  # Identical inputs on all workers; with error feedback the sum of the
  # means tracks the sum of the inputs (up to the last error).
  g = _normal(2, (1, 20, 16))
  tree = {'w': jnp.broadcast_to(g, (W, 20, 16))}
  out = _run(compression.powersgd(rank=1), [tree], steps=6)
  total = sum(o[0]['w'][0] for o in out)
  last_error = out[-1][2].error[0][0]
  np.testing.assert_allclose(total + last_error, 6 * g[0], atol=1e-4)


def test_local_error_feedback_invariants():
  trees = [{'w': _normal(s, (W, 24, 18))} for s in (4, 40)]
  local = _run(compression.powersgd(rank=2, ef_mode='local'), trees, 2)
  glob = _run(compression.powersgd(rank=2, ef_mode='global'), trees, 2)
  (_, _, s1), (mean, sent, s2) = local
  orig = trees[1]['w'] + s1.error[0]  # this step's M_w = g + e_old
  np.testing.assert_allclose(orig, sent['w'] + s2.error[0], atol=1e-5)
  # The local approximations P Q_w^T average to the shared P Q^T ...
  np.testing.assert_allclose(sent['w'].mean(0), mean['w'][0], atol=1e-5)
  # ... and each worker's error is orthogonal to the shared column space.
  proj = jnp.einsum('nm,wnk->wmk', mean['w'][0], s2.error[0])
  assert float(jnp.abs(proj).max()) < 1e-4 * float(
      jnp.abs(mean['w']).max() * jnp.abs(s2.error[0]).max() * 24)
  # Local and global errors differ per worker but not on average (step 1,
  # same inputs and queries).
  e_local, e_global = local[0][2].error[0], glob[0][2].error[0]
  assert float(jnp.abs(e_local - e_global).max()) > 1e-2
  np.testing.assert_allclose(e_local.mean(0), e_global.mean(0), atol=1e-5)


def test_warm_start_converges_to_the_best_rank_r_approximation():
  u, _ = np.linalg.qr(_normal(5, (30, 6)))
  v, _ = np.linalg.qr(_normal(50, (20, 6)))
  s = jnp.array([3.0, 2.5, 1.0, 0.5, 0.3, 0.1])
  m = (u * s) @ v.T
  tree = {'w': jnp.broadcast_to(m, (W, 30, 20))}
  best = float(jnp.sqrt(jnp.sum(s[2:] ** 2)))

  def last_error(warm):
    comp = compression.powersgd(rank=2, warm_start=warm,
                                error_feedback=False)
    out = _run(comp, [tree], steps=25)
    for _, _, state in out:  # Q is identical on all workers
      for w in range(1, W):
        np.testing.assert_array_equal(state.query[0][w], state.query[0][0])
    return float(jnp.linalg.norm(out[-1][0]['w'][0] - m))

  assert last_error(True) < 1.001 * best
  assert last_error(False) > 1.05 * best


def test_payload_bytes():
  comp = compression.powersgd(rank=4)
  big = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
  assert comp.payload_bytes([big]) == 131_072
  assert 4 * 4096 * 4096 // comp.payload_bytes([big]) == 512
  tree = {'bias': jax.ShapeDtypeStruct((4096,), jnp.float32),
          'small': jax.ShapeDtypeStruct((10, 10), jnp.float32),
          'conv': jax.ShapeDtypeStruct((64, 3, 3, 32), jnp.float32)}
  # conv -> [64, 288] at rank 4; 10x10 at rank 4 is not worth it (100 <=
  # 2 * 4 * 20); vectors are never compressed.
  assert comp.payload_bytes(tree) == 4 * 4096 + 4 * 100 + 4 * 4 * (64 + 288)
  state = comp.init(tree)
  assert [getattr(q, 'shape', q) for q in state.query] == [(), (288, 4), ()]
  assert compressed_rank((3, 100), 8, 2.0) == 0
  assert compressed_rank((10, 100), 8, 2.0) == 0
  assert compressed_rank((30, 100), 8, 2.0) == 8


def test_rejects_bad_arguments():
  with pytest.raises(ValueError, match='ef_mode'):
    compression.powersgd(ef_mode='both')
  with pytest.raises(ValueError, match='orthogonalize'):
    compression.powersgd(orthogonalize='svd')
  with pytest.raises(ValueError, match='rank'):
    compression.powersgd(rank=0)


def test_shard_map_moves_the_low_rank_factors_only():
  comp = compression.powersgd(rank=4)
  tree = {'w': _normal(6, (W, 256, 128)),
          'b': _normal(7, (W, 128))}
  out, want, report = sharded_mean(comp, tree)
  theory = comp.payload_bytes(worker_slice(tree))
  assert theory == 4 * 4 * (256 + 128) + 4 * 128
  got = report.cross_worker_bytes_per_worker
  assert theory <= got <= 1.1 * theory, report.summary()
  assert got < 0.1 * 4 * (256 * 128 + 128)
  np.testing.assert_allclose(out['w'], want['w'], atol=1e-4)
  np.testing.assert_allclose(out['b'], want['b'], atol=1e-6)


def test_compressed_all_reduce_with_sgd_fits_least_squares():
  x = _normal(8, (W, 64, 16))
  true_w = _normal(80, (16, 12))
  y = x @ true_w + 0.01 * _normal(800, (W, 64, 12))
  params = {'w': jnp.zeros((16, 12)), 'b': jnp.zeros((12,))}

  def loss(p, xb, yb):
    return jnp.mean(jnp.sum((xb @ p['w'] + p['b'] - yb) ** 2, axis=-1))

  tx = optax.chain(
      compression.compressed_all_reduce(
          compression.powersgd(rank=2), 'worker'),
      optax.sgd(0.1))

  def step(p, s, xb, yb):
    g = jax.grad(loss)(p, xb, yb)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  ps = jax.tree.map(lambda a: jnp.broadcast_to(a, (W,) + a.shape), params)
  states = jax.vmap(tx.init)(ps)
  step = jax.jit(jax.vmap(step, axis_name='worker'))
  first = float(jax.vmap(loss)(ps, x, y).mean())
  for _ in range(40):
    ps, states = step(ps, states, x, y)
  last = float(jax.vmap(loss)(ps, x, y).mean())
  np.testing.assert_array_equal(ps['w'][1], ps['w'][0])  # in sync
  assert last < 0.01 * first, (first, last)
