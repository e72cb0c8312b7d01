"""A checkpoint's faults in words, and Orbax's noise about them silenced.

:func:`unreadable_reason` says in one line why a checkpoint could not be
read (which file or array, and what is wrong); the ``_quiet_*`` filters
drop what Orbax and TensorStore print about a failed read or a full disk,
which ``loc_opt.train.checkpoint`` reports in one line instead;
:func:`remove_partial` and :func:`disk_full_message` are a full disk's
cleanup and line.
"""

from collections.abc import Sequence
import errno
import logging
import pathlib
import re
import shutil
import sys
import traceback
from typing import Any
import warnings

import jax

# TensorStore's status prefixes, as its errors reach Python.
_STATUS = re.compile(r'^([A-Z_]+): ')


def chain(error: BaseException) -> list[BaseException]:
  """``error`` and the exceptions it was raised from, outermost first."""
  out, seen = [], set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    out.append(error)
    error = error.__cause__ or error.__context__
  return out


def first_line(text: str, limit: int = 200) -> str:
  """The first line of an error's text, without TensorStore's spec."""
  text = re.sub(r'\s*\[tensorstore_spec=.*', '', text.strip(), flags=re.S)
  line = (text.splitlines() or [''])[0]
  return line if len(line) <= limit else line[:limit - 3] + '...'


def lost_peer(error: BaseException) -> str | None:
  """The first line of a cross-process failure in ``error``'s chain (a
  gloo collective or the coordination service: another process of the run
  left, e.g. stopped on a signal), else ``None``: no fault of the
  checkpoint being read."""
  if jax.process_count() < 2:
    return None
  for e in reversed(chain(error)):  # the innermost says it best
    text = str(e)
    if 'Gloo' in text or 'coordination service' in text:
      return first_line(text)
  return None


def unreadable_reason(error: BaseException, where: pathlib.Path) -> str:
  """Why checkpoint ``where`` could not be read, in words (one line):
  which file or array, and what is wrong with it."""
  errors = chain(error)
  for e in errors:
    if isinstance(e, PermissionError):
      return f'permission denied reading {e.filename or where}'
    if isinstance(e, IsADirectoryError):
      return f'a directory where a file should be: {e.filename}'
    if isinstance(e, OSError) and e.errno == errno.EIO:
      return f'I/O error reading {e.filename or where}'
  texts = [str(e) for e in errors]
  for text in texts:
    m = re.search(r'Item "(\w+)" was not found', text)
    if m:
      return f'item {m.group(1)!r} missing ({where / m.group(1)} is absent)'
  if any('pytree structure error' in t for t in texts) and \
      not (where / 'state' / '_METADATA').exists():
    return f'metadata missing ({where / "state" / "_METADATA"} is absent)'
  status = [t for t in texts if _STATUS.match(t)]
  detail = status[-1] if status else texts[-1]
  array = re.search(r'Error (?:reading|writing) "([^"/]+)(?:/[^"]*)?"', detail)
  name = f' ({array.group(1)})' if array else ''
  if 'byte range' in detail and 'not valid for value of size' in detail:
    return f'an array file is shorter than its metadata says{name}'
  if re.search(r'zstd|decompress|Truncated', detail, re.I):
    return f'array data cannot be decoded{name}: ' + first_line(
        detail.rsplit(': ', 1)[-1], 120)
  if 'manifest' in detail and 'Error decoding' in detail:
    return 'the array index (OCDBT manifest) cannot be decoded: ' + \
        first_line(detail.rsplit(': ', 1)[-1], 120)
  if detail.startswith('PERMISSION_DENIED'):
    return f'permission denied{name}: ' + first_line(detail, 160)
  if detail.startswith('NOT_FOUND'):
    return f'a file is missing{name}: ' + first_line(detail, 160)
  return f'{type(errors[-1]).__name__}: {first_line(detail)}'


def _is_closed_loop_callback(unraisable: Any) -> bool:
  """Whether ``unraisable`` is a TensorStore completion callback that found
  Orbax's event loop already closed."""
  exc = unraisable.exc_value
  if not (isinstance(exc, RuntimeError)
          and str(exc) == 'Event loop is closed'):
    return False
  frames = traceback.extract_tb(unraisable.exc_traceback)
  return bool(frames) and frames[0].name == 'call_soon_threadsafe'


def _drop_orbax_unretrieved(record: logging.LogRecord) -> bool:
  """False for asyncio's report of an Orbax / TensorStore read whose
  failure nobody retrieved (the gather had already raised the first one)."""
  message = record.getMessage()
  return not (message.startswith(('Task exception was never retrieved',
                                  'Future exception was never retrieved'))
              and ('/orbax/checkpoint/' in message
                   or 'tensorstore_spec' in message))


def quiet_orbax_restore_failures() -> None:
  """Silences the side effects of a failed Orbax restore, nothing else.

  Orbax reads every array concurrently (``asyncio.gather`` of TensorStore
  reads in a fresh event loop, ``orbax.checkpoint._src.asyncio_utils``).
  When one read fails, the gather raises, Orbax closes the loop, and each
  read still in flight later completes on a TensorStore thread whose
  callback calls ``loop.call_soon_threadsafe`` on the closed loop: Python
  prints each such ``RuntimeError: Event loop is closed`` through
  ``sys.unraisablehook``; the other reads that failed too are logged by
  asyncio as "Task / Future exception was never retrieved" when collected,
  and the never-awaited metadata coroutine comes as a ``RuntimeWarning``.
  All are harmless (the results are discarded) and would bury the real
  error, so these filters drop exactly those and pass everything else on.
  Installed once per process.
  """
  if getattr(sys.unraisablehook, '_loc_opt_filter', False):
    return
  previous = sys.unraisablehook

  def hook(unraisable):
    if not _is_closed_loop_callback(unraisable):
      previous(unraisable)

  hook._loc_opt_filter = True  # pylint: disable=protected-access
  sys.unraisablehook = hook
  logging.getLogger('asyncio').addFilter(_drop_orbax_unretrieved)
  warnings.filterwarnings(
      'ignore', message=r"coroutine '[\w.]+_get_array_metadatas' was never "
      'awaited', category=RuntimeWarning)


def _drop_orbax_disk_full(record: logging.LogRecord) -> bool:
  """False for Orbax's log of a write thread that failed on a full disk
  (with its traceback): ``Checkpointer.save`` reports it in one line."""
  message = record.getMessage()
  return not ('raised an exception' in message
              and 'No space left on device' in message)


def quiet_orbax_disk_full() -> None:
  """Installs :func:`_drop_orbax_disk_full` on absl's logger, once."""
  logger = logging.getLogger('absl')
  if _drop_orbax_disk_full not in logger.filters:
    logger.addFilter(_drop_orbax_disk_full)


def remove_partial(directory: pathlib.Path, step: int) -> None:
  """Removes what a failed save of ``step`` left (Orbax's temporary
  directory, or an unfinished step directory)."""
  if jax.process_index() != 0:
    return
  for path in directory.glob(f'{step}.orbax-checkpoint-tmp*'):
    shutil.rmtree(path, ignore_errors=True)
  final = directory / str(step)
  if final.is_dir() and not (final / 'commit_success.txt').exists() \
      and not (final / '_CHECKPOINT_METADATA').exists():
    shutil.rmtree(final, ignore_errors=True)


def disk_full_message(directory: pathlib.Path, steps: Sequence[int],
                      step: int) -> str:
  """The line of a save of ``step`` into ``directory`` that found its
  device full: how much the newest of ``steps`` took, how much is free."""
  need = None
  for s in sorted(steps, reverse=True):
    try:
      need = sum(f.stat().st_size for f in (directory / str(s)).rglob('*')
                 if f.is_file())
      break
    except OSError:
      continue
  free = shutil.disk_usage(directory).free
  size = (f'about {need:,} bytes (the size of the last checkpoint)'
          if need else 'more space')
  return (f'no space left on the device of {directory.parent} while saving '
          f'the checkpoint of step {step}: it needs {size}, {free:,} bytes '
          'are free; its partial copy was removed and the earlier '
          'checkpoints are intact. Free space and run the same command '
          'to resume.')
