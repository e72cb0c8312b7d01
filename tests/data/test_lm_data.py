"""Tests of make_lm_data: config to pipeline, eval batches and stats."""

import numpy as np
import pytest

from loc_opt import data as data_lib


def _config(source_dir, data_dir, **overrides):
  config = data_lib.get_config()
  config.source_dirs = (str(source_dir),)
  config.data_dir = str(data_dir)
  config.update(overrides)
  return config


def test_get_config_defaults():
  config = data_lib.get_config()
  assert config.dataset == 'local_text' and config.source_dirs == ()
  assert config.max_bytes is None and config.eval_batch_size is None
  assert not config.non_iid and config.separator == 0
  config.max_bytes = 10**6  # Placeholders take ints (CLI overrides).
  with pytest.raises(TypeError):
    config.max_bytes = 'big'


@pytest.mark.parametrize('non_iid', [False, True])
def test_local_text_end_to_end(source_tree, tmp_path, non_iid):
  root, files = source_tree
  config = _config(root, tmp_path, non_iid=non_iid)
  data = data_lib.make_lm_data(
    config, num_workers=2, global_batch=4, seq_len=16, seed=0
  )
  stats = data.stats
  assert stats.dataset.startswith('loc_opt_local_text/source')
  assert stats.train_documents + stats.eval_documents == len(files)
  assert stats.train_bytes + stats.eval_bytes == sum(map(len, files.values()))
  assert stats.eval_documents >= 1
  assert sum(stats.worker_bytes) == stats.train_bytes + stats.train_documents
  if non_iid:
    assert sum(stats.worker_documents) == stats.train_documents
  else:
    assert sum(stats.worker_documents) >= stats.train_documents
  assert data.train.batch(3).shape == (2, 2, 17)
  evals = data.eval_batches(3)
  assert evals.shape == (3, 4, 17) and evals.dtype == np.int32
  np.testing.assert_array_equal(evals, data.eval_batches(3))
  assert data.eval_batches(2, batch_size=8).shape == (2, 8, 17)
  # Eval text is validation text only: no eval window occurs in train.
  train_text = data.train.stream.tobytes()
  window = evals[0, 0].astype(np.uint8).tobytes()
  assert window not in train_text


def test_same_config_same_batches(source_tree, tmp_path):
  root, _ = source_tree
  config = _config(root, tmp_path)
  kwargs = {'num_workers': 2, 'global_batch': 4, 'seq_len': 16, 'seed': 7}
  a = data_lib.make_lm_data(config, **kwargs)
  b = data_lib.make_lm_data(config, **kwargs)
  np.testing.assert_array_equal(a.train.batch(11), b.train.batch(11))


def test_missing_tfds_dataset(tmp_path):
  config = data_lib.get_config()
  config.dataset = 'lm1b'
  config.data_dir = str(tmp_path)
  with pytest.raises(FileNotFoundError, match='tfds build lm1b'):
    data_lib.make_lm_data(config, num_workers=2, global_batch=4, seq_len=8)


def test_stdlib_default_is_quick(tmp_path):
  config = data_lib.get_config()
  config.data_dir = str(tmp_path)
  config.max_bytes = 300_000
  data = data_lib.make_lm_data(
    config, num_workers=4, global_batch=8, seq_len=64, seed=0
  )
  assert data.stats.dataset.startswith('loc_opt_local_text/stdlib_')
  assert 0 < data.stats.train_bytes + data.stats.eval_bytes <= 300_000
  assert data.train.batch(0).shape == (4, 2, 65)
