"""Asynchronous Local-SGD: Delayed Nesterov and Dynamic Local Updates.

Workers of different speeds train on their own data and push their
pseudo-gradients to a parameter server whenever they finish a round; the
server applies every push at once, with no barrier, and the worker pulls the
new server parameters and starts its next round. Two fixes make this match
synchronous DiLoCo:

* **Delayed Nesterov (DN)**, :func:`delayed_nesterov` (in
  :mod:`loc_opt.outer.delayed_nesterov`, usable by any server): it applies
  each push with momentum-free SGD and folds the momentum in only once every
  ``N`` pushes, from the average of those pushes, so stale pushes do not
  compound in the momentum.
* **Dynamic Local Updates (DyLU)**, :func:`dylu_periods`: a worker of
  relative speed ``v`` runs ``floor(v H)`` inner steps per round, so all
  workers finish their rounds at about the same time.

This module *simulates* the asynchronous system inside one SPMD program
(:func:`async_local_sgd`): time advances in ticks, one tick being one step of
the fastest worker, and every worker replays the same server updates, so the
numerics of a parameter-server deployment are reproduced exactly while the
program stays a per-worker Optax transform (see :func:`async_events` for the
schedule).

References:
  Liu et al., *Asynchronous Local-SGD Training for Language Modeling*,
  2024. https://arxiv.org/abs/2401.09135
"""

from collections.abc import Hashable, Sequence
import fractions
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loc_opt import _checks
from loc_opt import compression
from loc_opt.outer import _local
from loc_opt.outer import plan as plan_lib
from loc_opt.outer.delayed_nesterov import delayed_nesterov

# Relative speeds are held as exact fractions p / q with q at most this (so
# the on-device progress counters p + (k p mod q) stay far inside int32).
_MAX_DENOMINATOR = 1_000_000


# ------------------------------------------------------- speeds and time ---
class TickEvents(NamedTuple):
  """What happens in one tick of the simulated asynchronous system.

  Attributes:
    active: workers that take an inner step this tick, in index order.
    finishing: workers that complete a round with this tick's step and push
      at the end of the tick (processed in index order).
  """

  active: tuple[int, ...]
  finishing: tuple[int, ...]


def relative_speeds(
    speeds: Sequence[float],
) -> tuple[fractions.Fraction, ...]:
  """Each worker's speed divided by the fastest one, as exact fractions.

  Speeds are in any unit (e.g. inner steps per second); the result is in
  ``(0, 1]`` with the fastest worker at 1. Each ratio is rounded to the
  nearest fraction with denominator at most 10^6 (so ``0.29`` is
  ``29/100`` and ``1/3`` stays ``1/3``).

  Raises:
    ValueError: ``speeds`` is empty or holds a non-finite or non-positive
      value.
  """
  speeds = tuple(speeds)
  if not speeds:
    raise ValueError('speeds must name at least one worker')
  for s in speeds:
    if isinstance(s, bool) or not isinstance(s, (int, float, np.number)):
      raise ValueError(f'speeds must be positive numbers, got {s!r}')
    if not math.isfinite(float(s)) or float(s) <= 0:
      raise ValueError(f'speeds must be positive and finite, got {s!r}')
  fast = fractions.Fraction(float(max(speeds)))
  return tuple(
      (fractions.Fraction(float(s)) / fast).limit_denominator(
          _MAX_DENOMINATOR) for s in speeds)


def dylu_periods(
    speeds: Sequence[float], sync_every: int, dylu: bool = True
) -> tuple[int, ...]:
  r"""Inner steps per round of each worker under Dynamic Local Updates.

  .. math:: H_w = \max(1, \lfloor v_w / \max_{w'} v_{w'} \cdot H \rfloor)

  so every worker spends about ``H`` ticks of the fastest worker per round.

  Args:
    speeds: each worker's speed (any positive unit; normalised by the max).
    sync_every: ``H``, the fastest worker's inner steps per round.
    dylu: ``False`` gives every worker ``H`` (plain asynchronous Local-SGD).

  Returns:
    ``H_w`` per worker, e.g. ``(10, 10, 10, 5)`` for speeds
    ``(1, 1, 1, 0.5)`` and ``H = 10``.

  Raises:
    ValueError: bad ``speeds`` or ``sync_every`` not a positive int.
  """
  ratios = relative_speeds(speeds)
  sync_every = _checks.positive_int(sync_every, 'sync_every', arrays=True)
  if not dylu:
    return (int(sync_every),) * len(ratios)
  return tuple(max(1, math.floor(r * int(sync_every))) for r in ratios)


def _check_periods(periods: Sequence[int], num_workers: int) -> tuple:
  periods = tuple(periods)
  if len(periods) != num_workers:
    raise ValueError(f'periods has {len(periods)} entries for '
                     f'{num_workers} workers')
  return tuple(_checks.positive_int(h, 'periods', arrays=True)
               for h in periods)


def _tick(ratios, periods, tick: int) -> TickEvents:
  """Events of tick ``tick`` (0-based), in closed form.

  A worker of relative speed ``r`` has made progress ``k r`` before tick
  ``k`` and steps on tick ``k`` when ``(k + 1) r`` crosses an integer; its
  steps after tick ``k`` are ``floor((k + 1) r)``, and it finishes a round
  when that count is a multiple of its period.
  """
  active, finishing = [], []
  for w, (r, h) in enumerate(zip(ratios, periods)):
    after = math.floor((tick + 1) * r)
    if after > math.floor(tick * r):
      active.append(w)
      if after % h == 0:
        finishing.append(w)
  return TickEvents(tuple(active), tuple(finishing))


def async_events(
    speeds: Sequence[float], periods: Sequence[int], num_ticks: int
) -> tuple[TickEvents, ...]:
  """The simulated schedule: who steps and who pushes on each tick.

  Time runs in ticks of one inner step of the fastest worker. A worker of
  relative speed ``r = v / max v`` (in ``(0, 1]``) has made progress
  ``k r`` before tick ``k`` (0-based) and takes an inner step on tick ``k``
  exactly when ``(k + 1) r`` crosses an integer, i.e. when
  ``floor((k + 1) r) > floor(k r)`` (speed 1/2 steps on ticks 1, 3, 5, ...),
  so after ``K`` ticks it has taken ``floor(K r)`` steps. It finishes a round
  (and pushes at the end of the tick) on the tick of its ``H_w``-th step of
  the round. Pushes of one tick are processed in worker-index order.

  Args:
    speeds: each worker's speed (normalised by the max).
    periods: each worker's inner steps per round (see :func:`dylu_periods`).
    num_ticks: how many ticks to list.

  Returns:
    One :class:`TickEvents` ``(active, finishing)`` per tick.
  """
  ratios = relative_speeds(speeds)
  periods = _check_periods(periods, len(ratios))
  if num_ticks < 0:
    raise ValueError(f'num_ticks must be >= 0, got {num_ticks}')
  return tuple(_tick(ratios, periods, k) for k in range(num_ticks))


def async_plan(
    speeds: Sequence[float], sync_every: int, dylu: bool = True
) -> plan_lib.Plan:
  """The host-side plan of :func:`async_local_sgd`: who pushes on each tick.

  The phase of tick ``count`` is the tuple of workers that finish a round on
  it (in index order), or ``False`` when none does: then the step has no
  cross-worker collective. Which workers take an inner step is decided on
  device from the state's counters (no communication), so the number of
  distinct programs stays small however irregular the speeds.

  Args:
    speeds: as :func:`async_local_sgd`.
    sync_every: as :func:`async_local_sgd`.
    dylu: as :func:`async_local_sgd`.

  Returns:
    A :class:`loc_opt.outer.plan.Plan` with ``inner=False``.
  """
  ratios = relative_speeds(speeds)
  periods = dylu_periods(speeds, sync_every, dylu)

  def phase(count: int) -> Hashable:
    return _tick(ratios, periods, count).finishing or False

  return plan_lib.Plan(phase, inner=False)


# ------------------------------------------------- asynchronous Local-SGD ---
class AsyncLocalSgdState(NamedTuple):
  """State of :func:`async_local_sgd` (one worker's copy).

  The server fields and the schedule counters are identical on all workers:
  each worker replays every push.

  Attributes:
    inner_state: this worker's inner optimizer state (advanced only on the
      ticks it steps; never reset).
    server_params: the server's parameters ``phi`` (tree like the params;
      dtype ``promote_types(param dtype, anchor_dtype)``, fp32 by default).
    server_state: the server's outer optimizer state, over
      ``server_params``.
    start_params: the ``phi`` this worker pulled at the start of its round
      (same tree and dtypes as ``server_params``); its pseudo-gradient is
      taken against it.
    count: int32 scalar, ticks taken.
    progress: int32 ``[M]``, every worker's progress numerator
      ``(count * p_w) mod q_w`` for relative speed ``p_w / q_w``.
    round_steps: int32 ``[M]``, inner steps of every worker in its current
      round.
    num_pushes: int32 scalar, pushes the server has applied.
    version: int32 scalar, ``num_pushes`` right after this worker's last
      pull; when its next push is applied, ``num_pushes - version`` (counted
      just before) is that push's staleness, the other workers' pushes
      applied in between.
  """

  inner_state: optax.OptState
  server_params: optax.Params
  server_state: optax.OptState
  start_params: optax.Params
  count: jax.Array
  progress: jax.Array
  round_steps: jax.Array
  num_pushes: jax.Array
  version: jax.Array


def _check_phase(sync: Any, num_workers: int) -> tuple[int, ...] | None:
  """The finishing workers of a static phase, or ``None`` for ``sync=None``."""
  if sync is None:
    return None
  if sync is False or sync == ():
    return ()
  if (not isinstance(sync, tuple) or not sync
      or any(isinstance(w, bool) or not isinstance(w, (int, np.integer))
             for w in sync)
      or list(sync) != sorted(set(sync))
      or not 0 <= sync[0] <= sync[-1] < num_workers):
    raise ValueError(
        'sync must be None, False or a sorted tuple of the finishing workers '
        f'(indices below {num_workers}), got {sync!r}')
  return tuple(int(w) for w in sync)


class _Schedule(NamedTuple):
  """Every worker's speed ``p / q`` and period, as int32 arrays ``[M]``."""

  numerators: np.ndarray
  denominators: np.ndarray
  periods: np.ndarray

  @classmethod
  def of(cls, ratios: Sequence[fractions.Fraction], periods: Sequence[int]
         ) -> '_Schedule':
    """From the exact relative speeds and the periods of the workers."""
    return cls(np.array([r.numerator for r in ratios], np.int32),
               np.array([r.denominator for r in ratios], np.int32),
               np.array(periods, np.int32))

  def tick(self, state: AsyncLocalSgdState
           ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(active [M], progress, finishing [M], round_steps)`` after this
    tick, replayed identically on every worker (no communication)."""
    reach = state.progress + self.numerators
    active = reach >= self.denominators
    progress = jnp.where(active, reach - self.denominators, reach)
    steps = state.round_steps + active.astype(jnp.int32)
    finishing = active & (steps >= self.periods)
    round_steps = jnp.where(finishing, 0, steps).astype(jnp.int32)
    return active, progress, finishing, round_steps


class _Tick(NamedTuple):
  """What a tick's push needs: the state and params before it, the inner
  updates of this tick, this worker's index and who finishes."""

  state: AsyncLocalSgdState
  params: optax.Params
  inner_updates: optax.Updates
  index: jax.Array
  finishing: jax.Array


def _apply_push(outer: optax.GradientTransformation, index: jax.Array,
                carry: tuple[Any, ...], w: Any, push_w: Any,
                applies: jax.Array | None = None) -> tuple[Any, ...]:
  """The server applies worker ``w``'s push; ``w`` pulls if it is this
  worker. ``applies`` (on device) says whether ``w`` pushes at all; ``None``
  for a static finisher."""
  phi, server_state, num_pushes, pulled, version = carry
  outer_updates, new_server_state = outer.update(push_w, server_state, phi)
  new_phi = optax.apply_updates(phi, outer_updates)
  if applies is None:  # a static finisher
    phi, server_state = new_phi, new_server_state
    num_pushes = optax.safe_increment(num_pushes)
    mine = index == w
  else:  # decided on device
    phi, server_state = jax.tree.map(
        lambda new, old: jnp.where(applies, new, old),
        (new_phi, new_server_state), (phi, server_state))
    num_pushes = num_pushes + applies.astype(jnp.int32)
    mine = applies & (index == w)
  pulled = jax.tree.map(
      lambda new, old: jnp.where(mine, new, old), phi, pulled)
  version = jnp.where(mine, num_pushes, version)
  return phi, server_state, num_pushes, pulled, version


def _push(outer: optax.GradientTransformation, comm: compression.Comm | None,
          tick: _Tick, finishers: tuple[int, ...] | None) -> tuple[Any, ...]:
  """A tick where someone finishes: every worker's pseudo-gradient is
  all-gathered and the server replays the pushes in worker order (all
  workers, masked by ``tick.finishing``, when ``finishers`` is ``None``).

  Returns:
    ``(updates, phi, server_state, start_params, num_pushes, version)``.
  """
  state = tick.state
  local = optax.apply_updates(tick.params, tick.inner_updates)
  delta = _local.pseudo_gradient(state.start_params, local)
  if comm is not None:
    gathered = comm.all_gather(delta)
  else:
    gathered = jax.tree.map(lambda d: d[None], delta)
  carry = (state.server_params, state.server_state, state.num_pushes,
           state.start_params, state.version)
  if finishers is None:  # one loop over all workers, in index order
    carry = comm.varying(carry) if comm is not None else carry
    carry, _ = jax.lax.scan(
        lambda c, xs: (_apply_push(outer, tick.index, c, *xs), None), carry,
        (jnp.arange(len(tick.finishing)), gathered, tick.finishing))
    i_finish = tick.finishing[tick.index]
  else:
    for w in finishers:
      carry = _apply_push(outer, tick.index, carry, w,
                          jax.tree.map(lambda g, w=w: g[w], gathered))
    i_finish = jnp.isin(tick.index, jnp.asarray(finishers, jnp.int32))
  phi, server_state, num_pushes, pulled, version = carry
  new_updates = jax.tree.map(
      lambda u, t: jnp.where(i_finish, t, u), tick.inner_updates,
      _local.updates_to(pulled, tick.params))
  out = (new_updates, phi, server_state, pulled, num_pushes, version)
  return out if comm is None else comm.varying(out)


def _init(inner: optax.GradientTransformation,
          outer: optax.GradientTransformation, params: optax.Params,
          anchor_dtype: Any, num_workers: int) -> AsyncLocalSgdState:
  """The initial state: the server at the params, nobody in a round."""
  anchor = _local.init_anchor(params, anchor_dtype)
  zero = jnp.zeros([], jnp.int32)
  counters = jnp.zeros([num_workers], jnp.int32)
  return AsyncLocalSgdState(
      inner_state=inner.init(params),
      server_params=anchor,
      server_state=outer.init(anchor),
      start_params=anchor,
      count=zero,
      progress=counters,
      round_steps=counters,
      num_pushes=zero,
      version=zero,
  )


def _worker_index(comm: compression.Comm | None, num_workers: int
                  ) -> jax.Array:
  """This worker's index, after checking the axis has ``num_workers``."""
  if comm is None:
    return jnp.zeros([], jnp.int32)
  size = comm.size()
  if size != num_workers:
    raise ValueError(f'speeds names {num_workers} workers but axis '
                     f'{comm.axis_name!r} has {size}')
  return comm.index()


def async_local_sgd(
    inner: optax.GradientTransformation,
    *,
    speeds: Sequence[float],
    sync_every: int,
    dylu: bool = True,
    outer: optax.GradientTransformation | None = None,
    axis_name: str | None = 'worker',
    anchor_dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
  r"""Asynchronous Local-SGD with workers of different speeds, simulated.

  Each call is one *tick* (one inner step of the fastest worker; see
  :func:`async_events`). Worker ``w`` (relative speed ``r_w``) takes an
  inner step on the ticks its progress crosses an integer and returns a zero
  update (keeping its inner state) on the others. After ``H_w`` inner steps
  (:func:`dylu_periods`) it finishes its round and pushes

  .. math:: \Delta_w = \phi_{start,w} - \theta'_w ,

  the pseudo-gradient against the server parameters it started the round
  from (``theta'`` includes this tick's inner step). The server applies the
  pushes of a tick one by one in worker order with ``outer``
  (:math:`\phi \leftarrow \phi + \mathrm{outer}(\Delta_w)`), and each
  finisher pulls the :math:`\phi` right after its own push:
  :math:`\theta_w \leftarrow \phi,\ \phi_{start,w} \leftarrow \phi`. The
  returned update is then :math:`\phi - \theta_w`, so ``optax.apply_updates``
  stays the only way the parameters change.

  Simulation: every worker holds a copy of the server (``phi`` and the outer
  state) and replays every push, so the pushes are simulated by one
  ``all_gather`` of the pseudo-gradients over ``axis_name`` on the ticks
  where someone finishes (each worker sends its fp32 pseudo-gradient once,
  see :func:`async_phase_bytes`); all other ticks move nothing across
  workers. A real deployment has no collective: a finisher pushes ``b``
  bytes per parameter up to a parameter server and pulls ``b`` back
  (:func:`push_bytes`), and the wall-clock gain of asynchrony is not
  reproduced here, only its numerics.

  The phase ``sync`` (keyword-only, static) is the tuple of workers that
  finish on this tick, or ``False`` when none does (:func:`async_plan`);
  ``sync=None`` decides on device from the state's counters with a
  ``lax.cond`` and gives the same numbers.

  Args:
    inner: the inner optimizer (e.g. ``optax.adamw(...)``); may take extra
      args.
    speeds: each worker's speed (e.g. steps per second), one per worker of
      ``axis_name`` (normalised by the max).
    sync_every: ``H``, the fastest worker's inner steps per round.
    dylu: Dynamic Local Updates: worker ``w`` runs
      ``max(1, floor(v_w / max v * H))`` inner steps per round; ``False``
      gives every worker ``H``.
    outer: the server's optimizer, fed one push per update; default
      :func:`delayed_nesterov` with learning rate 0.7, momentum 0.9,
      ``buffer_size = M`` and activation 0 (equal to DiLoCo's outer Nesterov
      step per ``M`` pushes).
    axis_name: the worker axis; ``None`` for one worker.
    anchor_dtype: the minimum precision of the server copy and of
      ``start_params`` (fp32 by default).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import optax
    >>> tx = async_local_sgd(optax.adamw(4e-4), speeds=(1., 1., 1., .5),
    ...                      sync_every=50)
    >>> plan = async_plan((1., 1., 1., .5), 50)
    >>> plan(49)
    (0, 1, 2, 3)

  References:
    Liu, Douillard, Ranzato, Szlam, Rusu, *Asynchronous Local-SGD Training
    for Language Modeling*, 2024.
  """
  _checks.transformation(inner, 'inner')
  _checks.transformation(outer, 'outer', optional=True)
  ratios = relative_speeds(speeds)
  periods = dylu_periods(speeds, sync_every, dylu)
  num_workers = len(ratios)
  if axis_name is None and num_workers != 1:
    raise ValueError(f'speeds names {num_workers} workers but axis_name is '
                     'None (one worker)')
  inner = optax.with_extra_args_support(inner)
  if outer is None:
    outer = delayed_nesterov(0.7, 0.9, buffer_size=num_workers)
  comm = compression.Comm(axis_name) if axis_name is not None else None
  schedule = _Schedule.of(ratios, periods)
  always_active = all(r == 1 for r in ratios)

  def init_fn(params):
    return _init(inner, outer, params, anchor_dtype, num_workers)

  def update_fn(updates, state, params=None, *, sync=None, **extra_args):
    inner_updates, inner_state = _local.inner_step(
        inner, 'async_local_sgd', updates, state.inner_state, params,
        extra_args)
    finishers = _check_phase(sync, num_workers)
    index = _worker_index(comm, num_workers)
    active, progress, finishing, round_steps = schedule.tick(state)
    if not always_active:
      active = active[index]
      inner_updates = jax.tree.map(
          lambda u: jnp.where(active, u, jnp.zeros_like(u)), inner_updates)
      inner_state = jax.tree.map(
          lambda new, old: jnp.where(active, new, old), inner_state,
          state.inner_state)
    tick = _Tick(state, params, inner_updates, index, finishing)

    def push(_):
      return _push(outer, comm, tick, finishers)

    def no_push(_):
      out = (inner_updates, state.server_params, state.server_state,
             state.start_params, state.num_pushes, state.version)
      return out if comm is None else comm.varying(out)

    if finishers is None:
      out = jax.lax.cond(jnp.any(finishing), push, no_push, None)
    else:
      out = push(None) if finishers else no_push(None)
    new_updates, phi, server_state, start, num_pushes, version = out
    return new_updates, AsyncLocalSgdState(
        inner_state=inner_state,
        server_params=phi,
        server_state=server_state,
        start_params=start,
        count=optax.safe_increment(state.count),
        progress=progress.astype(jnp.int32),
        round_steps=round_steps,
        num_pushes=num_pushes,
        version=version,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def async_eval_params(state: AsyncLocalSgdState, params: optax.Params) -> Any:
  """The weights to evaluate: the server parameters in params dtypes."""
  return _local.cast_like(state.server_params, params)


def push_bytes(params: Any, dtype: Any = jnp.float32) -> int:
  """Bytes of one push (and of one pull) in a parameter-server deployment:
  one pseudo-gradient (resp. the server parameters) at ``dtype``."""
  return _local.pseudo_gradient_bytes(params, dtype)


def async_phase_bytes(
    params: Any, phase: Hashable, dtype: Any = jnp.float32
) -> int:
  """Cross-worker bytes one worker sends in a phase of the simulation.

  ``0`` for ``False`` (nobody finishes); otherwise the all-gather of the
  pseudo-gradients, in which every worker sends its own once
  (:func:`push_bytes`), whoever finishes.
  """
  return 0 if not phase else push_bytes(params, dtype)
