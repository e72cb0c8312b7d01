"""The fingerprint of the text a run trains and evaluates on.

The default corpus is the running interpreter's standard library
(:mod:`loc_opt.data.local_text`), so the same command trains on other text
under another Python. A fingerprint names the text itself: the SHA-256 of
every document's bytes, split by split, with the data fields that selected
them and, for the standard library, the Python version it came from. The
trainer writes it to ``summary.json`` (:func:`track` keeps it in the run
directory's ``corpus.json`` and refuses to resume a run on other text), and
the experiment programs to every results file, where
``python -m experiments.tables --check`` compares it with this machine's.

A fingerprint is made by :func:`loc_opt.data.corpus_fingerprint` from a
data config; this module holds the hash and the records. Example::

  from loc_opt import data
  config = data.get_config()
  config.max_bytes = 8_000_000
  fp = data.corpus_fingerprint(config)  # reads the files; no TFDS build
  fp['sha256'], fp['python'], corpus.describe(fp)
"""

import hashlib
import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

FILE = 'corpus.json'  # In a run directory (:func:`track`).

# The fingerprints of the corpora this process trained or evaluated on
# (:func:`remember`), by SHA-256.
_LOADED: dict[str, dict[str, Any]] = {}


def digest(train: Sequence[Any], evals: Sequence[Any]) -> str:
  """The SHA-256 of the documents of both splits (each document's length
  and bytes, in order): equal for equal text, whatever its source."""
  h = hashlib.sha256(b'loc_opt corpus 1\0')
  for role, docs in (('train', train), ('eval', evals)):
    h.update(f'{role}\0{len(docs)}\0'.encode())
    for doc in docs:
      data = doc if isinstance(doc, bytes) else np.ascontiguousarray(
          doc, np.uint8).tobytes()
      h.update(len(data).to_bytes(8, 'little'))
      h.update(data)
  return h.hexdigest()


def describe(fp: Mapping[str, Any]) -> str:
  """``'the Python 3.12.1 standard library (7.6 MB, 465 files; sha256
  1a2b3c4d5e6f)'`` and the like."""
  source = {'stdlib': f'the Python {fp.get("python")} standard library',
            'source_dirs': f'files of {fp["data"].get("source_dirs")}',
            'corpus_file': f'corpus file {fp["data"].get("corpus_file")}'
                           + (f' (from Python {fp["python"]})'
                              if fp.get('python') else ''),
            'tfds': f'TFDS {fp["data"].get("dataset")}'}[fp['source']]
  size = sum(fp['bytes']) / 1e6
  return (f'{source} ({size:.1f} MB, {sum(fp["documents"])} files; sha256 '
          f'{fp["sha256"][:12]})')


def remember(fp: dict[str, Any]) -> None:
  """Notes that this process read the corpus ``fp`` (:func:`loaded`)."""
  _LOADED[fp['sha256']] = fp


def loaded() -> list[dict[str, Any]]:
  """The fingerprints of the corpora this process has read, in order."""
  return list(_LOADED.values())


def check_resume(workdir: str | os.PathLike, fp: dict[str, Any] | None
                 ) -> None:
  """Raises ``ValueError`` if the run in ``workdir`` recorded a corpus
  other than ``fp`` (:func:`track`); call before anything compiles, when
  the run resumes from a checkpoint."""
  path = pathlib.Path(workdir) / FILE
  if fp is None or not path.exists():
    return
  saved = json.loads(path.read_text())
  if saved['sha256'] != fp['sha256']:
    raise ValueError(
        f'{workdir} was trained on {describe(saved)}, but this process '
        f'read {describe(fp)}: it cannot resume on other text. Use the '
        "run's corpus (data.corpus_file from python -m "
        'loc_opt.data.export_corpus on its machine) or a new --workdir.')


def track(workdir: str | os.PathLike, fp: dict[str, Any] | None,
          start_step: int, *, write: bool = True) -> dict[str, Any] | None:
  """The corpus of the run in ``workdir``, kept in its ``corpus.json``.

  A run that starts (``start_step`` 0) records ``fp``, replacing any record
  of an earlier start that left no checkpoint. A run that resumes must read
  the same text: a different SHA-256 is an error. A branch, or a run begun
  before fingerprints were kept, records ``fp`` from ``start_step`` on
  (``from_step`` says so).

  Args:
    workdir: the run directory.
    fp: the fingerprint of the corpus this process loaded.
    start_step: the step the run starts or resumes from.
    write: whether this process writes files (process 0 of several).

  Returns:
    The record: ``fp`` plus ``from_step``; None if ``fp`` is None.

  Raises:
    ValueError: if the run's recorded corpus is not ``fp``'s.
  """
  if fp is None:
    return None
  path = pathlib.Path(workdir) / FILE
  if start_step and path.exists():
    check_resume(workdir, fp)
    return json.loads(path.read_text())
  record = {**fp, 'from_step': int(start_step)}
  if write:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(FILE + '.tmp')
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, path)
  return record
