"""Deterministic byte-level LM batches, split disjointly across workers.

The train documents (one ``uint8`` array per document) are laid end to end,
each followed by a separator byte, into one stream. Each of the ``M`` workers
owns a contiguous range of that stream and samples its training windows only
inside it, so no two workers ever see the same byte:

* IID (default): the documents are put in a seeded random order, and the
  stream is cut into ``M`` ranges of (almost) equal length. Each worker's
  range is a random mix of documents; a document may straddle two ranges.
* non-IID (``non_iid=True``): whole documents (source files) are assigned to
  workers, greedily balancing bytes (largest first, to the least loaded
  worker), and each worker's range holds exactly its own documents.

A batch is a pure function of ``(seed, step)``: window starts are drawn from
``numpy.random.default_rng([seed, worker, step])``. The input position is
therefore the step itself; a checkpoint needs no iterator state, and restoring
at step ``s`` then calling ``batch(s)`` continues the exact stream.

Example::

  data = LMBatches(docs, num_workers=4, global_batch=32, seq_len=128, seed=0)
  tokens = data.batch(step)  # int32[4, 8, 129]
  inputs, targets = tokens[..., :-1], tokens[..., 1:]
"""

import heapq
from collections.abc import Sequence

import numpy as np

DEFAULT_SEPARATOR = 0  # A byte that text never contains: an end of document.
_ORDER_STREAM = 0x5EED  # Seed-sequence tag of the IID document order.


def _as_documents(documents: Sequence[np.ndarray]) -> list[np.ndarray]:
  docs = [np.asarray(d) for d in documents]
  for i, d in enumerate(docs):
    if d.ndim != 1 or d.dtype != np.uint8:
      raise ValueError(
        f'documents[{i}] must be a 1-D uint8 array, got {d.dtype}{d.shape}.'
      )
  return docs


def _check_separator(separator: int) -> None:
  if not 0 <= separator <= 255:
    raise ValueError(f'separator must be a byte in [0, 255], got {separator}.')


def _join(documents: Sequence[np.ndarray], separator: int) -> np.ndarray:
  """Concatenates documents, each followed by ``separator``."""
  sizes = np.fromiter((d.size + 1 for d in documents), np.int64)
  stream = np.full(int(sizes.sum()), separator, np.uint8)
  offset = 0
  for d, size in zip(documents, sizes):
    stream[offset : offset + d.size] = d
    offset += int(size)
  return stream


def _balance(sizes: Sequence[int], num_workers: int) -> list[list[int]]:
  """Greedily assigns documents to workers, balancing bytes.

  Largest document first (ties: lower index), to the worker with the fewest
  bytes so far (ties: lower worker). Deterministic.
  """
  heap = [(0, w) for w in range(num_workers)]  # (bytes so far, worker).
  assigned: list[list[int]] = [[] for _ in range(num_workers)]
  for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
    load, worker = heapq.heappop(heap)
    assigned[worker].append(i)
    heapq.heappush(heap, (load + sizes[i], worker))
  return [sorted(a) for a in assigned]


class LMBatches:
  """Byte-level LM training batches with disjoint per-worker shards.

  ``batch(step)`` returns ``int32[num_workers, per_worker_batch, seq_len + 1]``
  token windows (bytes, vocabulary 256); inputs are ``[..., :-1]`` and
  targets ``[..., 1:]``. It is a pure function of ``(seed, step)``: the step
  is the whole input position, so checkpoint the step and nothing else.

  Attributes:
    num_workers: number of workers ``M``.
    global_batch: windows per step over all workers.
    per_worker_batch: ``global_batch // num_workers``.
    seq_len: model sequence length; windows have ``seq_len + 1`` bytes.
    seed: seed of the window sampling (and of the IID document order).
    non_iid: whether whole documents are assigned to workers.
    separator: byte written after every document.
    stream: ``uint8[n]``, the train bytes in worker order (read-only).
    worker_bounds: ``int64[M + 1]``; worker ``w`` owns
      ``stream[worker_bounds[w]:worker_bounds[w + 1]]``.
    worker_documents: for each worker, the indices (into the ``documents``
      argument) of the documents with at least one byte in its range.
    document_bounds: ``int64[len(documents), 2]``, where each document lies
      in ``stream`` (separator excluded).
  """

  def __init__(
    self,
    documents: Sequence[np.ndarray],
    *,
    num_workers: int,
    global_batch: int,
    seq_len: int,
    seed: int = 0,
    non_iid: bool = False,
    separator: int = DEFAULT_SEPARATOR,
  ):
    """Lays out the stream and the worker ranges.

    Args:
      documents: train documents, each a 1-D ``uint8`` array (e.g. a file).
      num_workers: number of workers ``M``.
      global_batch: windows per step over all workers; divisible by ``M``.
      seq_len: model sequence length (positive).
      seed: non-negative seed.
      non_iid: assign whole documents to workers instead of cutting the
        shuffled stream into ``M`` ranges.
      separator: byte written after every document.

    Raises:
      ValueError: naming the offending argument, e.g. when ``global_batch``
        is not divisible by ``num_workers`` or a worker's range is shorter
        than ``seq_len + 1``.
    """
    if num_workers < 1:
      raise ValueError(f'num_workers must be >= 1, got {num_workers}.')
    if global_batch < 1 or global_batch % num_workers:
      raise ValueError(
        f'global_batch ({global_batch}) must be a positive multiple of '
        f'num_workers ({num_workers}).'
      )
    if seq_len < 1:
      raise ValueError(f'seq_len must be positive, got {seq_len}.')
    if seed < 0:
      raise ValueError(f'seed must be non-negative, got {seed}.')
    _check_separator(separator)
    docs = _as_documents(documents)
    if not docs:
      raise ValueError('documents is empty.')
    if non_iid and len(docs) < num_workers:
      raise ValueError(
        f'non_iid needs at least one document per worker: {len(docs)} '
        f'documents for num_workers={num_workers}.'
      )

    self.num_workers = num_workers
    self.global_batch = global_batch
    self.per_worker_batch = global_batch // num_workers
    self.seq_len = seq_len
    self.seed = seed
    self.non_iid = non_iid
    self.separator = separator

    sizes = [d.size + 1 for d in docs]  # With the separator.
    if non_iid:
      groups = _balance(sizes, num_workers)
      order = [i for group in groups for i in group]
    else:
      rng = np.random.default_rng([seed, _ORDER_STREAM])
      order = [int(i) for i in rng.permutation(len(docs))]
    starts = np.zeros(len(docs), np.int64)
    offset = 0
    for i in order:
      starts[i] = offset
      offset += sizes[i]
    self.document_bounds = np.stack(
      [starts, starts + np.array(sizes, np.int64) - 1], axis=1
    )
    self.stream = _join([docs[i] for i in order], separator)
    self.stream.flags.writeable = False
    if non_iid:
      loads = [sum(sizes[i] for i in group) for group in groups]
      self.worker_bounds = np.concatenate([[0], np.cumsum(loads)])
    else:
      total = self.stream.size
      self.worker_bounds = (
        np.arange(num_workers + 1, dtype=np.int64) * total // num_workers
      )
    self.worker_bounds = self.worker_bounds.astype(np.int64)
    ends = starts + np.array(sizes, np.int64)  # Separator included.
    self.worker_documents = tuple(
      tuple(int(i) for i in np.flatnonzero((starts < hi) & (ends > lo)))
      for lo, hi in zip(self.worker_bounds[:-1], self.worker_bounds[1:])
    )
    lengths = np.diff(self.worker_bounds)
    for w, length in enumerate(lengths):
      if length < seq_len + 1:
        raise ValueError(
          f'worker {w} has {length} bytes of text, fewer than seq_len + 1 = '
          f'{seq_len + 1}; use fewer workers, a shorter seq_len or more '
          'documents.'
        )

  @property
  def worker_bytes(self) -> tuple[int, ...]:
    """Bytes (separators included) in each worker's range."""
    return tuple(int(n) for n in np.diff(self.worker_bounds))

  def _starts(self, step: int, worker: int) -> np.ndarray:
    lo, hi = self.worker_bounds[worker], self.worker_bounds[worker + 1]
    rng = np.random.default_rng([self.seed, worker, step])
    count = hi - lo - self.seq_len  # Starts lo ... hi - (seq_len + 1).
    return lo + rng.integers(0, count, self.per_worker_batch)

  def _check(self, step: int, worker: int = 0) -> None:
    if step < 0:
      raise ValueError(f'step must be non-negative, got {step}.')
    if not 0 <= worker < self.num_workers:
      raise ValueError(
        f'worker must be in [0, {self.num_workers}), got {worker}.'
      )

  def window_starts(self, step: int) -> np.ndarray:
    """Returns ``int64[num_workers, per_worker_batch]`` stream offsets.

    Worker ``w``'s windows ``stream[s:s + seq_len + 1]`` lie inside its range.

    Args:
      step: non-negative training step.
    """
    self._check(step)
    return np.stack([self._starts(step, w) for w in range(self.num_workers)])

  def _gather(self, starts: np.ndarray) -> np.ndarray:
    index = starts[..., None] + np.arange(self.seq_len + 1)
    return self.stream[index].astype(np.int32)

  def batch(self, step: int) -> np.ndarray:
    """Returns the windows of ``step``, ``int32[M, B, seq_len + 1]``.

    Args:
      step: non-negative training step; the only input position.
    """
    return self._gather(self.window_starts(step))

  def rows(self, step: int, start: int, stop: int) -> np.ndarray:
    """Returns ``batch(step).reshape(-1, seq_len + 1)[start:stop]``,
    computing only the windows of those rows.

    For multi-process runs, where each process reads only the rows its
    devices hold; the windows are those of :meth:`batch`, bit for bit.

    Args:
      step: non-negative training step.
      start: first row, in ``[0, global_batch]``.
      stop: row after the last, in ``[start, global_batch]``.
    """
    self._check(step)
    if not 0 <= start <= stop <= self.global_batch:
      raise ValueError(f'rows [{start}, {stop}) must lie in [0, '
                       f'{self.global_batch}].')
    per = self.per_worker_batch
    parts = [np.zeros([0], np.int64)]
    for w in range(start // per, -(-stop // per)):
      lo, hi = max(start - w * per, 0), min(stop - w * per, per)
      parts.append(self._starts(step, w)[lo:hi])
    return self._gather(np.concatenate(parts))

  def worker_batch(self, step: int, worker: int) -> np.ndarray:
    """Returns ``batch(step)[worker]``, computing only that worker's windows.

    For multi-host runs, where each host feeds only its own workers.

    Args:
      step: non-negative training step.
      worker: worker index in ``[0, num_workers)``.
    """
    self._check(step, worker)
    return self._gather(self._starts(step, worker))


def eval_batches(
  documents: Sequence[np.ndarray],
  *,
  num_batches: int,
  batch_size: int,
  seq_len: int,
  separator: int = DEFAULT_SEPARATOR,
  rows: slice | None = None,
) -> np.ndarray:
  """Returns fixed evaluation windows, ``int32[num_batches, batch, L + 1]``.

  The documents are joined in the given order (each followed by
  ``separator``) and the ``num_batches * batch_size`` windows start at evenly
  spaced offsets, covering the text from start to end. No randomness: the
  same arguments give the same array. Windows overlap only when the text is
  shorter than ``num_batches * batch_size * (seq_len + 1)`` bytes.

  Args:
    documents: validation documents, each a 1-D ``uint8`` array.
    num_batches: number of batches (positive).
    batch_size: windows per batch (positive).
    seq_len: model sequence length (positive).
    separator: byte written after every document.
    rows: if given, only these rows of every batch (``[:, rows]``, computed
      alone: a process of a multi-process run reads only its own rows).

  Returns:
    Token windows; inputs ``[..., :-1]``, targets ``[..., 1:]``.
  """
  if num_batches < 1:
    raise ValueError(f'num_batches must be positive, got {num_batches}.')
  if batch_size < 1:
    raise ValueError(f'batch_size must be positive, got {batch_size}.')
  if seq_len < 1:
    raise ValueError(f'seq_len must be positive, got {seq_len}.')
  _check_separator(separator)
  stream = _join(_as_documents(documents), separator)
  window = seq_len + 1
  if stream.size < window:
    raise ValueError(
      f'the evaluation documents hold {stream.size} bytes, fewer than '
      f'seq_len + 1 = {window}.'
    )
  count = num_batches * batch_size
  # First window at the start of the text, last one at its end.
  starts = np.arange(count, dtype=np.int64) * (stream.size - window)
  starts //= max(count - 1, 1)
  starts = starts.reshape(num_batches, batch_size)
  if rows is not None:
    starts = starts[:, rows]
  index = starts[..., None] + np.arange(window)
  return stream[index].astype(np.int32)
