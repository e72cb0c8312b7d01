"""Host-side plans: which static program each step of a method runs.

Local-update methods talk across workers on a few steps only, and what they
send differs between those steps (Streaming DiLoCo sends one fragment at a
time, NoLoCo exchanges with a peer that changes every round, DES-LOC syncs
parameters and each optimizer moment on its own period). Each method's
``update`` therefore takes a keyword-only, static ``sync`` argument, the
*phase* of the step: a hashable value naming what the step does (``False``:
an inner step with no cross-worker communication). Each distinct phase is
traced to its own program, so the compiled inner step provably moves zero
cross-worker bytes and each sync program moves exactly its payload.

A :class:`Plan` is the host-side function ``count -> phase`` (``count`` = the
inner steps taken before the step) that a training loop uses to pick the
program, without reading device memory. ``update(..., sync=None)`` decides
the same thing on device from the state's counters (one program with
``lax.cond`` / ``lax.switch``); both give the same numbers.

:func:`branch` and :func:`advance` are the device-side pieces the methods
share: run a step's sync or inner branch, and move the step counters.
"""

from collections.abc import Callable, Hashable
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class Plan:
  """The phase of every step of a method, decided on the host.

  Attributes:
    phase_fn: ``count -> phase``, the phase of the step taken after
      ``count`` inner steps (a pure function of ``count``; hashable
      results).
    inner: the phase of a step that does not communicate.
    sync_fn: ``phase -> bool``, whether a phase counts as a sync (sends
      across workers); default: every phase but ``inner``. A phase that
      only applies a result sent earlier (Streaming DiLoCo's overlapped
      outer update) is not a sync.
  """

  phase_fn: Callable[[int], Hashable]
  inner: Hashable = False
  sync_fn: Callable[[Hashable], bool] | None = None

  def __call__(self, count: int) -> Hashable:
    return self.phase_fn(int(count))

  def is_sync(self, phase: Hashable) -> bool:
    """Whether ``phase`` communicates across workers (counts as a sync)."""
    if self.sync_fn is not None:
      return bool(self.sync_fn(phase))
    return phase != self.inner

  def phases(self, num_steps: int) -> tuple[Hashable, ...]:
    """The distinct phases of counts ``0 .. num_steps - 1``, the inner phase
    first, the others in order of first use."""
    seen = {self.inner: None}
    for count in range(num_steps):
      seen.setdefault(self(count), None)
    return tuple(seen)

  def num_syncs(self, start: int, stop: int) -> int:
    """Sync steps among counts ``start .. stop - 1``."""
    return sum(self.is_sync(self(c)) for c in range(start, stop))


def every(period: int, offset: int = 0) -> Callable[[int], bool]:
  """``count -> bool``: true on the last step of each ``period``-step round
  (counts ``offset + period - 1``, ``offset + 2 period - 1``, ...)."""
  if period <= 0:
    raise ValueError(f'period must be positive, got {period}')

  def due(count: int) -> bool:
    return count >= offset and (count - offset + 1) % period == 0

  return due


def check_period(value: Any, name: str = 'sync_every') -> int:
  """``value`` if it is a positive Python int, else a ``ValueError`` naming
  ``name``."""
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ValueError(f'{name} must be a positive int, got {value!r}')
  return value


def branch(sync: Any, due: Callable[[], jax.Array],
           on_sync: Callable[[], Any], on_inner: Callable[[], Any]) -> Any:
  """Runs the sync or the inner branch of a two-phase step.

  Args:
    sync: the static phase: ``None`` decides on device from ``due()``;
      otherwise a truthy phase runs ``on_sync`` and a falsy one ``on_inner``
      (traced alone, so the inner program holds no collective).
    due: ``() -> bool`` array, whether this step syncs (read only when
      ``sync is None``).
    on_sync: ``() -> outputs`` of a sync step.
    on_inner: ``() -> outputs`` of an inner step, typed like ``on_sync``'s.

  Returns:
    The branch's outputs. With ``sync=None`` under a trace this is a
    ``lax.cond``; outside one (an eager call with concrete counters) only
    the due branch runs, since an eager ``cond`` compiles both.
  """
  if sync is not None:
    return on_sync() if sync else on_inner()
  flag = due()
  if isinstance(flag, jax.core.Tracer):
    return jax.lax.cond(flag, lambda _: on_sync(), lambda _: on_inner(), None)
  return on_sync() if bool(flag) else on_inner()


def advance(count: jax.Array, steps_since_sync: jax.Array,
            num_syncs: jax.Array, synced: jax.Array
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The counters after a step: ``(count + 1, steps since the last sync,
  syncs)``; ``synced`` is an int32 0 / 1 scalar."""
  since = jnp.where(synced > 0, 0, optax.safe_increment(steps_since_sync))
  return (optax.safe_increment(count), since.astype(jnp.int32),
          num_syncs + synced)
