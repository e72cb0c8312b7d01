"""Preemption notices: SIGTERM makes a run save a checkpoint and stop.

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
"""

import signal
import threading
from typing import Any

import jax
from jax.experimental import multihost_utils


class PreemptionWatch:
  """Whether a preemption notice has come; ``step`` is where it was acted on.

  Creating one installs the SIGTERM handler (single process); ``close``
  removes it. Also a context manager.
  """

  def __init__(self):
    self.step: int | None = None
    self._signalled = False
    self._previous: Any = None
    self._installed = False
    self._sync = (jax.distributed.is_initialized()
                  and bool(jax.config.jax_enable_preemption_service))
    if (not self._sync
        and threading.current_thread() is threading.main_thread()):
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
      self._installed = True

  def _on_sigterm(self, signum, frame) -> None:
    del signum, frame
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

  def close(self) -> None:
    """Puts back the SIGTERM handler that was there before."""
    if self._installed:
      # None: the handler was not set from Python; the default is closest.
      signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None
                    else self._previous)
      self._installed = False

  def __enter__(self) -> 'PreemptionWatch':
    return self

  def __exit__(self, *exc) -> None:
    self.close()
