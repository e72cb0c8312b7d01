"""Byte-level LM data: a local-text TFDS builder and per-worker pipelines.

* :mod:`local_text`: a TFDS builder over local text files (default: the Python
  standard library), written and read as ``array_record`` without TensorFlow.
* :mod:`tfds_text`: documents of named TFDS datasets already prepared in a
  ``data_dir`` (``lm1b``, ``c4/en``); never downloads.
* :mod:`pipeline`: deterministic batches, disjoint per worker (IID ranges or
  whole files per worker), whose input position is the step.
* :mod:`lm_data`: all of the above from an ``ml_collections`` config, and
  the fingerprint of the text it reads (:func:`corpus_fingerprint`).
* :mod:`corpus`: that fingerprint's hash and records (``summary.json``,
  results files); :mod:`export_corpus`: a corpus in one file, to train on
  the same text anywhere (``python -m loc_opt.data.export_corpus OUT``).
"""

from loc_opt.data.lm_data import (
  DataStats,
  LMData,
  corpus_fingerprint,
  get_config,
  load_splits,
  make_lm_data,
)
from loc_opt.data.local_text import (
  LocalText,
  LocalTextConfig,
  load_local_text,
  local_text_config,
  prepare_local_text,
  stdlib_dir,
)
from loc_opt.data.pipeline import LMBatches, eval_batches
from loc_opt.data.tfds_text import (
  load_documents,
  read_documents,
  resolve_data_dir,
)

__all__ = [
  'DataStats',
  'LMBatches',
  'LMData',
  'LocalText',
  'LocalTextConfig',
  'corpus_fingerprint',
  'eval_batches',
  'get_config',
  'load_documents',
  'load_local_text',
  'load_splits',
  'local_text_config',
  'make_lm_data',
  'prepare_local_text',
  'read_documents',
  'resolve_data_dir',
  'stdlib_dir',
]
