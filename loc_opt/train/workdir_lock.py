"""One run per workdir: a lock file that process 0 holds while a run writes.

Two launchers on one workdir would delete each other's checkpoints in
progress and interleave two runs' saves. Before anything is written, process
0 creates ``workdir/lock.json`` with ``O_CREAT | O_EXCL`` (atomic on local
filesystems and on NFS v3 and later), holding its host, pid, start time and
a heartbeat that a daemon thread renews every :data:`HEARTBEAT_S` seconds;
it is removed when the run ends, however it ends in Python. A second
launcher is refused with :class:`WorkdirLockedError`, one line naming the
holder. A lock whose holder is gone is taken over, with one line saying so:

- the same host, and no process with that pid (or one started after the
  lock was: the pid was reused); or
- another host, and a heartbeat older than :data:`STALE_S` seconds (the
  host cannot be asked whether the process lives).

Taking over renames the stale file away first (only one of two newcomers'
renames can succeed), then creates the lock afresh. With several processes
only process 0 takes the lock, and every process learns the outcome, so
all of them raise together.
"""

import json
import os
import pathlib
import socket
import sys
import threading
import time
from typing import Any, Callable

import jax

from loc_opt.train import preemption

HEARTBEAT_S = 10.0
STALE_S = 300.0
NAME = 'lock.json'


class WorkdirLockedError(RuntimeError):
  """Another live run holds the workdir."""


def _proc_start_time(pid: int) -> float | None:
  """When process ``pid`` started (seconds since the epoch; Linux), or
  None if unknown."""
  try:
    stat = pathlib.Path(f'/proc/{pid}/stat').read_text()
    ticks = int(stat.rsplit(')', 1)[1].split()[19])
    boot = next(float(l.split()[1]) for l in
                pathlib.Path('/proc/stat').read_text().splitlines()
                if l.startswith('btime '))
    return boot + ticks / os.sysconf('SC_CLK_TCK')
  except (OSError, ValueError, IndexError, StopIteration):
    return None


def _alive(pid: int, since: float) -> bool:
  """Whether process ``pid`` of this host is the one that took a lock at
  time ``since``."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # it exists, owned by someone else
  started = _proc_start_time(pid)
  # A process started after the lock was taken reused the pid (2 s of
  # slack for the clock ticks).
  return started is None or started <= since + 2.0


def _describe(holder: dict[str, Any]) -> str:
  started = time.strftime('%Y-%m-%d %H:%M:%S',
                          time.localtime(holder.get('started', 0)))
  age = time.time() - float(holder.get('heartbeat', 0))
  return (f'pid {holder.get("pid")} on host {holder.get("host")!r} since '
          f'{started} (heartbeat {age:.0f} s ago)')


class WorkdirLock:
  """The lock of one workdir (see the module doc).

  ``acquire`` takes it (process 0) or raises; ``release`` gives it back;
  ``say`` gets the line of a takeover (default: standard error).
  """

  def __init__(self, workdir: str | os.PathLike, *,
               say: Callable[[str], None] | None = None,
               heartbeat_s: float = HEARTBEAT_S, stale_s: float = STALE_S):
    self.workdir = pathlib.Path(workdir).absolute()
    self.path = self.workdir / NAME
    self.say = say or (lambda s: print(s, file=sys.stderr, flush=True))
    self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
    self.held = False
    self.created_workdir = False
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._record: dict[str, Any] = {}

  def _read(self) -> dict[str, Any] | None:
    try:
      return json.loads(self.path.read_text())
    except FileNotFoundError:
      return None
    except (OSError, ValueError):
      return {}  # being written, or garbage: judged by its age

  def _stale(self, holder: dict[str, Any]) -> str | None:
    """Why ``holder``'s lock is stale, or None if it is live."""
    if not holder:
      try:
        age = time.time() - self.path.stat().st_mtime
      except FileNotFoundError:
        return 'it is gone'
      return (f'an unreadable lock file {age:.0f} s old'
              if age > self.stale_s else None)
    pid, host = holder.get('pid'), holder.get('host')
    if host == socket.gethostname():
      if isinstance(pid, int) and not _alive(pid, holder.get('started', 0)):
        return f'pid {pid} on this host is gone'
      return None
    age = time.time() - float(holder.get('heartbeat', 0))
    if age > self.stale_s:
      return (f'its heartbeat from host {host!r} is {age:.0f} s old '
              f'(> {self.stale_s:.0f} s)')
    return None

  def _write(self, flags: int) -> None:
    self._record['heartbeat'] = time.time()
    fd = os.open(self.path, flags, 0o644)
    try:
      os.write(fd, json.dumps(self._record).encode())
      os.fsync(fd)
    finally:
      os.close(fd)

  def _try_create(self) -> bool:
    try:
      self._write(os.O_WRONLY | os.O_CREAT | os.O_EXCL)
      return True
    except FileExistsError:
      return False

  def _acquire_here(self) -> str:
    """Takes the lock (this process); '' or the refusal's line."""
    if not self.workdir.exists():
      self.workdir.mkdir(parents=True, exist_ok=True)
      self.created_workdir = True
    self._record = {'host': socket.gethostname(), 'pid': os.getpid(),
                    'started': time.time(), 'argv': sys.argv[:8]}
    for _ in range(5):
      if self._try_create():
        return ''
      holder = self._read()
      if holder is None:
        continue  # released meanwhile
      why = self._stale(holder)
      if why is None:
        return (f'workdir {self.workdir} is in use by another run: '
                f'{_describe(holder)} holds {self.path}; wait for it to end, '
                'stop it, or use another --workdir')
      aside = self.path.with_name(f'{NAME}.stale.{os.getpid()}')
      try:
        os.rename(self.path, aside)
      except FileNotFoundError:
        continue  # another newcomer took it over first
      os.unlink(aside)
      if self._try_create():
        self.say(f'took over the lock of {self.workdir}: '
                 f'{_describe(holder) if holder else "its holder"} is '
                 f'stale ({why})')
        return ''
    return f'could not take the lock {self.path} (it keeps changing hands)'

  def acquire(self) -> None:
    """Takes the lock (process 0; the others learn the outcome).

    Raises:
      WorkdirLockedError: another live run holds it (named).
    """
    with preemption.critical():  # a signal waits until the lock is held
      self._acquire(jax.process_index() == 0)

  def _acquire(self, here: bool) -> None:
    refusal = self._acquire_here() if here else ''
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      refused = int(multihost_utils.broadcast_one_to_all(int(bool(refusal))))
      if refused and not refusal:
        refusal = ('workdir is in use by another run (process 0 could not '
                   'take its lock)')
    if refusal:
      self._cleanup_workdir()
      raise WorkdirLockedError(refusal)
    if jax.process_index() == 0:
      self.held = True
      self._thread = threading.Thread(target=self._beat, daemon=True,
                                      name='loc_opt-workdir-lock')
      self._thread.start()

  def _beat(self) -> None:
    while not self._stop.wait(self.heartbeat_s):
      try:
        tmp = self.path.with_name(f'{NAME}.{os.getpid()}.tmp')
        self._record['heartbeat'] = time.time()
        tmp.write_text(json.dumps(self._record))
        os.replace(tmp, self.path)
      except OSError:
        pass  # a full disk or a vanished workdir: the run reports those

  def _cleanup_workdir(self) -> None:
    """Removes the workdir if this lock created it and it is empty."""
    if self.created_workdir:
      try:
        self.workdir.rmdir()
      except OSError:
        pass

  def release(self) -> None:
    """Gives the lock back (only if this process holds it and the file is
    still its own)."""
    if not self.held:
      return
    with preemption.critical():
      self._release()

  def _release(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
    holder = self._read()
    if holder and holder.get('pid') == os.getpid() and \
        holder.get('started') == self._record.get('started'):
      try:
        self.path.unlink()
      except OSError:
        pass
    self.held = False
    if self.created_workdir and not any(self.workdir.iterdir()):
      self._cleanup_workdir()

  def __enter__(self) -> 'WorkdirLock':
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()
