"""A TFDS builder that turns local text files into byte-level examples.

Every file under the configured source directories becomes one example: its raw
bytes (vocabulary 256, no tokenizer) and its relative path. Files go to the
``train`` or ``validation`` split by a stable hash of their relative path, so a
file never changes split when other files are added or removed.

The default source is the Python standard library's own ``*.py`` files
(``sysconfig.get_paths()['stdlib']``, without ``site-packages`` and the test
directories): about 11 MB of text that every Python installation has, so the
default experiment runs offline on a fresh machine. It is the running
interpreter's, so another Python version trains on other text: a corpus
file (``python -m loc_opt.data.export_corpus OUT``)
holds the selected files in one tar archive, under the keys they have here,
and ``corpus_file=OUT`` reads them back on any machine as the same examples
in the same splits.

The builder writes and reads ``array_record`` files and needs no TensorFlow.
The config name carries a fingerprint of the sources (directories, pattern,
exclusions, size cap, and the path, size and modification time of every
selected file), so different sources, or edited files, get their own directory
under ``data_dir`` instead of silently reusing stale data. Building is
idempotent, and safe when several processes build the same config at once: TFDS
writes into a private ``incomplete.*`` directory and renames it into place, and
a process that loses that race reuses the winner's copy
(:func:`prepare_local_text`).

Example::

  from loc_opt.data import local_text
  config = local_text.local_text_config(max_bytes=2_000_000)
  train = local_text.load_local_text(config, split='train', data_dir='/tmp/d')
  len(train), train[0].dtype  # (number of files, uint8)
"""

import contextlib
import dataclasses
import fnmatch
import hashlib
import json
import logging
import os
import pathlib
import re
import sysconfig
import tarfile
from collections.abc import Iterator, Sequence
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from loc_opt.data import tfds_text

# Directory names skipped anywhere below a source directory.
DEFAULT_EXCLUDE_DIRS: tuple[str, ...] = (
  '.git',
  '__pycache__',
  'idle_test',
  'site-packages',
  'test',
  'tests',
)
DEFAULT_GLOB = '**/*.py'
DEFAULT_VALIDATION_PERCENT = 5.0

_FILE_FORMAT = 'array_record'
# Benign TFDS warnings on every use of a config made at run time, or of a
# config that is not built yet; dropped while this module talks to TFDS.
_QUIET_PREFIXES = ('Using custom data configuration', 'Variant folder')


class _DropBenignWarnings(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_QUIET_PREFIXES)


@contextlib.contextmanager
def _quiet_tfds() -> Iterator[None]:
  logger = logging.getLogger('absl')
  log_filter = _DropBenignWarnings()
  logger.addFilter(log_filter)
  try:
    yield
  finally:
    logger.removeFilter(log_filter)


def stdlib_dir() -> str:
  """Returns the directory of the Python standard library's source files."""
  return sysconfig.get_paths()['stdlib']


@dataclasses.dataclass(eq=False, kw_only=True)
class LocalTextConfig(tfds.core.BuilderConfig):
  """Configuration of a :class:`LocalText` dataset.

  Build instances with :func:`local_text_config`, which resolves the source
  directories and derives ``name`` from a fingerprint of the sources; a config
  made by hand must have a name that no other source uses.

  Attributes:
    source_dirs: absolute directories to read, in order.
    glob: pattern of the files to read, relative to each source directory:
      ``*``, ``?`` and ``[...]`` match within one path segment, and a ``**``
      segment matches any number of directories (``'**/*.py'``).
    exclude_dirs: directory names skipped anywhere below a source directory.
    max_bytes: if set, a cap on the total size of the selected files; files
      are taken in the order of a stable hash of their path (a uniform random
      subset), skipping any that would overflow the cap.
    validation_percent: share of the files (by count, chosen by a stable hash
      of the path) that go to the ``validation`` split.
    corpus_file: if set, a corpus file of :mod:`loc_opt.data.export_corpus`
      to read
      instead of ``source_dirs`` (``glob``, ``exclude_dirs`` and
      ``max_bytes`` select among its files as among a directory's).
  """

  source_dirs: tuple[str, ...] = ()
  glob: str = DEFAULT_GLOB
  exclude_dirs: tuple[str, ...] = DEFAULT_EXCLUDE_DIRS
  max_bytes: int | None = None
  validation_percent: float = DEFAULT_VALIDATION_PERCENT
  corpus_file: str | None = None


@dataclasses.dataclass(frozen=True)
class _SourceFile:
  path: str  # Absolute path (of the corpus file, for a member of one).
  key: str  # Relative path, prefixed by the source index if several sources.
  size: int
  mtime_ns: int
  member: bool = False  # A member ``key`` of the corpus file ``path``.


def _stable_unit(text: str) -> float:
  """Maps a string to [0, 1), identically on every machine and run."""
  digest = hashlib.sha256(text.encode('utf-8')).digest()
  return int.from_bytes(digest[:8], 'big') / 2.0**64


def _glob_regex(pattern: str) -> re.Pattern[str]:
  """Compiles a ``glob`` pattern (``*``, ``?``, ``[...]``, ``**/``)."""
  out = []
  parts = pattern.split('/')
  for index, part in enumerate(parts):
    if part == '**':
      out.append('(?:[^/]+/)*')
      continue
    i = 0
    while i < len(part):
      c = part[i]
      if c == '*':
        out.append('[^/]*')
      elif c == '?':
        out.append('[^/]')
      elif c == '[' and ']' in part[i + 2 :]:
        end = part.index(']', i + 2)
        out.append('[' + part[i + 1 : end].replace('!', '^', 1) + ']')
        i = end
      else:
        out.append(re.escape(c))
      i += 1
    if index < len(parts) - 1:
      out.append('/')
  return re.compile(''.join(out))


def _list_files(
  source_dirs: Sequence[str],
  glob: str,
  exclude_dirs: Sequence[str],
  max_bytes: int | None,
) -> list[_SourceFile]:
  """Lists the selected files, sorted by key."""
  regex = _glob_regex(glob)
  files = []
  for index, source in enumerate(source_dirs):
    if not os.path.isdir(source):
      raise FileNotFoundError(f'source_dirs: {source!r} is not a directory.')
    for dirpath, dirnames, filenames in os.walk(source):
      dirnames[:] = [
        d
        for d in dirnames
        if not any(fnmatch.fnmatchcase(d, p) for p in exclude_dirs)
      ]
      rel_dir = os.path.relpath(dirpath, source).replace(os.sep, '/')
      for filename in filenames:
        rel = filename if rel_dir == '.' else f'{rel_dir}/{filename}'
        if not regex.fullmatch(rel):
          continue
        path = os.path.join(dirpath, filename)
        if not os.path.isfile(path):
          continue
        stat = os.stat(path)
        key = rel if len(source_dirs) == 1 else f'{index}/{rel}'
        files.append(_SourceFile(path, key, stat.st_size, stat.st_mtime_ns))
  return _cap(files, max_bytes)


def _cap(files: list[_SourceFile], max_bytes: int | None) -> list[_SourceFile]:
  """At most ``max_bytes`` of ``files`` (taken in the order of a stable hash
  of the key, skipping any that would overflow), sorted by key. Applied to
  its own output it keeps every file, so a corpus file exported with a cap
  and read with the same cap selects the same files."""
  if max_bytes is not None:
    kept, total = [], 0
    for f in sorted(files, key=lambda f: (_stable_unit(f.key), f.key)):
      if total + f.size <= max_bytes:
        kept.append(f)
        total += f.size
    files = kept
  return sorted(files, key=lambda f: f.key)


# The member of a corpus file that describes it (not a document).
MANIFEST = '.loc_opt_corpus.json'


def _open_corpus(corpus_file: str) -> tarfile.TarFile:
  if not os.path.isfile(corpus_file):
    raise FileNotFoundError(f'corpus_file: {corpus_file!r} is not a file.')
  try:
    return tarfile.open(corpus_file, 'r:*')
  except tarfile.TarError as e:
    raise ValueError(
      f'corpus_file: {corpus_file!r} is not a corpus file (a tar archive of '
      f'loc_opt.data.export_corpus): {e}'
    ) from e


def _list_corpus(
  corpus_file: str,
  glob: str,
  exclude_dirs: Sequence[str],
  max_bytes: int | None,
) -> list[_SourceFile]:
  """Lists the selected members of a corpus file, sorted by key."""
  regex = _glob_regex(glob)
  files = []
  with _open_corpus(corpus_file) as tar:
    for info in tar.getmembers():
      if not info.isfile() or info.name == MANIFEST:
        continue
      parts = info.name.split('/')[:-1]
      if not regex.fullmatch(info.name) or any(
        fnmatch.fnmatchcase(d, p) for d in parts for p in exclude_dirs
      ):
        continue
      files.append(_SourceFile(corpus_file, info.name, info.size, 0, True))
  return _cap(files, max_bytes)


def read_manifest(corpus_file: str | os.PathLike[str]) -> dict[str, object]:
  """The description a corpus file carries (its :data:`MANIFEST`)."""
  with _open_corpus(os.fspath(corpus_file)) as tar:
    try:
      member = tar.extractfile(MANIFEST)
    except KeyError:
      member = None
    if member is None:
      raise ValueError(f'{os.fspath(corpus_file)!r} has no {MANIFEST}: not a '
                       'corpus file of loc_opt.data.export_corpus.')
    return json.loads(member.read())


def read_files(files: Sequence[_SourceFile]) -> Iterator[bytes]:
  """The bytes of ``files``, in order (a corpus file is opened once)."""
  tars: dict[str, tarfile.TarFile] = {}
  try:
    for f in files:
      if not f.member:
        yield pathlib.Path(f.path).read_bytes()
        continue
      if f.path not in tars:
        tars[f.path] = _open_corpus(f.path)
      yield tars[f.path].extractfile(f.key).read()
  finally:
    for tar in tars.values():
      tar.close()


def selected_files(config: LocalTextConfig) -> list[_SourceFile]:
  """The files ``config`` selects, sorted by key."""
  if config.corpus_file:
    return _list_corpus(config.corpus_file, config.glob, config.exclude_dirs,
                        config.max_bytes)
  return _list_files(config.source_dirs, config.glob, config.exclude_dirs,
                     config.max_bytes)


def split_documents(config: LocalTextConfig) -> dict[str, list[bytes]]:
  """The bytes of every file of each split (``'train'``, ``'validation'``),
  in path order: the examples the builder stores, read without TFDS."""
  splits = _split_files(selected_files(config), config.validation_percent)
  return {name: list(read_files(fs)) for name, fs in splits.items()}


def _split_files(
  files: Sequence[_SourceFile], validation_percent: float
) -> dict[str, list[_SourceFile]]:
  """Assigns files to splits by a stable hash; both splits are non-empty."""
  if len(files) < 2:
    raise ValueError(
      f'local_text needs at least 2 source files (one per split), found '
      f'{len(files)}; check source_dirs, glob, exclude_dirs and max_bytes.'
    )
  units = [_stable_unit(f.key) for f in files]
  is_val = [u < validation_percent / 100.0 for u in units]
  if not any(is_val):  # Few files: the one with the smallest hash.
    is_val[int(np.argmin(units))] = True
  if all(is_val):  # validation_percent near 100: keep one file for training.
    is_val[int(np.argmax(units))] = False
  return {
    'train': [f for f, v in zip(files, is_val) if not v],
    'validation': [f for f, v in zip(files, is_val) if v],
  }


def local_text_config(
  source_dirs: Sequence[str | os.PathLike[str]] = (),
  *,
  glob: str = DEFAULT_GLOB,
  exclude_dirs: Sequence[str] = DEFAULT_EXCLUDE_DIRS,
  max_bytes: int | None = None,
  validation_percent: float = DEFAULT_VALIDATION_PERCENT,
  corpus_file: str | os.PathLike[str] | None = None,
) -> LocalTextConfig:
  """Returns the config of a local text dataset, named by its fingerprint.

  The name is ``'<label>_<fingerprint>'``: the label is ``stdlib`` for the
  default source, else the first source directory's (or the corpus file's)
  name; the fingerprint hashes every argument and the path, size and
  modification time of every selected file (of a corpus file: its bytes).
  Listing the stdlib takes a few milliseconds.

  Args:
    source_dirs: directories to read; empty means the Python standard library
      (:func:`stdlib_dir`).
    glob: pattern of the files to read, relative to each source directory.
    exclude_dirs: directory names (``fnmatch`` patterns) skipped anywhere below
      a source directory. The default skips ``site-packages``, caches and test
      directories.
    max_bytes: if set, a cap on the total bytes of the selected files.
    validation_percent: percentage of files in the ``validation`` split.
    corpus_file: a corpus file of :mod:`loc_opt.data.export_corpus` to read
      instead of directories (``source_dirs`` must then be empty).

  Returns:
    A :class:`LocalTextConfig`.

  Raises:
    ValueError: for a bad ``max_bytes`` or ``validation_percent``, or both
      ``source_dirs`` and ``corpus_file``.
    FileNotFoundError: if a source directory or the corpus file does not
      exist.
  """
  if max_bytes is not None and max_bytes <= 0:
    raise ValueError(f'max_bytes must be positive or None, got {max_bytes}.')
  if not 0.0 <= validation_percent < 100.0:
    raise ValueError(
      f'validation_percent must be in [0, 100), got {validation_percent}.'
    )
  exclude = tuple(exclude_dirs)
  if corpus_file:
    if source_dirs:
      raise ValueError(
        f'give source_dirs ({tuple(source_dirs)}) or corpus_file '
        f'({os.fspath(corpus_file)!r}), not both.'
      )
    corpus = os.path.abspath(os.path.expanduser(os.fspath(corpus_file)))
    dirs = ()
    files = _list_corpus(corpus, glob, exclude, max_bytes)
  else:
    corpus = None
    dirs = tuple(
      os.path.abspath(os.path.expanduser(os.fspath(d)))
      for d in (source_dirs or (stdlib_dir(),))
    )
    files = _list_files(dirs, glob, exclude, max_bytes)
  is_stdlib = not source_dirs and not corpus
  settings = {
    'source_dirs': dirs,
    'glob': glob,
    'exclude_dirs': exclude,
    'max_bytes': max_bytes,
    'validation_percent': validation_percent,
  }
  if corpus:
    settings['corpus_file'] = corpus
  digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
  if corpus:
    with open(corpus, 'rb') as f:
      digest.update(hashlib.file_digest(f, 'sha256').digest())
  for f in files:
    digest.update(f'\0{f.key}\0{f.size}\0{f.mtime_ns}'.encode())
  if is_stdlib:
    label = 'stdlib'
  elif corpus:
    label = pathlib.Path(corpus).name.split('.')[0]
  else:
    label = pathlib.Path(dirs[0]).name
  label = ''.join(c if c.isalnum() else '_' for c in label.lower()) or 'text'
  return LocalTextConfig(
    name=f'{label}_{digest.hexdigest()[:12]}',
    description=json.dumps(
      settings | {'num_files': len(files), 'bytes': sum(f.size for f in files)}
    ),
    source_dirs=dirs,
    glob=glob,
    exclude_dirs=exclude,
    max_bytes=max_bytes,
    validation_percent=validation_percent,
    corpus_file=corpus,
  )


class LocalText(tfds.core.GeneratorBasedBuilder):
  """Byte-level examples from local text files (default: the Python stdlib).

  Features: ``text`` (the file's bytes, ``uint8[None]``) and ``path`` (its
  relative path). Splits: ``train`` and ``validation``. Examples are stored in
  path order. Use :func:`prepare_local_text` rather than calling
  ``download_and_prepare`` directly: it selects ``array_record``, never touches
  the network and survives concurrent builds.
  """

  name = 'loc_opt_local_text'
  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES: ClassVar[dict[str, str]] = {'1.0.0': 'Initial release.'}
  # TFDS 4.9.10 finds a packaged builder's code through `importlib_resources`,
  # which it installs only on Python < 3.9 (tensorflow/datasets#11212).
  code_path = epath.Path(__file__)

  def __init__(
    self,
    *,
    config: LocalTextConfig | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    **kwargs,
  ):
    """Initializes the builder; ``config=None`` means the stdlib default."""
    kwargs.setdefault('file_format', _FILE_FORMAT)
    super().__init__(
      config=config if config is not None else local_text_config(),
      data_dir=tfds_text.resolve_data_dir(data_dir),
      **kwargs,
    )

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description=(
        'Local text files as byte-level examples (vocabulary 256): the '
        'bytes of each file and its relative path.'
      ),
      features=tfds.features.FeaturesDict(
        {
          'text': tfds.features.Tensor(shape=(None,), dtype=np.uint8),
          'path': tfds.features.Text(),
        }
      ),
      disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download.
    config = self.builder_config
    splits = _split_files(selected_files(config), config.validation_percent)
    return {name: self._generate_examples(fs) for name, fs in splits.items()}

  def _generate_examples(
    self, files: Sequence[_SourceFile]
  ) -> Iterator[tuple[str, dict[str, object]]]:
    for f, data in zip(files, read_files(files)):
      yield f.key, {'text': np.frombuffer(data, np.uint8), 'path': f.key}


def prepare_local_text(
  config: LocalTextConfig | None = None,
  *,
  data_dir: str | os.PathLike[str] | None = None,
) -> LocalText:
  """Builds the dataset in ``data_dir`` unless it is there, and returns it.

  Idempotent: a prepared config is reused. Concurrent builds of one config
  (say pytest and a training run) each write a private temporary directory
  and rename it into place; the process that loses the race drops its copy
  and reuses the winner's.

  Args:
    config: from :func:`local_text_config`; ``None`` means the stdlib.
    data_dir: TFDS data directory; ``None`` means ``$TFDS_DATA_DIR`` or
      ``~/tensorflow_datasets``.

  Returns:
    A prepared :class:`LocalText` builder; read it with
    ``builder.as_data_source(split)`` or :func:`load_local_text`.
  """
  config = config if config is not None else local_text_config()
  with _quiet_tfds():
    builder = LocalText(config=config, data_dir=data_dir)
    if builder.is_prepared():
      return builder
    download_config = tfds.download.DownloadConfig(try_download_gcs=False)
    try:
      builder.download_and_prepare(
        download_config=download_config, file_format=_FILE_FORMAT
      )
    except Exception:
      # Another process may have renamed its finished copy into place first.
      builder = LocalText(config=config, data_dir=data_dir)
      if not builder.is_prepared():
        raise
  return builder


def load_local_text(
  config: LocalTextConfig | None = None,
  *,
  split: str,
  data_dir: str | os.PathLike[str] | None = None,
  max_bytes: int | None = None,
) -> list[np.ndarray]:
  """Returns the documents (one ``uint8`` array per file) of one split.

  Builds the dataset first if needed (:func:`prepare_local_text`).

  Args:
    config: from :func:`local_text_config`; ``None`` means the stdlib.
    split: ``'train'`` or ``'validation'`` (TFDS slicing such as
      ``'train[:10%]'`` works too).
    data_dir: TFDS data directory; ``None`` means the TFDS default.
    max_bytes: if set, stop reading before the total would exceed it.

  Returns:
    The files' bytes in path order.
  """
  builder = prepare_local_text(config, data_dir=data_dir)
  source = builder.as_data_source(split, file_format=_FILE_FORMAT)
  return tfds_text.read_documents(source, text_key='text', max_bytes=max_bytes)

