r"""Writes a local-text corpus to one file, to train on it anywhere.

  python -m loc_opt.data.export_corpus OUT [--source_dir=DIR ...] \
    [--glob='**/*.py'] [--max_bytes=N] [--corpus_file=IN]

With no source the corpus is this interpreter's standard library (the
default data of every config), whole: a run that caps it
(``data.max_bytes``, 8,000,000 in ``configs/diloco_lm.py``) selects the
same files from the corpus file as from the directory. Train on it with
``--config.data.corpus_file=OUT`` on any machine and any Python: the same
examples in the same splits, and the same corpus fingerprint
(:func:`loc_opt.data.corpus_fingerprint`), as the source here. It prints the
fingerprint of the corpus at the default data fields.
"""

import argparse
import io
import json
import os
import pathlib
import platform
import sys
import tarfile

from loc_opt.data import corpus
from loc_opt.data import lm_data
from loc_opt.data import local_text


def _tar_info(name: str, size: int) -> tarfile.TarInfo:
  """A member header that depends on nothing but the name and size."""
  info = tarfile.TarInfo(name)
  info.size, info.mtime, info.mode = size, 0, 0o644
  info.uid = info.gid = 0
  info.uname = info.gname = ''
  return info


def export(
  config: local_text.LocalTextConfig | None,
  out: str | os.PathLike[str],
  *,
  manifest: dict[str, object] | None = None,
) -> dict[str, object]:
  """Writes the files ``config`` selects to one corpus file (a tar archive).

  Each member is a selected file under its key (its path relative to the
  source directory), in key order, so ``corpus_file=out`` (with the same
  ``glob``, ``exclude_dirs``, ``max_bytes`` and ``validation_percent``)
  yields the same examples in the same splits as ``config`` on any machine
  and any Python. The archive is byte-for-byte the same for the same files
  (no times, owners or modes of this machine). A first member,
  ``local_text.MANIFEST``, describes the source: the Python version for the
  standard library (``local_text.read_manifest``).

  Args:
    config: from ``local_text.local_text_config``; None means the stdlib.
    out: the file to write (replaced atomically).
    manifest: more fields for the manifest.

  Returns:
    The manifest.
  """
  config = config if config is not None else local_text.local_text_config()
  files = local_text.selected_files(config)
  manifest_name = local_text.MANIFEST
  if any(f.key == manifest_name for f in files):
    raise ValueError(f'a source file is named {manifest_name!r}, the name of '
                     "the corpus file's manifest; exclude it.")
  stdlib = (not config.corpus_file
            and config.source_dirs == (local_text.stdlib_dir(),))
  value = {
    'format': 1,
    'source': 'stdlib' if stdlib else 'corpus_file' if config.corpus_file
    else 'source_dirs',
    'python': platform.python_version() if stdlib else None,
    'glob': config.glob,
    'exclude_dirs': list(config.exclude_dirs),
    'max_bytes': config.max_bytes,
    'files': len(files),
    'bytes': sum(f.size for f in files),
  }
  if config.corpus_file:  # A re-export keeps where the text came from.
    source = local_text.read_manifest(config.corpus_file)
    value['python'] = source.get('python')
  value.update(manifest or {})
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.with_name(out.name + '.tmp')
  with tarfile.open(tmp, 'w', format=tarfile.PAX_FORMAT) as tar:
    head = json.dumps(value, indent=2, sort_keys=True).encode()
    tar.addfile(_tar_info(manifest_name, len(head)), io.BytesIO(head))
    for f, data in zip(files, local_text.read_files(files)):
      tar.addfile(_tar_info(f.key, len(data)), io.BytesIO(data))
  os.replace(tmp, out)
  return value


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('out', help='The corpus file to write (a tar archive).')
  parser.add_argument('--source_dir', action='append', default=[],
                      help='A directory to read (repeat for several); '
                      'none means the Python standard library.')
  parser.add_argument('--corpus_file', default='',
                      help='Re-export (a subset of) a corpus file.')
  parser.add_argument('--glob', default=local_text.DEFAULT_GLOB,
                      help='Pattern of the files to read.')
  parser.add_argument('--exclude_dirs',
                      default=','.join(local_text.DEFAULT_EXCLUDE_DIRS),
                      help='Comma-separated directory names to skip.')
  parser.add_argument('--max_bytes', type=int, default=None,
                      help='Cap on the bytes of the selected files.')
  args = parser.parse_args(argv)
  config = lm_data.get_config()
  config.source_dirs = tuple(args.source_dir)
  config.corpus_file = args.corpus_file
  config.glob = args.glob
  config.exclude_dirs = tuple(d for d in args.exclude_dirs.split(',') if d)
  config.max_bytes = args.max_bytes
  try:
    text_config = lm_data.local_text_config_of(config)
    manifest = export(text_config, args.out)
  except (OSError, ValueError) as e:
    parser.error(str(e))
  config.source_dirs, config.corpus_file = (), args.out
  fp = lm_data.corpus_fingerprint(config)
  print(json.dumps(manifest, indent=2, sort_keys=True))
  print(f'wrote {args.out}: {corpus.describe(fp)}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
