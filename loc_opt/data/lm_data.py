"""LM data from a config: the train pipeline, eval batches and statistics.

``get_config()`` holds the data fields of an experiment config and
``make_lm_data`` turns them into an :class:`LMData`::

  config = get_config()  # The stdlib source, IID shards.
  data = make_lm_data(config, num_workers=4, global_batch=32, seq_len=128)
  tokens = data.train.batch(step)  # int32[4, 8, 129]
  evals = data.eval_batches(8)  # int32[8, 32, 129], the same on every call
"""

import dataclasses
import platform
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import ml_collections
import numpy as np

from loc_opt.data import corpus, local_text, pipeline, tfds_text

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
  # local_text: a corpus file (python -m loc_opt.data.export_corpus OUT) to
  # read instead of source_dirs: the same text on any machine and Python.
  # None (no corpus file) matches the configs saved before the field.
  config.corpus_file = ml_collections.config_dict.placeholder(str)
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
    corpus: the fingerprint of the text (:func:`corpus_fingerprint`).
  """

  train: pipeline.LMBatches
  eval_documents: Sequence[np.ndarray]
  eval_batch_size: int
  stats: DataStats
  corpus: dict | None = None

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


def local_text_config_of(config) -> local_text.LocalTextConfig:
  """The :class:`local_text.LocalTextConfig` of a data config (a ConfigDict
  or a saved dict; ``corpus_file`` may be absent)."""
  return local_text.local_text_config(
    tuple(config.get('source_dirs') or ()),
    glob=config.get('glob', local_text.DEFAULT_GLOB),
    exclude_dirs=tuple(
      config.get('exclude_dirs', local_text.DEFAULT_EXCLUDE_DIRS)
    ),
    max_bytes=config.get('max_bytes'),
    validation_percent=config.get(
      'validation_percent', local_text.DEFAULT_VALIDATION_PERCENT
    ),
    corpus_file=config.get('corpus_file') or None,
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
    text_config = local_text_config_of(config)
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


# The data fields that decide which text a run reads (a results file keeps
# them in every fingerprint, so the corpus can be recomputed elsewhere).
CORPUS_FIELDS = ('dataset', 'source_dirs', 'corpus_file', 'glob',
                 'exclude_dirs', 'max_bytes', 'validation_percent',
                 'text_key', 'train_split', 'eval_split')


def corpus_fields(config: Mapping[str, Any]) -> dict[str, Any]:
  """The fields of a data config (a ConfigDict or a saved dict) that select
  the text, JSON-ready; missing ones at their defaults."""
  default = get_config()
  out = {}
  for k in CORPUS_FIELDS:
    v = config.get(k, default.get(k))
    out[k] = list(v) if isinstance(v, (tuple, list)) else v
  out['corpus_file'] = out['corpus_file'] or None
  return out


def _source(fields: Mapping[str, Any]) -> tuple[str, str | None]:
  """``(source, python)``: where the text comes from and, for the standard
  library (or a corpus file exported from one), the Python version."""
  if fields['dataset'] != LOCAL_TEXT:
    return 'tfds', None
  if fields['corpus_file']:
    manifest = local_text.read_manifest(fields['corpus_file'])
    return 'corpus_file', manifest.get('python')
  if not fields['source_dirs']:
    return 'stdlib', platform.python_version()
  return 'source_dirs', None


def corpus_fingerprint(
  config: Mapping[str, Any],
  documents: tuple[Sequence[Any], Sequence[Any]] | None = None,
) -> dict[str, Any]:
  """The fingerprint of the text a data config selects.

  See :mod:`loc_opt.data.corpus`.

  Args:
    config: data fields (``get_config()`` or a saved dict).
    documents: ``(train, eval)`` documents already read for ``config``; if
      None they are read: local text straight from its files (no TFDS
      build), a TFDS dataset from its prepared copy.

  Returns:
    ``{'sha256', 'source', 'python', 'documents', 'bytes', 'data'}``: the
    hash (:func:`corpus.digest`); ``'stdlib'``, ``'source_dirs'``,
    ``'corpus_file'`` or ``'tfds'``; the Python version of a
    standard-library corpus (else None); ``[train, eval]`` document counts
    and bytes; the selecting fields (:func:`corpus_fields`).
  """
  fields = corpus_fields(config)
  if documents is None and fields['dataset'] == LOCAL_TEXT:
    splits = local_text.split_documents(local_text_config_of(config))
    documents = (splits['train'], splits['validation'])
  elif documents is None:  # a saved dict too: its TFDS fields in a config
    tfds_config = get_config()
    for k in ('dataset', 'text_key', 'train_split', 'eval_split'):
      tfds_config[k] = fields[k]
    tfds_config.max_bytes = fields['max_bytes']
    tfds_config.data_dir = config.get('data_dir') or ''
    documents = load_splits(tfds_config)[1:]
  train, evals = documents
  source, python = _source(fields)
  return {
    'sha256': corpus.digest(train, evals),
    'source': source,
    'python': python,
    'documents': [len(train), len(evals)],
    'bytes': [int(sum(map(len, train))), int(sum(map(len, evals)))],
    'data': fields,
  }


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
  fingerprint = corpus_fingerprint(config, (train_docs, eval_docs))
  corpus.remember(fingerprint)
  return LMData(
    train=train,
    eval_documents=tuple(eval_docs),
    eval_batch_size=config.eval_batch_size or global_batch,
    stats=stats,
    corpus=fingerprint,
  )
