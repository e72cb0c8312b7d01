"""Run records on disk: strict JSON, written atomically.

:func:`write_json` writes any JSON-able value (e.g. a run's
``summary.json``) so that a reader never sees half a file, and never a
``NaN`` / ``Infinity`` literal, which is not JSON (Python writes them by
default; ``json.loads`` in other languages refuses them): each non-finite
number becomes ``null`` and the record gains ``"non_finite": {"field":
"nan"}`` saying which and what it was. The file goes to a temporary name
in the same directory, is flushed to disk, and renamed over the old one;
then the directory is flushed, so a crash leaves the old record or the
new one.
"""

import json
import math
import os
import pathlib
from typing import Any


def strict(value: Any, path: str = '') -> tuple[Any, dict[str, str]]:
  """``value`` with each non-finite float replaced by None, and the
  replaced fields (dotted paths) with what they were: ``'nan'``,
  ``'inf'`` or ``'-inf'``."""
  if isinstance(value, float) and not math.isfinite(value):
    return None, {path or '.': str(value)}
  if isinstance(value, dict):
    out, notes = {}, {}
    for k, v in value.items():
      out[k], more = strict(v, f'{path}.{k}' if path else str(k))
      notes.update(more)
    return out, notes
  if isinstance(value, (list, tuple)):
    out, notes = [], {}
    for i, v in enumerate(value):
      item, more = strict(v, f'{path}.{i}' if path else str(i))
      out.append(item)
      notes.update(more)
    return out, notes
  return value, {}


def dumps(value: Any) -> str:
  """``value`` as strict JSON text (see the module doc), indented."""
  clean, notes = strict(value)
  if notes and isinstance(clean, dict):
    clean['non_finite'] = notes
  return json.dumps(clean, indent=2, allow_nan=False) + '\n'


def write_json(path: str | os.PathLike, value: Any) -> None:
  """Writes ``value`` to ``path`` as strict JSON, atomically."""
  path = pathlib.Path(path)
  text = dumps(value)
  tmp = path.with_name(f'.{path.name}.{os.getpid()}.tmp')
  try:
    with open(tmp, 'w') as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if tmp.exists():
      tmp.unlink()
  try:
    fd = os.open(path.parent, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)
