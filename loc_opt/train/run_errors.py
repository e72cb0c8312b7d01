"""How a run that stops on a fault ends the launcher: one line, a known code.

:func:`one_line` wraps the launcher's run. The faults a run can stop on end
the program with one line on standard error (no traceback; set
``LOC_OPT_TRACEBACK=1`` to see it) and these exit codes:

====================================================  =====================
what                                                  exit code
====================================================  =====================
finished, or saved and stopped on SIGTERM (preempted) 0
saved and stopped on SIGINT (Ctrl-C)                  130
a signal before the first step, or a second SIGINT    128 + signal (130, 143)
another live run holds the workdir                    1
training went non-finite (``NonFiniteError``)         1
no readable checkpoint; a full disk                   1
====================================================  =====================
"""

import contextlib
import errno
import os
import sys
from typing import Iterator

from loc_opt.train import checkpoint as ckpt_lib
from loc_opt.train import faults
from loc_opt.train import local_launch
from loc_opt.train import preemption
from loc_opt.train import workdir_lock

TRACEBACK_ENV = 'LOC_OPT_TRACEBACK'


def _full_disk(e: BaseException) -> bool:
  while e is not None:
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
      return True
    e = e.__cause__ or e.__context__
  return False


def _exit(text: str | None, code: int) -> None:
  """Prints ``text`` (none: no line) in one line and exits with ``code``."""
  if text is not None:
    print(' '.join(text.split()), file=sys.stderr, flush=True)
  if _several_processes():
    # Not through jax.distributed's shutdown, whose barrier waits for the
    # other processes: one may be inside a collective with this one (Orbax's
    # restore barrier, after a signal or a failed restore here), which
    # Python cannot interrupt. Exiting at once lets the launcher, or the
    # coordination service's heartbeat, stop them. The run's own blocks
    # (lock, checkpoints) have closed.
    sys.stdout.flush()
    os._exit(code)
  sys.exit(code)


def _several_processes() -> bool:
  if 'jax' not in sys.modules:
    return False
  import jax  # pylint: disable=g-import-not-at-top
  return jax.distributed.is_initialized() and jax.process_count() > 1


def _quiet_stop() -> bool:
  """Whether this is a ``--local_processes`` child other than process 0,
  which leaves the line of a signal before the first step to process 0
  (every child got the signal) or to the launcher (only this one did)."""
  if not os.environ.get(local_launch.CHILD_ENV) or not _several_processes():
    return False
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_index() != 0


@contextlib.contextmanager
def one_line(workdir: str | os.PathLike) -> Iterator[None]:
  """Inside the block, a fault of the run ends the program in one line
  with its exit code (see the module doc)."""
  try:
    yield
  except preemption.Interrupted as e:
    _exit(None if _quiet_stop() else str(e), e.exit_code)
  except (workdir_lock.WorkdirLockedError, faults.NonFiniteError,
          ckpt_lib.CheckpointError) as e:
    if os.environ.get(TRACEBACK_ENV, '') not in ('', '0'):
      raise
    _exit(f'error: {e}', 1)
  except OSError as e:
    if not _full_disk(e) or \
        os.environ.get(TRACEBACK_ENV, '') not in ('', '0'):
      raise
    _exit(f'error: no space left on the device of {workdir} '
          f'({e.filename or "a file of the run"}); free space and run the '
          'same command to resume from the last checkpoint', 1)
