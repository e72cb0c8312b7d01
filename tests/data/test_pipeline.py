"""Tests of the per-worker LM batches and the eval batches."""

import numpy as np
import pytest

from loc_opt.data import pipeline


def _documents(num: int = 40, seed: int = 0) -> list[np.ndarray]:
  """Documents of varied length, document i made only of byte i + 1."""
  rng = np.random.default_rng(seed)
  return [
    np.full(int(rng.integers(50, 400)), i + 1, np.uint8) for i in range(num)
  ]


def _make(**kwargs) -> pipeline.LMBatches:
  args = {'num_workers': 4, 'global_batch': 16, 'seq_len': 32, 'seed': 3}
  args.update(kwargs)
  return pipeline.LMBatches(args.pop('documents', _documents()), **args)


def test_shape_dtype_and_content():
  data = _make()
  tokens = data.batch(5)
  assert tokens.shape == (4, 4, 33) and tokens.dtype == np.int32
  starts = data.window_starts(5)
  for w in range(4):
    for b in range(4):
      s = starts[w, b]
      np.testing.assert_array_equal(tokens[w, b], data.stream[s : s + 33])


def test_batch_is_a_pure_function_of_seed_and_step():
  a, b = _make(), _make()
  for step in (0, 1, 17, 10**9):
    np.testing.assert_array_equal(a.batch(step), b.batch(step))
    np.testing.assert_array_equal(a.batch(step), a.batch(step))
  # A restart at step 17 sees exactly what an uninterrupted run saw.
  np.testing.assert_array_equal(_make().batch(17), a.batch(17))


def test_steps_and_seeds_differ():
  data = _make()
  assert not np.array_equal(data.window_starts(0), data.window_starts(1))
  other = _make(seed=4)
  assert not np.array_equal(data.window_starts(0), other.window_starts(0))
  # Workers draw different offsets within their ranges.
  rel = data.window_starts(0) - data.worker_bounds[:-1, None]
  assert len({tuple(r) for r in rel}) == 4


def test_worker_batch_equals_batch_row():
  data = _make()
  full = data.batch(9)
  for w in range(4):
    np.testing.assert_array_equal(data.worker_batch(9, w), full[w])


@pytest.mark.parametrize('start,stop', [(0, 16), (0, 4), (2, 11), (5, 5),
                                        (12, 16)])
def test_rows_equal_the_flat_batch_rows(start, stop):
  data = _make()
  flat = data.batch(9).reshape(16, 33)
  np.testing.assert_array_equal(data.rows(9, start, stop), flat[start:stop])
  with pytest.raises(ValueError, match='rows'):
    data.rows(9, 3, 17)


def test_eval_batch_rows_equal_the_full_batches_rows():
  docs = _documents(5)
  kwargs = {'num_batches': 3, 'batch_size': 8, 'seq_len': 20}
  full = pipeline.eval_batches(docs, **kwargs)
  for rows in (slice(0, 8), slice(2, 6), slice(7, 8)):
    np.testing.assert_array_equal(
      pipeline.eval_batches(docs, rows=rows, **kwargs), full[:, rows])


def _check_windows_inside_own_range(data: pipeline.LMBatches, steps=20):
  lo, hi = data.worker_bounds[:-1, None], data.worker_bounds[1:, None]
  for step in range(steps):
    starts = data.window_starts(step)
    assert np.all(starts >= lo)
    assert np.all(starts + data.seq_len + 1 <= hi)


@pytest.mark.parametrize('non_iid', [False, True])
def test_ranges_partition_the_stream(non_iid):
  data = _make(non_iid=non_iid)
  bounds = data.worker_bounds
  assert bounds[0] == 0 and bounds[-1] == data.stream.size
  assert np.all(np.diff(bounds) > 0)
  total = sum(d.size + 1 for d in _documents())
  assert data.stream.size == total
  _check_windows_inside_own_range(data)


def test_iid_shards_are_disjoint_and_balanced():
  docs = _documents()
  data = _make(documents=docs)
  lengths = np.diff(data.worker_bounds)
  assert lengths.max() - lengths.min() <= 1
  seen = [set() for _ in range(4)]
  for step in range(50):
    for w, starts in enumerate(data.window_starts(step)):
      for s in starts:
        seen[w].update(range(s, s + 33))
  for a in range(4):
    for b in range(4):
      if a != b:
        assert not seen[a] & set(
          range(data.worker_bounds[b], data.worker_bounds[b + 1])
        )
  # The IID order is a seeded shuffle of the documents, not the given order.
  order = np.argsort(data.document_bounds[:, 0])
  assert sorted(order) == list(range(40)) and list(order) != list(range(40))
  other = _make(documents=docs, seed=4)
  assert list(np.argsort(other.document_bounds[:, 0])) != list(order)


def test_iid_samples_cover_each_range():
  data = _make(num_workers=2, global_batch=64)
  starts = np.concatenate([data.window_starts(s) for s in range(40)], axis=1)
  lo, hi = data.worker_bounds[:-1], data.worker_bounds[1:] - 33
  span = hi - lo
  assert np.all(starts.min(axis=1) < lo + 0.02 * span)
  assert np.all(starts.max(axis=1) > hi - 0.02 * span)


def test_non_iid_assigns_whole_documents():
  docs = _documents(num=41)
  data = _make(documents=docs, non_iid=True)
  groups = [set(g) for g in data.worker_documents]
  assert sorted(i for g in groups for i in g) == list(range(41))
  sizes = [d.size + 1 for d in docs]
  loads = [sum(sizes[i] for i in g) for g in groups]
  assert loads == list(np.diff(data.worker_bounds))
  assert max(loads) - min(loads) <= max(sizes)
  # Each worker's windows hold only its own documents' bytes (byte i + 1 is
  # document i) and the separator.
  values = [set() for _ in range(4)]
  for step in range(50):
    tokens = data.batch(step)
    for w in range(4):
      values[w].update(np.unique(tokens[w]).tolist())
  for w, group in enumerate(groups):
    assert values[w] - {0} <= {i + 1 for i in group}
    assert len(values[w] - {0}) > 1
  for a in range(4):
    for b in range(a + 1, 4):
      assert not (values[a] & values[b]) - {0}


def test_non_iid_assignment_is_deterministic_and_seed_free():
  a = _make(non_iid=True, seed=1)
  b = _make(non_iid=True, seed=2)
  assert a.worker_documents == b.worker_documents
  np.testing.assert_array_equal(a.stream, b.stream)


def test_document_bounds_locate_documents():
  docs = _documents()
  for non_iid in (False, True):
    data = _make(documents=docs, non_iid=non_iid)
    for i, (start, end) in enumerate(data.document_bounds):
      np.testing.assert_array_equal(data.stream[start:end], docs[i])
      assert data.stream[end] == data.separator


@pytest.mark.parametrize(
  ('kwargs', 'field'),
  [
    ({'global_batch': 10}, 'global_batch'),
    ({'global_batch': 0}, 'global_batch'),
    ({'num_workers': 0}, 'num_workers'),
    ({'seq_len': 0}, 'seq_len'),
    ({'seq_len': 5000}, r'worker 0 has \d+ bytes.*seq_len'),
    ({'seed': -1}, 'seed'),
    ({'separator': 256}, 'separator'),
    ({'documents': []}, 'documents'),
    ({'documents': [np.zeros(9, np.int32)]}, r'documents\[0\]'),
    ({'documents': _documents(3), 'non_iid': True}, 'non_iid'),
  ],
)
def test_errors_name_the_field(kwargs, field):
  with pytest.raises(ValueError, match=field):
    _make(**kwargs)


def test_step_and_worker_errors():
  data = _make()
  with pytest.raises(ValueError, match='step'):
    data.batch(-1)
  with pytest.raises(ValueError, match='worker'):
    data.worker_batch(0, 4)


def test_eval_batches_are_fixed_and_span_the_text():
  rng = np.random.default_rng(0)
  docs = [rng.integers(1, 256, n, dtype=np.uint8) for n in (90, 300, 40, 200)]
  stream = np.concatenate([np.append(d, 0) for d in docs])
  tokens = pipeline.eval_batches(docs, num_batches=3, batch_size=5, seq_len=20)
  assert tokens.shape == (3, 5, 21) and tokens.dtype == np.int32
  again = pipeline.eval_batches(docs, num_batches=3, batch_size=5, seq_len=20)
  np.testing.assert_array_equal(tokens, again)
  flat = tokens.reshape(15, 21)
  np.testing.assert_array_equal(flat[0], stream[:21])
  np.testing.assert_array_equal(flat[-1], stream[-21:])
  assert len({row.tobytes() for row in flat}) == 15


def test_eval_batches_errors():
  with pytest.raises(ValueError, match='seq_len'):
    pipeline.eval_batches(
      [np.ones(5, np.uint8)], num_batches=1, batch_size=1, seq_len=10
    )
  with pytest.raises(ValueError, match='num_batches'):
    pipeline.eval_batches(
      _documents(2), num_batches=0, batch_size=1, seq_len=10
    )
