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

from collections.abc import Callable, Hashable, Iterator
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax



# A sync period: an int (or an int array), or a schedule ``count -> H``.
SyncEvery = int | jax.typing.ArrayLike | Callable[[jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Plan:
  """The phase of every step of a method, decided on the host.

  Every method has one; the training loop asks it which compiled program
  runs next. It comes in two kinds:

  * a *fixed* plan, ``phase_fn: count -> phase``, for methods whose phases
    are a pure function of the step (Streaming DiLoCo's fragments, NoLoCo's
    peer groups, DES-LOC's state syncs, ...);
  * a *period* plan, ``period_fn: count -> H``, for DiLoCo and local SGD,
    whose period may follow a schedule (constant, step, QSR): the step after
    ``count`` syncs (phase ``True``) when ``steps_since_sync + 1 >=
    H(count)``, else it is an inner step (``False``). It reads the steps
    since the last sync, so a run branched from another run's checkpoint
    continues that run's sync rhythm.

  A method whose every step is the same program (data parallel) has
  :func:`no_sync_plan`.

  Attributes:
    phase_fn: ``count -> phase`` of a fixed plan (a pure function of
      ``count``; hashable results).
    inner: the phase of a step that does not communicate.
    sync_fn: ``phase -> bool``, whether a phase counts as a sync (sends
      across workers); default: every phase but ``inner``. A phase that
      only applies a result sent earlier (Streaming DiLoCo's overlapped
      outer update) is not a sync.
    period_fn: ``count -> H`` (a Python int >= 1) of a period plan.
  """

  phase_fn: Callable[[int], Hashable] | None = None
  inner: Hashable = False
  sync_fn: Callable[[Hashable], bool] | None = None
  period_fn: Callable[[int], int] | None = None

  def __post_init__(self):
    if (self.phase_fn is None) == (self.period_fn is None):
      raise ValueError('a Plan takes exactly one of phase_fn and period_fn')

  def __call__(self, count: int, steps_since_sync: int | None = None
               ) -> Hashable:
    """The phase of the step after ``count`` inner steps.

    ``steps_since_sync`` matters to period plans only; when it is not given
    it is replayed from step 0.
    """
    count = int(count)
    if self.period_fn is None:
      return self.phase_fn(count)
    if steps_since_sync is None:
      steps_since_sync = self.steps_since_sync(count)
    return steps_since_sync + 1 >= self.period_fn(count)

  def is_sync(self, phase: Hashable) -> bool:
    """Whether ``phase`` communicates across workers (counts as a sync)."""
    if self.sync_fn is not None:
      return bool(self.sync_fn(phase))
    return phase != self.inner

  def walk(self, start: int, stop: int, steps_since_sync: int = 0
           ) -> Iterator[Hashable]:
    """The phases of counts ``start .. stop - 1``, from ``steps_since_sync``
    steps since the last sync at ``start``."""
    since = steps_since_sync
    for count in range(start, stop):
      phase = self(count, since)
      yield phase
      since = 0 if self.is_sync(phase) else since + 1

  def steps_since_sync(self, count: int) -> int:
    """Steps since the last sync after ``count`` steps of a run from 0."""
    since = 0
    for phase in self.walk(0, count):
      since = 0 if self.is_sync(phase) else since + 1
    return since

  def phases(self, num_steps: int) -> tuple[Hashable, ...]:
    """The distinct phases of counts ``0 .. num_steps - 1``, the inner phase
    first, the others in order of first use. A period plan has both of its
    phases whatever the run's length (a branched run may sync earlier)."""
    if self.period_fn is not None:
      return (self.inner, True)
    seen = {self.inner: None}
    for phase in self.walk(0, num_steps):
      seen.setdefault(phase, None)
    return tuple(seen)

  def window(self, count: int, steps: int,
             steps_since_sync: int | None = None) -> tuple[Hashable, ...]:
    """The phases of an overlap window that starts with the sync at
    ``count``: that phase, then up to ``steps`` more, stopping before the
    next phase that syncs (``loc_opt.parallel.overlap_window``).

    For Streaming DiLoCo (``steps = tau``) that is the send, ``tau - 1``
    inner steps and the fragment's merge; for Eager updates and CO2
    (``steps = H``) the sync and the ``H - 1`` inner steps of the round.

    Args:
      count: inner steps taken before the window's first step.
      steps: the most steps after the first.
      steps_since_sync: as in :meth:`__call__`.

    Returns:
      A tuple of phases, the first a sync.

    Raises:
      ValueError: if the phase at ``count`` does not sync.
    """
    first = self(count, steps_since_sync)
    if not self.is_sync(first):
      raise ValueError(f'an overlap window starts with a sync; the phase '
                       f'at count {count} is {first!r}')
    phases = [first]
    for phase in self.walk(count + 1, count + 1 + steps, 0):
      if self.is_sync(phase):
        break
      phases.append(phase)
    return tuple(phases)

  def num_syncs(self, start: int, stop: int) -> int:
    """Sync steps among counts ``start .. stop - 1`` of a run from 0."""
    since = self.steps_since_sync(start)
    return sum(self.is_sync(p) for p in self.walk(start, stop, since))


def no_sync_plan() -> Plan:
  """The plan of a method that never syncs on its own (data parallel, whose
  every step is the same program): every step is the inner phase
  ``False``."""
  return Plan(lambda count: False)


def sync_period(sync_every: SyncEvery, count: jax.Array) -> jax.Array:
  """The sync period H in force at inner step ``count`` (int32)."""
  if callable(sync_every):
    return jnp.maximum(jnp.asarray(sync_every(count), jnp.int32), 1)
  return jnp.asarray(sync_every, jnp.int32)


class _Periods:
  """``count -> H`` on the host: the periods of a run's counts read once
  from the schedule (one jitted call), later counts one at a time."""

  def __init__(self, sync_every: SyncEvery, num_steps: int):
    self.sync_every = sync_every
    counts = jnp.arange(num_steps, dtype=jnp.int32)
    periods = jax.jit(lambda c: sync_period(sync_every, c))(counts)
    self.table = np.broadcast_to(np.asarray(periods), (num_steps,))

  def __call__(self, count: int) -> int:
    if count < len(self.table):
      return int(self.table[count])
    return int(sync_period(self.sync_every, jnp.int32(count)))


def period_plan(sync_every: SyncEvery, num_steps: int) -> Plan:
  """The period plan of DiLoCo-style methods for a run of ``num_steps``.

  The step after ``count`` syncs when ``steps_since_sync + 1 >= H(count)``,
  exactly as ``diloco`` decides on device and ``next_step_syncs`` on the
  host, without a device call per step: a changing period (QSR, step
  schedules) never recompiles anything.

  Args:
    sync_every: ``H``, an int or a schedule ``count -> H``.
    num_steps: the run's length; the periods of these counts are read in
      one call (the plan answers later counts too).

  Returns:
    A :class:`Plan` with phases ``False`` (inner) and ``True`` (sync); its
    ``period_fn.table`` holds the periods of counts ``0 .. num_steps - 1``.
  """
  return Plan(period_fn=_Periods(sync_every, num_steps))


def every(period: int, offset: int = 0) -> Callable[[int], bool]:
  """``count -> bool``: true on the last step of each ``period``-step round
  (counts ``offset + period - 1``, ``offset + 2 period - 1``, ...)."""
  if period <= 0:
    raise ValueError(f'period must be positive, got {period}')

  def due(count: int) -> bool:
    return count >= offset and (count - offset + 1) % period == 0

  return due


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
