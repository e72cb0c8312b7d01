"""worker_mean: the mean over workers, each element sent once per worker."""

import jax
import numpy as np
import pytest

from loc_opt import parallel


@pytest.mark.parametrize('data,fsdp', [(2, 1), (1, 2), (1, 1)])
def test_worker_mean_equals_pmean_and_sends_one_copy_per_worker(data, fsdp):
  workers = 8 // (data * fsdp)
  mesh = parallel.make_worker_mesh(workers, data=data, fsdp=fsdp)
  tree = {'a': np.random.default_rng(0).normal(size=(workers, 37, 5)),
          'b': np.arange(workers * 3.0).reshape(workers, 3),
          's': np.ones((workers,))}
  tree = jax.tree.map(lambda x: jax.device_put(
      x.astype(np.float32), jax.NamedSharding(mesh, jax.P('worker'))), tree)
  fast = jax.jit(parallel.shard_map_workers(parallel.worker_mean(), mesh))
  plain = jax.jit(parallel.shard_map_workers(
      lambda t: jax.lax.pmean(t, 'worker'), mesh))
  for got, want in zip(jax.tree.leaves(fast(tree)),
                       jax.tree.leaves(plain(tree))):
    np.testing.assert_allclose(got, want, rtol=1e-6)
  report = parallel.collective_bytes(fast.lower(tree).compile(), mesh)
  inside = data * fsdp
  # The leaves go as one fp32 buffer padded to a multiple of the worker's
  # devices: 4 bytes per element, once per worker.
  padded = -(-(37 * 5 + 3 + 1) // inside) * inside
  assert report.cross_worker_bytes_per_worker == 4 * padded
  plain_report = parallel.collective_bytes(plain.lower(tree).compile(), mesh)
  assert plain_report.cross_worker_bytes_per_worker == \
      4 * (37 * 5 + 3 + 1) * inside


def test_worker_mean_without_mesh_is_pmean():
  x = np.arange(12.0, dtype=np.float32).reshape(4, 3)
  got = jax.vmap(parallel.worker_mean(), axis_name='worker')(x)
  np.testing.assert_allclose(got, np.broadcast_to(x.mean(0), (4, 3)))


def test_worker_mean_of_a_tree_is_one_reduction_and_one_gather():
  # DiLoCo's outer step: the mean of many leaves, then an elementwise update
  # of replicated state. Left to itself, XLA's partitioner carried the
  # spread of the averaged buffer into the update (each leaf updated in
  # halves, then gathered back: hundreds of small collectives in the LM's
  # sync step); worker_mean keeps its buffer's split to itself.
  workers, data = 4, 2
  mesh = parallel.make_worker_mesh(workers, data=data)
  rng = np.random.default_rng(0)
  shapes = [(32, 16), (16,), (16, 48), (48, 16), (7,)] * 3
  tree = [jax.device_put(rng.normal(size=(workers, *s)).astype(np.float32),
                         jax.NamedSharding(mesh, jax.P('worker')))
          for s in shapes]
  mean = parallel.worker_mean()

  def outer_step(anchor):
    delta = jax.tree.map(lambda a: a * 0.5, anchor)
    return jax.tree.map(lambda a, m: a - 0.7 * m, anchor, mean(delta))

  step = jax.jit(parallel.shard_map_workers(outer_step, mesh))
  report = parallel.collective_bytes(step.lower(tree).compile(), mesh)
  kinds = [(c.kind, c.cross_worker) for c in report.collectives]
  assert sorted(kinds) == [('all-gather', False), ('all-reduce', True)], kinds
  for got, anchor in zip(step(tree), tree):
    anchor = np.asarray(anchor)
    want = anchor - 0.7 * 0.5 * anchor.mean(0, keepdims=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('fsdp,tensor', [(2, 1), (2, 2)])
def test_large_leaves_are_averaged_in_their_own_sharding(fsdp, tensor):
  """Under FSDP (and tensor parallelism) a leaf of at least bucket_size
  elements is averaged in place: each device all-reduces its own block
  across workers, no all-gather inside the worker, and no device holds the
  leaf whole; the small leaves share one flat bucket. Same values as a
  pmean (issue 46)."""
  inside = fsdp * tensor
  workers = 8 // inside
  mesh = parallel.make_worker_mesh(workers, fsdp=fsdp, tensor=tensor)
  rng = np.random.default_rng(0)
  tree = {'w': rng.normal(size=(workers, 64, 32)),
          'v': rng.normal(size=(workers, 32, 64)),
          'b': rng.normal(size=(workers, 30)), 's': np.ones((workers,))}
  split = {'w': jax.P('worker', 'fsdp', 'tensor' if tensor > 1 else None),
           'v': jax.P('worker', 'tensor' if tensor > 1 else None, 'fsdp'),
           'b': jax.P('worker'), 's': jax.P('worker')}
  tree = jax.tree.map(lambda x, p: jax.device_put(
      x.astype(np.float32), jax.NamedSharding(mesh, p)), tree, split)
  mean = parallel.worker_mean(bucket_size=1024)
  fast = jax.jit(parallel.shard_map_workers(mean, mesh))
  plain = jax.jit(parallel.shard_map_workers(
      lambda t: jax.lax.pmean(t, 'worker'), mesh))
  for got, want in zip(jax.tree.leaves(fast(tree)),
                       jax.tree.leaves(plain(tree))):
    np.testing.assert_array_equal(got, want)
  compiled = fast.lower(tree).compile()
  report = parallel.collective_bytes(compiled, mesh)
  # w and v: their blocks, once; b and s: one bucket of 31, padded.
  padded = -(-31 // inside) * inside
  assert report.cross_worker_bytes_per_worker == 4 * (2 * 64 * 32 + padded)
  # No within-worker collective moves a block of w or v (only the small
  # bucket's gather back), and no device holds w, v or their flat copy.
  block = 4 * 64 * 32 // inside
  assert all(c.bytes_per_device < block
             for c in report.collectives if not c.cross_worker), \
      report.summary()
  text = compiled.as_text()
  for whole in ('f32[64,32]', 'f32[32,64]', 'f32[2048]'):
    assert whole not in text


def test_bucket_size_must_be_positive():
  with pytest.raises(ValueError, match='bucket_size'):
    parallel.worker_mean(bucket_size=0)(np.ones(3))
