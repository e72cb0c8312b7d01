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
written by the loop). With several processes JAX's preemption service
keeps SIGTERM; a SIGTERM during startup is then acted on at the first step.
"""

import contextlib
import os
import signal
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


def _interrupt(signum: int, when: str) -> None:
  """Raises :class:`Interrupted`, or holds it back inside :func:`critical`."""
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


@contextlib.contextmanager
def startup_signals(when: str = 'during startup (before the first step)'
                    ) -> Iterator[None]:
  """Inside the block, SIGINT (and SIGTERM, unless JAX's preemption service
  has it) raise :class:`Interrupted` at once; the handlers before are put
  back after. Only from the main thread (elsewhere: nothing changes)."""
  def handler(signum, frame):
    del frame
    _interrupt(signum, when)

  previous = {}
  if _main_thread():
    sigs = [signal.SIGINT] + ([] if _sync_service() else [signal.SIGTERM])
    previous = {s: signal.signal(s, handler) for s in sigs}
  try:
    yield
  finally:
    for s, h in previous.items():
      signal.signal(s, signal.SIG_DFL if h is None else h)


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
    self._previous: dict[int, Any] = {}
    self._sync = _sync_service()
    if _main_thread():
      sigs = [signal.SIGINT] + ([] if self._sync else [signal.SIGTERM])
      self._previous = {s: signal.signal(s, self._on_signal) for s in sigs}

  def start_training(self) -> None:
    """From now on a signal is acted on at the next step (saved)."""
    self._startup = False

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
      hit = multihost_utils.reached_preemption_sync_point(step)
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
    for s, h in self._previous.items():
      # None: the handler was not set from Python; the default is closest.
      signal.signal(s, signal.SIG_DFL if h is None else h)
    self._previous = {}

  def __enter__(self) -> 'PreemptionWatch':
    return self

  def __exit__(self, *exc) -> None:
    self.close()
