"""Signals: SIGTERM (a preemption notice) and SIGINT make a run save and stop.

TPU VMs, SLURM and Kubernetes send SIGTERM some seconds before they evict a
job. The training loop asks :meth:`PreemptionWatch.reached` before each step;
when it says so, the loop saves a checkpoint at that step and stops cleanly,
and a resume continues bit for bit.

- With ``jax.distributed`` initialised (several processes) and JAX's
  preemption service on (``jax_enable_preemption_service``, the default),
  JAX's preemption sync manager catches the signal on any process, agrees
  with the others on one step (the largest step any process has reached,
  plus one) and ``jax.experimental.multihost_utils.
  reached_preemption_sync_point`` says ``True`` on every process at that
  step, so every process saves the same step. Every process must then ask at
  every step, which the loop does.
- Otherwise (one process, where that function always says ``False``), a
  Python SIGTERM handler sets a flag that the loop reads before the next
  step. It is installed only from the main thread, and the previous handler
  is put back by :meth:`PreemptionWatch.close`.

SIGINT (Ctrl-C) takes the same path: the live state (the one the loop
holds, never a buffer a step has donated) is saved at the current step and
the run stops; the launcher then exits with code 130 (128 + SIGINT), where
a SIGTERM preemption exits 0. With several processes a SIGINT is passed on
to JAX's preemption service as a SIGTERM to the same process, so every
process agrees on the step. A second SIGINT stops at once without saving
(:class:`Interrupted`, code 130).

Before the first step (reading the data, compiling, restoring) there is no
step to save at: a watch created with ``startup=True``, and
:func:`startup_signals` in the launcher, turn SIGINT and SIGTERM into
:class:`Interrupted` right away (Python runs the handler between
bytecodes, so a compile in progress ends first): one line, exit code 128 +
the signal (130, 143); nothing is half-written (a checkpoint is only
written by the loop). With several processes the same holds: JAX's
preemption service has SIGTERM (its C handler, installed by
``jax.distributed.initialize``), so on Linux the startup handler takes it
over, keeping JAX's raw ``sigaction`` to give back when training starts
(``signal.signal`` cannot put back a handler not set from Python). A
SIGTERM to the ``--local_processes`` launcher reaches every process, which
all exit 143; one to a single process ends it with 143, and the launcher
stops the others. (Left to JAX, a notice before the first step set the
sync point to call 1, which a resumed run, asking at its own step numbers,
never met: it trained on to the end.)
"""

import contextlib
import ctypes
import functools
import os
import signal
import sys
import threading
from typing import Any, Iterator

import jax
from jax.experimental import multihost_utils


class Interrupted(BaseException):
  """A signal that stops the run where nothing can be saved (startup, or a
  second SIGINT). A ``BaseException``, like ``KeyboardInterrupt``, so that
  no ``except Exception`` takes it for a failure of what it interrupted.
  ``exit_code`` is 128 + the signal's number."""

  def __init__(self, signum: int, when: str):
    self.signum, self.when = signum, when
    self.exit_code = 128 + signum
    super().__init__(
        f'interrupted by {signal.Signals(signum).name} {when}; nothing was '
        'saved by this run (run the same command to start or resume)')


# Inside critical(), a startup signal is held back until the block ends.
_critical = {'depth': 0, 'pending': []}


@contextlib.contextmanager
def critical() -> Iterator[None]:
  """A block that a signal before the first step must not cut in two
  (taking or giving back the workdir lock): :class:`Interrupted` is raised
  when it ends instead of inside it."""
  _critical['depth'] += 1
  try:
    yield
  finally:
    _critical['depth'] -= 1
    pending = _critical['pending']
    if not _critical['depth'] and pending:
      signum, when = pending[0]
      pending.clear()
      raise Interrupted(signum, when)


# The startup signals of the current startup block (see
# :func:`startup_interruption`).
_received: list[tuple[int, str]] = []


def startup_interruption() -> Interrupted | None:
  """The :class:`Interrupted` of the first signal of the current startup
  block, or None. A library whose work the signal cut may re-raise it
  wrapped in its own error (Orbax's restore does): the caller asks this to
  tell such a failure from a real one."""
  return Interrupted(*_received[0]) if _received else None


def _interrupt(signum: int, when: str) -> None:
  """Raises :class:`Interrupted`, or holds it back inside :func:`critical`."""
  _received.append((signum, when))
  if _critical['depth']:
    _critical['pending'].append((signum, when))
    return
  raise Interrupted(signum, when)


def _sync_service() -> bool:
  """Whether JAX's preemption service handles SIGTERM (several processes)."""
  return (jax.distributed.is_initialized()
          and bool(jax.config.jax_enable_preemption_service))


def _main_thread() -> bool:
  return threading.current_thread() is threading.main_thread()


# struct sigaction, read and written whole as opaque bytes (152 bytes on
# Linux x86-64 and aarch64; the rest of the buffer is left alone).
_SIGACTION_BYTES = 256
# The raw action of a handler not set from Python that _install replaced,
# per signal: JAX's preemption notifier's for SIGTERM.
_foreign: dict[int, bytes] = {}


@functools.cache
def _libc() -> Any:
  if not sys.platform.startswith('linux'):
    return None
  return ctypes.CDLL(None, use_errno=True)


def _action(signum: int) -> bytes | None:
  """The kernel's action for ``signum`` (``sigaction``), or ``None`` off
  Linux."""
  libc = _libc()
  if libc is None:
    return None
  buf = ctypes.create_string_buffer(_SIGACTION_BYTES)
  if libc.sigaction(int(signum), None, buf) != 0:
    return None
  return buf.raw


def _set_action(signum: int, action: bytes) -> None:
  buf = ctypes.create_string_buffer(action, len(action))
  if _libc().sigaction(int(signum), buf, None) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f'sigaction({signal.Signals(signum).name}) failed: '
                  f'{os.strerror(err)}')


def _handler_address(action: bytes) -> int:
  return int.from_bytes(action[:ctypes.sizeof(ctypes.c_void_p)],
                        sys.byteorder)


def _install(sigs, handler) -> dict[int, tuple[Any, bytes | None]]:
  """Sets the Python ``handler`` for ``sigs``. Returns, per signal, what
  :func:`_put_back` needs: the Python handler before and, when the one
  before was not set from Python (a C handler, as JAX's preemption
  notifier's for SIGTERM), its raw action."""
  saved = {}
  for s in sigs:
    before = _action(s)
    py = signal.signal(s, handler)
    after = _action(s)
    foreign = (before is not None and after is not None
               and _handler_address(before) not in (
                   int(signal.SIG_DFL), int(signal.SIG_IGN),
                   _handler_address(after)))
    if foreign:
      _foreign[s] = before
    saved[s] = (py, before if foreign else None)
  return saved


def _put_back(saved: dict[int, tuple[Any, bytes | None]]) -> None:
  for s, (py, action) in saved.items():
    if action is not None:
      _set_action(s, action)
    else:  # None: not set from Python; the default is closest.
      signal.signal(s, signal.SIG_DFL if py is None else py)


def _startup_signals(sync: bool) -> list[int]:
  """The signals a startup handler takes: SIGINT, and SIGTERM unless JAX's
  preemption service has it and its raw action cannot be kept (off
  Linux)."""
  take_term = not sync or _action(signal.SIGTERM) is not None
  return [signal.SIGINT] + ([signal.SIGTERM] if take_term else [])


@contextlib.contextmanager
def startup_signals(when: str = 'during startup (before the first step)'
                    ) -> Iterator[None]:
  """Inside the block, SIGINT and SIGTERM (JAX's preemption service's
  too, see the module doc) raise :class:`Interrupted` at once; the
  handlers before are put back after. Only from the main thread
  (elsewhere: nothing changes)."""
  def handler(signum, frame):
    del frame
    _interrupt(signum, when)

  previous = {}
  if _main_thread():
    _received.clear()
    previous = _install(_startup_signals(_sync_service()), handler)
  try:
    yield
  finally:
    _put_back(previous)
    if _main_thread():
      _received.clear()


class PreemptionWatch:
  """Whether a preemption notice or a SIGINT has come; ``step`` is where it
  was acted on, ``signal`` which it was (``'SIGTERM'``, ``'SIGINT'``).

  Creating one installs the SIGTERM (single process) and SIGINT handlers
  from the main thread; ``close`` puts back the ones before. With
  ``startup=True`` a signal raises :class:`Interrupted` until
  :meth:`start_training`. Also a context manager.
  """

  def __init__(self, *, startup: bool = False):
    self.step: int | None = None
    self.signal: str | None = None
    self._startup = startup
    self._signalled = False
    self._previous: dict[int, tuple[Any, bytes | None]] = {}
    self._sync = _sync_service()
    self._calls = 0  # calls of reached(): JAX's sync point counts them
    if _main_thread():
      sigs = (_startup_signals(self._sync) if startup or not self._sync
              else [signal.SIGINT])
      self._previous = _install(sigs, self._on_signal)

  def start_training(self) -> None:
    """From now on a signal is acted on at the next step (saved); with
    JAX's preemption service, SIGTERM goes back to it."""
    self._startup = False
    if self._sync and signal.SIGTERM in self._previous:
      saved = {signal.SIGTERM: self._previous.pop(signal.SIGTERM)}
      if signal.SIGTERM in _foreign:  # past any startup handler outside
        _set_action(signal.SIGTERM, _foreign[signal.SIGTERM])
      else:
        _put_back(saved)

  def _on_signal(self, signum, frame) -> None:
    del frame
    if self._startup:
      _interrupt(signum, 'during startup (before the first step)')
      return
    if signum == signal.SIGINT and self.signal == 'SIGINT':
      raise Interrupted(signum, 'twice (the second time before the save '
                        'of the first)')
    if self.signal is None or signum == signal.SIGINT:
      self.signal = signal.Signals(signum).name
    if self._sync and signum == signal.SIGINT:
      os.kill(os.getpid(), signal.SIGTERM)  # JAX's service agrees a step
    self._signalled = True

  def reached(self, step: int) -> bool:
    """Whether the run should save at ``step`` and stop (ask every step)."""
    if self._sync:
      # JAX's service sets the sync point at the largest count any process
      # passed, plus one (0 before the first call), and says True only at
      # that count: the calls are counted, not the steps, which start past
      # 1 in a resumed run and may advance by several (a window).
      self._calls += 1
      hit = multihost_utils.reached_preemption_sync_point(self._calls)
    else:
      hit = self._signalled
    if hit and self.step is None:
      self.step = step
    return hit

  @property
  def preempted(self) -> bool:
    return self.step is not None

  @property
  def exit_code(self) -> int:
    """The launcher's exit code once the run stopped here: 130 after a
    SIGINT (128 + 2), 0 after a preemption notice or none."""
    return 128 + signal.SIGINT if self.signal == 'SIGINT' else 0

  def close(self) -> None:
    """Puts back the handlers that were there before."""
    _put_back(self._previous)
    self._previous = {}

  def __enter__(self) -> 'PreemptionWatch':
    return self

  def __exit__(self, *exc) -> None:
    self.close()
