"""Documents from named TFDS text datasets (lm1b, c4, ...), read without TF.

A named dataset is read only when it is already prepared in ``data_dir`` in
the ``array_record`` format; nothing is downloaded or generated at run time.
Prepare one once, on any machine with the dataset's build dependencies::

  tfds build c4/en --data_dir=DATA_DIR --file_format=array_record

Datasets whose TFDS code cannot be imported here (several, c4 among them,
import TensorFlow) are still readable: TFDS then reads them from the files in
``data_dir`` alone.
"""

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

_ARRAY_RECORD = tfds.core.file_adapters.FileFormat.ARRAY_RECORD
_READ_CHUNK = 1024  # Records fetched per data source call.


def resolve_data_dir(data_dir: str | os.PathLike[str] | None) -> str:
  """Returns ``data_dir``, or the TFDS default, as an absolute path.

  Args:
    data_dir: a directory, or ``None``/``''`` for ``$TFDS_DATA_DIR`` or else
      ``~/tensorflow_datasets``.

  Returns:
    The absolute data directory.
  """
  if not data_dir:
    data_dir = tfds.core.constants.DATA_DIR
  return os.path.abspath(os.path.expanduser(os.fspath(data_dir)))


def _as_bytes(value: Any, text_key: str) -> np.ndarray:
  """Converts one decoded text feature to a ``uint8`` array."""
  if isinstance(value, bytes):
    return np.frombuffer(value, np.uint8)
  if isinstance(value, str):
    return np.frombuffer(value.encode('utf-8'), np.uint8)
  array = np.asarray(value)
  if array.dtype == np.uint8 and array.ndim == 1:
    return array
  raise TypeError(
    f'text_key {text_key!r} holds {type(value).__name__} of dtype '
    f'{getattr(value, "dtype", None)}; expected text or a 1-D uint8 array.'
  )


def read_documents(
  source: Sequence[dict[str, Any]],
  *,
  text_key: str = 'text',
  max_bytes: int | None = None,
) -> list[np.ndarray]:
  """Reads the text of every record of a TFDS data source as bytes.

  Args:
    source: a random-access TFDS data source (``tfds.data_source(...)``).
    text_key: the feature that holds the text.
    max_bytes: if set, stop before the total would exceed it.

  Returns:
    One ``uint8`` array per record, in the source's order.
  """
  documents, total = [], 0
  for start in range(0, len(source), _READ_CHUNK):
    keys = range(start, min(start + _READ_CHUNK, len(source)))
    for record in source.__getitems__(keys):
      doc = _as_bytes(record[text_key], text_key)
      if max_bytes is not None and total + doc.size > max_bytes:
        return documents
      documents.append(doc)
      total += doc.size
  return documents


def _build_command(name: str, data_dir: str) -> str:
  return f'tfds build {name} --data_dir={data_dir} --file_format=array_record'


def load_documents(
  name: str,
  *,
  split: str,
  data_dir: str | os.PathLike[str] | None = None,
  text_key: str = 'text',
  max_bytes: int | None = None,
) -> list[np.ndarray]:
  """Returns the documents of a prepared TFDS text dataset as bytes.

  Never downloads or generates anything.

  Args:
    name: TFDS name, with optional config and version (``'lm1b'``,
      ``'c4/en:3.1.0'``).
    split: split to read (``'train'``, ``'validation'``, ``'train[:1%]'``).
      Note that lm1b has ``train`` and ``test`` only.
    data_dir: TFDS data directory; ``None`` means the TFDS default.
    text_key: the feature that holds the text.
    max_bytes: if set, read documents in order until the next one would take
      the total past ``max_bytes`` (c4/en is hundreds of GB).

  Returns:
    One ``uint8`` array per example.

  Raises:
    FileNotFoundError: if the dataset is not prepared in ``data_dir``.
    ValueError: if it is stored without ``array_record`` files, or ``split``
      or ``text_key`` does not exist.
  """
  data_dir = resolve_data_dir(data_dir)
  missing = (
    f'TFDS dataset {name!r} is not prepared in data_dir {data_dir!r}, and '
    'loc_opt never downloads at run time. Prepare it once with '
    f'`{_build_command(name, data_dir)}`, or point data_dir at a directory '
    'that holds it.'
  )
  try:
    builder = tfds.builder(name, data_dir=data_dir, try_gcs=False)
  except tfds.core.DatasetNotFoundError as e:
    raise FileNotFoundError(missing) from e
  if not builder.is_prepared():
    raise FileNotFoundError(missing)
  formats = builder.info.available_file_formats()
  if _ARRAY_RECORD not in formats:
    found = ', '.join(sorted(f.value for f in formats)) or 'none'
    raise ValueError(
      f'TFDS dataset {name!r} in {builder.data_dir!r} is stored as {found}; '
      'loc_opt reads array_record files (random access, no TensorFlow). '
      f'Rebuild it with `{_build_command(name, data_dir)}`.'
    )
  base = split.split('[', 1)[0]
  if '+' not in split and base not in builder.info.splits:
    raise ValueError(
      f'split {split!r} is not in TFDS dataset {name!r}; it has '
      f'{sorted(builder.info.splits)}.'
    )
  features = builder.info.features
  if text_key not in features:
    raise ValueError(
      f'text_key {text_key!r} is not a feature of TFDS dataset {name!r}; it '
      f'has {sorted(features)}.'
    )
  source = builder.as_data_source(split, file_format=_ARRAY_RECORD)
  return read_documents(source, text_key=text_key, max_bytes=max_bytes)
