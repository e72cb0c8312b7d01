"""LM data from a config: the train pipeline, eval batches and statistics.

``get_config()`` holds the data fields of an experiment config and
``make_lm_data`` turns them into an :class:`LMData`::

  config = get_config()  # The stdlib source, IID shards.
  data = make_lm_data(config, num_workers=4, global_batch=32, seq_len=128)
  tokens = data.train.batch(step)  # int32[4, 8, 129]
  evals = data.eval_batches(8)  # int32[8, 32, 129], the same on every call
"""

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import ml_collections
import numpy as np

from loc_opt.data import local_text, pipeline, tfds_text

LOCAL_TEXT = 'local_text'


def get_config() -> ml_collections.ConfigDict:
  """Returns the default data config (the stdlib source, IID shards)."""
  config = ml_collections.ConfigDict()
  # 'local_text' (files on this machine, see source_dirs) or the name of a
  # TFDS dataset prepared in data_dir as array_record ('lm1b', 'c4/en').
  config.dataset = LOCAL_TEXT
  # TFDS data directory; '' means $TFDS_DATA_DIR or ~/tensorflow_datasets.
  config.data_dir = ''
  # local_text: directories to read; () means the Python standard library.
  config.source_dirs = ()
  # local_text: pattern of the files to read, relative to each source dir.
  config.glob = local_text.DEFAULT_GLOB
  # local_text: directory names skipped (default: site-packages, caches and
  # test directories).
  config.exclude_dirs = local_text.DEFAULT_EXCLUDE_DIRS
  # local_text: percentage of files held out in the validation split.
  config.validation_percent = local_text.DEFAULT_VALIDATION_PERCENT
  # Cap on the text bytes. local_text: on the files selected at build time
  # (a stable random subset). TFDS: on the bytes read from each split.
  config.max_bytes = ml_collections.config_dict.placeholder(int)
  # Assign whole documents (source files) to workers instead of cutting the
  # shuffled byte stream into contiguous ranges.
  config.non_iid = False
  # TFDS: the feature that holds the text.
  config.text_key = 'text'
  # TFDS: splits for training and evaluation (lm1b has 'train' and 'test').
  config.train_split = 'train'
  config.eval_split = 'validation'
  # Byte written after every document (0 never occurs in text).
  config.separator = pipeline.DEFAULT_SEPARATOR
  # Windows per eval batch; None means the global batch.
  config.eval_batch_size = ml_collections.config_dict.placeholder(int)
  return config


class DataStats(NamedTuple):
  """Sizes of the data, for logs.

  Attributes:
    dataset: ``'loc_opt_local_text/<config>'`` or the TFDS name.
    train_bytes: bytes of train text (separators excluded).
    eval_bytes: bytes of evaluation text.
    train_documents: number of train documents (files).
    eval_documents: number of evaluation documents.
    worker_bytes: bytes in each worker's shard (separators included).
    worker_documents: documents with bytes in each worker's shard; in IID mode
      a document cut by a shard boundary counts for both workers.
  """

  dataset: str
  train_bytes: int
  eval_bytes: int
  train_documents: int
  eval_documents: int
  worker_bytes: tuple[int, ...]
  worker_documents: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class LMData:
  """Training pipeline, evaluation text and statistics of one experiment.

  Attributes:
    train: the per-worker training batches; ``train.batch(step)``.
    eval_documents: the evaluation documents, in a fixed order.
    eval_batch_size: default windows per eval batch.
    stats: sizes, for logs.
  """

  train: pipeline.LMBatches
  eval_documents: Sequence[np.ndarray]
  eval_batch_size: int
  stats: DataStats

  def eval_batches(
    self, num_batches: int, batch_size: int | None = None,
    rows: slice | None = None,
  ) -> np.ndarray:
    """Returns ``int32[num_batches, batch_size, seq_len + 1]`` eval windows.

    The same array on every call (see :func:`pipeline.eval_batches`).

    Args:
      num_batches: number of batches.
      batch_size: windows per batch; ``None`` means ``eval_batch_size``.
      rows: if given, only these rows of every batch (see
        :func:`pipeline.eval_batches`).
    """
    return pipeline.eval_batches(
      self.eval_documents,
      num_batches=num_batches,
      batch_size=batch_size or self.eval_batch_size,
      seq_len=self.train.seq_len,
      separator=self.train.separator,
      rows=rows,
    )


def load_splits(
  config: ml_collections.ConfigDict,
) -> tuple[str, list[np.ndarray], list[np.ndarray]]:
  """Returns ``(dataset name, train documents, eval documents)``.

  Builds the local text dataset if needed; reads a TFDS dataset only if it is
  prepared (:func:`tfds_text.load_documents`).

  Args:
    config: fields as in :func:`get_config`.
  """
  data_dir = config.data_dir or None
  if config.dataset == LOCAL_TEXT:
    text_config = local_text.local_text_config(
      tuple(config.source_dirs),
      glob=config.glob,
      exclude_dirs=tuple(config.exclude_dirs),
      max_bytes=config.max_bytes,
      validation_percent=config.validation_percent,
    )
    builder = local_text.prepare_local_text(text_config, data_dir=data_dir)
    name = f'{builder.name}/{text_config.name}'
    train, evals = (
      local_text.load_local_text(text_config, split=split, data_dir=data_dir)
      for split in ('train', 'validation')
    )
    return name, train, evals
  train, evals = (
    tfds_text.load_documents(
      config.dataset,
      split=split,
      data_dir=data_dir,
      text_key=config.text_key,
      max_bytes=config.max_bytes,
    )
    for split in (config.train_split, config.eval_split)
  )
  return config.dataset, train, evals


def make_lm_data(
  config: ml_collections.ConfigDict,
  *,
  num_workers: int,
  global_batch: int,
  seq_len: int,
  seed: int = 0,
) -> LMData:
  """Builds the train pipeline, eval documents and statistics from a config.

  Args:
    config: fields as in :func:`get_config`.
    num_workers: number of workers ``M``.
    global_batch: train windows per step over all workers.
    seq_len: model sequence length.
    seed: seed of the train windows (and of the IID document order).

  Returns:
    An :class:`LMData`.
  """
  name, train_docs, eval_docs = load_splits(config)
  train = pipeline.LMBatches(
    train_docs,
    num_workers=num_workers,
    global_batch=global_batch,
    seq_len=seq_len,
    seed=seed,
    non_iid=config.non_iid,
    separator=config.separator,
  )
  if not eval_docs:
    raise ValueError(f'eval_split {config.eval_split!r} of {name} is empty.')
  stats = DataStats(
    dataset=name,
    train_bytes=sum(d.size for d in train_docs),
    eval_bytes=sum(d.size for d in eval_docs),
    train_documents=len(train_docs),
    eval_documents=len(eval_docs),
    worker_bytes=train.worker_bytes,
    worker_documents=tuple(len(d) for d in train.worker_documents),
  )
  return LMData(
    train=train,
    eval_documents=tuple(eval_docs),
    eval_batch_size=config.eval_batch_size or global_batch,
    stats=stats,
  )
