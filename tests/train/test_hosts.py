"""Process-local batch blocks (``loc_opt.train.hosts``) on one process."""

import jax
import numpy as np
import pytest

from loc_opt import parallel
from loc_opt.data import pipeline
from loc_opt.train import hosts
from loc_opt.train import programs


def _data():
  rng = np.random.default_rng(0)
  docs = [rng.integers(1, 256, int(n), dtype=np.uint8)
          for n in rng.integers(100, 400, 30)]
  return pipeline.LMBatches(docs, num_workers=4, global_batch=16, seq_len=8,
                            seed=1)


@pytest.mark.parametrize('block', [
    (slice(0, 4), slice(0, 4), slice(0, 9)),
    (slice(1, 3), slice(1, 3), slice(0, 9)),
    (slice(3, 4), slice(0, 2), slice(2, 5)),
])
def test_per_worker_block_equals_the_batch_block(block):
  data = _data()
  got = hosts.lm_rows_block(lambda lo, hi: data.rows(5, lo, hi), 4, block)
  np.testing.assert_array_equal(got, data.batch(5)[block])


@pytest.mark.parametrize('block', [(slice(0, 16), slice(0, 9)),
                                   (slice(3, 13), slice(0, 9))])
def test_flat_block_equals_the_batch_block(block):
  data = _data()
  got = hosts.lm_rows_block(lambda lo, hi: data.rows(5, lo, hi), None, block)
  np.testing.assert_array_equal(got, data.batch(5).reshape(16, 9)[block])


@pytest.mark.parametrize('per_worker', [True, False])
def test_global_batch_on_one_process_is_the_whole_batch(per_worker):
  data = _data()
  mesh = parallel.make_worker_mesh(4, data=2)
  sharding = programs.batch_sharding(mesh, per_worker)
  shape = (4, 4, 9) if per_worker else (16, 9)
  assert hosts.process_block(sharding, shape) == tuple(
      slice(0, n) for n in shape)
  batch = hosts.global_batch(sharding, shape, lambda b: hosts.lm_rows_block(
      lambda lo, hi: data.rows(5, lo, hi), 4 if per_worker else None, b))
  assert batch.sharding == sharding
  np.testing.assert_array_equal(np.asarray(batch),
                                data.batch(5).reshape(shape))
  np.testing.assert_array_equal(hosts.fetch(batch), np.asarray(batch))
  assert hosts.is_writer() and jax.process_count() == 1
