"""Streaming DiLoCo: sync one fragment of the model at a time, overlapped.

The parameters are split into ``P`` fragments (groups of transformer blocks;
with scanned layers, groups of rows of the stacked leaves).
Each fragment is still synced once per ``H`` inner steps, as in DiLoCo, but
the fragments take turns at evenly spread offsets, so at most ``1 / P`` of
the model crosses workers on any step: the peak bandwidth drops ``P``-fold
while the total stays that of DiLoCo. A fragment's outer update may land
``tau`` inner steps after its pseudo-gradient was sent (the all-reduce then
overlaps ``tau`` steps of compute); the worker blends its current local
fragment with the new global one.

Here the all-reduce runs on the step that sends and its result waits in an
in-flight buffer for ``tau`` steps: the numerics of overlap, not its speed.

References:
  Douillard et al., *Streaming DiLoCo with overlapping communication: Towards a
  Distributed Free Lunch*, 2025. https://arxiv.org/abs/2501.18512
"""

from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loc_opt import _checks
from loc_opt import compression
from loc_opt.outer import _fragments
from loc_opt.outer import _local
from loc_opt.outer import plan as plan_lib
from loc_opt.outer import robust
from loc_opt.outer._fragments import fragment_bytes  # noqa: F401
from loc_opt.outer._fragments import default_fragments  # noqa: F401
from loc_opt.outer._fragments import fragment_ids  # noqa: F401
from loc_opt.outer._fragments import FragmentFn
from loc_opt.outer._fragments import PATTERNS  # noqa: F401

Phase = Hashable



class StreamingDilocoState(NamedTuple):
  """State of :func:`streaming_diloco` (one worker's copy).

  Attributes:
    inner_state: the inner optimizer's state, never averaged or reset.
    anchor: the outer parameters ``phi`` (same tree as the params; dtype
      ``promote_types(param dtype, anchor_dtype)``, fp32 by default).
    outer_state: tuple of ``P`` outer optimizer states, entry ``p`` over the
      list of fragment ``p``'s anchor pieces (in tree-flatten order; a piece
      is a whole leaf, or a stacked leaf's rows in the fragment).
    in_flight: tuple of ``P`` lists (fragment ``p``'s pieces, anchor dtypes):
      the last averaged pseudo-gradient of each fragment, waiting ``tau``
      steps to be applied; ``()`` when ``overlap == 0``.
    count: int32 scalar, inner steps taken.
    sends: int32 ``[P]``, syncs started (pseudo-gradients sent) per fragment.
    applies: int32 ``[P]``, outer updates applied per fragment.
    codec_state: tuple of ``P`` per-fragment compressor states (error
      buffers, kept across syncs) over the fragment's tensors (each row of
      a stacked piece on its own); ``()`` without a codec.
    left_out: int32 scalar, sends this worker was left out of the mean.
  """

  inner_state: optax.OptState
  anchor: optax.Params
  outer_state: tuple[optax.OptState, ...]
  in_flight: tuple[list[jax.Array], ...] | tuple[()]
  count: jax.Array
  sends: jax.Array
  applies: jax.Array
  codec_state: Any = ()
  left_out: Any = 0


# ------------------------------------------------------------- schedule ---
def _check_schedule(sync_every: int, num_fragments: int, overlap: int
                    ) -> None:
  _checks.positive_int(sync_every, 'sync_every')
  _checks.positive_int(num_fragments, 'num_fragments')
  if sync_every % num_fragments:
    raise ValueError(
        f'sync_every={sync_every} must be a multiple of num_fragments='
        f'{num_fragments} (fragments sync every sync_every / num_fragments '
        'steps; it is not rounded)')
  if isinstance(overlap, bool) or not isinstance(overlap, int):
    raise ValueError(f'overlap must be an int, got {overlap!r}')
  if not 0 <= overlap < sync_every // num_fragments:
    raise ValueError(
        f'overlap must satisfy 0 <= overlap < sync_every / num_fragments = '
        f'{sync_every // num_fragments}, got {overlap}')


def _phase(count: int, sync_every: int, num_fragments: int, overlap: int
           ) -> Phase:
  t = count + 1
  stride = sync_every // num_fragments
  send = (t % sync_every) // stride if t % stride == 0 else None
  if overlap == 0:
    apply = send
  else:
    u = t - overlap
    apply = ((u % sync_every) // stride
             if u >= stride and u % stride == 0 else None)
  if send is None and apply is None:
    return False
  return (send, apply)


def streaming_plan(sync_every: int, num_fragments: int, overlap: int = 1
                   ) -> plan_lib.Plan:
  """The host-side plan of :func:`streaming_diloco`.

  With ``S = H / P`` and ``t = count + 1``, fragment ``p`` sends on steps
  ``t = p S + k H`` (``t >= 1``) and applies ``tau`` steps later. The phase
  is ``False`` for an inner step, else ``(send, apply)``: the fragment whose
  pseudo-gradient is averaged on this step and the fragment whose outer
  update lands on it (either may be ``None``; with ``tau = 0`` both are the
  same fragment). Only phases that send count as syncs
  (``Plan.is_sync``); an apply-only phase moves nothing across workers.

  Args:
    sync_every: ``H``, a multiple of ``num_fragments``.
    num_fragments: ``P``.
    overlap: ``tau``, with ``0 <= tau < H / P`` (default 1, as
      :func:`streaming_diloco`).

  Returns:
    A :class:`loc_opt.outer.plan.Plan`.
  """
  _check_schedule(sync_every, num_fragments, overlap)
  return plan_lib.Plan(
      lambda count: _phase(count, sync_every, num_fragments, overlap),
      sync_fn=lambda phase: phase is not False and phase[0] is not None)


# ------------------------------------------------------------ transform ---
class _Config(NamedTuple):
  """The static settings of one :func:`streaming_diloco` transform."""

  num_fragments: int
  sync_every: int
  overlap: int
  alpha: float
  outer: optax.GradientTransformation
  compressor: compression.Compressor | None
  comm: compression.Comm | None
  codec_seed: int
  average: Any = _local.guarded_mean  # loc_opt.outer.robust.averager

  def varying(self, tree: Any) -> Any:
    return _local.varying_fn(self.comm)(tree)


def _init(cfg: _Config, inner: optax.GradientTransformation,
          params: optax.Params, groups: list[list[_fragments.Piece]],
          anchor_dtype: Any) -> StreamingDilocoState:
  """The initial state: one outer state (and in-flight buffer, and codec
  state) per fragment, over the list of its anchor pieces."""
  anchor, parts = _fragments.anchor_parts(params, groups, anchor_dtype)
  zeros = jnp.zeros([cfg.num_fragments], jnp.int32)
  return StreamingDilocoState(
      inner_state=inner.init(params),
      anchor=anchor,
      outer_state=tuple(cfg.outer.init(part) for part in parts),
      in_flight=(tuple([jnp.zeros_like(x) for x in part] for part in parts)
                 if cfg.overlap else ()),
      count=jnp.zeros([], jnp.int32),
      sends=zeros,
      applies=zeros,
      codec_state=(() if cfg.compressor is None else
                   tuple(cfg.compressor.init(_fragments.tensors(g, part))
                         for g, part in zip(groups, parts))),
      left_out=jnp.zeros([], jnp.int32),
  )


class _Step:
  """One update: its settings, the state, each fragment's pieces, and the
  leaves of the params, the inner updates and the anchor (tree-flatten
  order)."""

  def __init__(self, cfg: _Config, state: StreamingDilocoState,
               groups: list[list[_fragments.Piece]], params: optax.Params,
               inner_updates: optax.Updates, present: jax.Array | None):
    self.cfg, self.state, self.groups = cfg, state, groups
    self.present = present
    self.p_leaves, self.treedef = jax.tree.flatten(params)
    self.u_leaves = self.treedef.flatten_up_to(inner_updates)
    self.a_leaves = jax.tree.leaves(state.anchor)

  def local(self, piece: _fragments.Piece) -> jax.Array:
    """``theta' = theta + u`` of ``piece``, in params dtype."""
    i, rows = piece
    return optax.apply_updates(_fragments.take(self.p_leaves[i], rows),
                               _fragments.take(self.u_leaves[i], rows))

  def anchor(self, piece: _fragments.Piece) -> jax.Array:
    """The anchor ``phi`` of ``piece``."""
    return _fragments.take(self.a_leaves[piece.leaf], piece.rows)

  def mean_delta(self, p: int, codec_states: Any
                 ) -> tuple[list[Any], Any, jax.Array]:
    """Fragment ``p``'s mean (``_local.guarded_mean``), the codec states
    with fragment ``p``'s updated, and whether this worker entered it."""
    cfg, group = self.cfg, self.groups[p]
    delta = _local.pseudo_gradient([self.anchor(pc) for pc in group],
                                   [self.local(pc) for pc in group])
    state = () if cfg.compressor is None else codec_states[p]
    if cfg.compressor is not None:  # one tensor per block of stacked rows
      delta = _fragments.tensors(group, delta)
    mean, _, cs, included = cfg.average(
        delta, state, self.present, compressor=cfg.compressor,
        comm=cfg.comm, seed=cfg.codec_seed, index=self.state.count,
        mean_fn=_local.identity if cfg.comm is None else cfg.comm.pmean)
    if cfg.compressor is not None:
      mean = _fragments.from_tensors(
          group, [self.anchor(pc) for pc in group], mean)
      codec_states = codec_states[:p] + (cs,) + codec_states[p + 1:]
    return mean, codec_states, included

  def run(self, send: int | None, apply: int | None) -> tuple[Any, ...]:
    """The new (updates, anchor, outer, in_flight, codec, sends, applies)
    leaves of the phase ``(send, apply)``."""
    cfg, state = self.cfg, self.state
    out_u, anchor = list(self.u_leaves), list(self.a_leaves)
    outer_state, in_flight = state.outer_state, state.in_flight
    codec_states = state.codec_state
    sends, applies = state.sends, state.applies
    mean, left_out = None, state.left_out
    if send is not None:
      mean, codec_states, included = self.mean_delta(send, codec_states)
      left_out = left_out + jnp.logical_not(included).astype(jnp.int32)
      sends = sends + jax.nn.one_hot(send, cfg.num_fragments,
                                     dtype=jnp.int32)
      if cfg.overlap:
        in_flight = (in_flight[:send] + (mean,) + in_flight[send + 1:])
    if apply is not None:
      if cfg.overlap:
        mean = state.in_flight[apply]
      group = self.groups[apply]
      part = [self.anchor(pc) for pc in group]
      outer_updates, new_outer = cfg.outer.update(
          mean, outer_state[apply], part)
      part = optax.apply_updates(part, outer_updates)
      outer_state = (outer_state[:apply] + (new_outer,)
                     + outer_state[apply + 1:])
      for (i, rows), a in zip(group, part):
        anchor[i] = _fragments.put(anchor[i], rows, a)
        target = a
        if cfg.alpha:
          target = (cfg.alpha * self.local((i, rows)).astype(a.dtype)
                    + (1 - cfg.alpha) * a)
        out_u[i] = _fragments.put(out_u[i], rows, _local.updates_to(
            target, _fragments.take(self.p_leaves[i], rows)))
      applies = applies + jax.nn.one_hot(apply, cfg.num_fragments,
                                         dtype=jnp.int32)
    return cfg.varying((out_u, anchor, outer_state, in_flight, codec_states,
                        sends, applies, left_out))


def _switch(step: _Step) -> tuple[Any, ...]:
  """:meth:`_Step.run` of the phase due at ``state.count``, chosen on
  device with ``lax.switch`` over every phase of the method."""
  cfg = step.cfg
  p_count, overlap = cfg.num_fragments, cfg.overlap
  stride = cfg.sync_every // p_count
  phases = [False] + [(p, p) if not overlap else (p, None)
                      for p in range(p_count)]
  if overlap:
    phases += [(None, p) for p in range(p_count)]
  t = step.state.count + 1
  send_due = t % stride == 0
  index = jnp.where(send_due, 1 + (t % cfg.sync_every) // stride, 0)
  if overlap:
    u = t - overlap
    apply_due = (u >= stride) & (u % stride == 0)
    index = jnp.where(
        apply_due, 1 + p_count + (u % cfg.sync_every) // stride, index)
  branches = [
      (lambda _, ph=ph: step.run(None, None) if ph is False
       else step.run(*ph)) for ph in phases]
  return jax.lax.switch(index, branches, None)


def streaming_diloco(
    inner: optax.GradientTransformation,
    *,
    sync_every: int,
    num_fragments: int | None = None,
    fragments: Any | FragmentFn | None = None,
    overlap: int = 1,
    alpha: float | None = None,
    outer: optax.GradientTransformation | None = None,
    axis_name: str | None = 'worker',
    anchor_dtype: Any = jnp.float32,
    codec: compression.Scheme = None,
    codec_seed: int = 0,
    aggregate: str = 'mean',
    trim: int = 1,
    clip_multiple: float = 1.0,
) -> optax.GradientTransformationExtraArgs:
  r"""Streaming DiLoCo: DiLoCo syncing one fragment at a time, overlapped.

  The parameters are split into fragments ``p = 0 .. P-1``; with ``S = H /
  P``, fragment ``p`` starts a sync on steps ``t = p S + k H`` (``t`` =
  inner steps taken, this one included). There, after the inner update,

  .. math::

    \bar\Delta_p = \operatorname{mean}_{workers}(\phi_p - \theta'_p),

  sent through ``codec`` if given (e.g. FP4 E3M0), accumulated in fp32.
  ``tau`` steps later (the same step when ``tau = 0``) the outer optimizer
  updates that fragment only, with its own slice of outer state, and the
  worker blends its *current* local fragment (which has taken ``tau`` more
  inner steps) with the new global one:

  .. math::

    \phi_p \leftarrow \phi_p + \mathrm{outer}_p(\bar\Delta_p), \quad
    \theta_p \leftarrow \alpha\, \theta'_p + (1 - \alpha)\, \phi_p .

  The returned update is ``target - params`` on the applied fragment and the
  inner update elsewhere, so ``optax.apply_updates`` stays the only way the
  parameters change. Each fragment crosses workers once per ``H`` steps, so
  the total bytes equal DiLoCo's while the peak is ``1 / P`` of it. With
  ``P = 1``, ``tau = 0`` this is :func:`loc_opt.diloco`.

  The all-reduce of a fragment runs on its send step; with ``tau > 0`` its
  result waits in ``state.in_flight`` (the numerics of overlap, not its
  speed, in one synchronous program).

  ``update(..., sync=None)`` picks the step's phase from ``state.count`` with
  ``lax.switch``; a loop may instead pass the static phase
  ``streaming_plan(H, P, tau)(count)`` (``False`` or ``(send, apply)``), so
  each phase compiles to its own program and inner steps move no
  cross-worker bytes.

  ``update(..., present=False)`` on a send step, or a non-finite fragment,
  leaves the worker out of that mean (as :func:`loc_opt.diloco`).

  Args:
    inner: the inner optimizer (e.g. ``optax.adamw(...)``); may take extra
      args.
    sync_every: ``H``, inner steps between two syncs of the same fragment; a
      multiple of the number of fragments.
    num_fragments: ``P``. Required unless ``fragments`` is a tree of ints.
    fragments: which fragment each leaf belongs to: a tree with the
      params' structure whose entry for a leaf is an int, or for a stacked
      leaf ``[L, ...]`` (scanned layers) a tuple of ``L`` ints, one per row;
      or ``(key_path, leaf) -> int | tuple``; default: for params with
      numbered blocks (``layer_<i>`` or stacked ``layers/``)
      ``fragment_ids(params, num_fragments)`` (strided blocks, stacked rows
      placed as blocks, non-block leaves apart), for any other pytree
      ``balanced_fragments(params, num_fragments)`` (whole leaves
      bin-packed by size).
    overlap: ``tau``, inner steps between a fragment's send and its outer
      update, ``0 <= tau < H / P``; default 1, the paper's headline setting
      (a sync may take as long as one inner step). 0: no overlap.
    alpha: the weight of the local fragment in the blend; default 0.5 when
      ``tau > 0`` (the paper's choice), else 0 (replace by the global value).
    outer: the outer optimizer (default :func:`loc_opt.outer.nesterov_outer`, lr
      0.7, Nesterov 0.9); it only ever sees one fragment's leaves.
    axis_name: the worker axis to average over; ``None`` for one worker.
    anchor_dtype: the minimum precision of the anchor, the outer state and
      the in-flight buffers.
    codec: compress the pseudo-gradients: a ``loc_opt.compression`` codec
      or compressor or its name, e.g. ``('fp4_e3m0', {'block_size':
      None})`` (one fp32 absmax scale per tensor of the fragment, the
      spec's default; each block of a stacked leaf counts as a tensor).
      Each fragment keeps its own compressor state across syncs.
    codec_seed: seed of the key shared by all workers on each send (folded
      with the step count), for codecs that draw random numbers.
    aggregate: how a fragment's pseudo-gradients are combined, with
      ``trim`` and ``clip_multiple``: see :func:`loc_opt.diloco` and
      :mod:`loc_opt.outer.robust`.
    trim: ``'trimmed_mean'``: values dropped at each end per coordinate.
    clip_multiple: ``'norm_clipped_mean'``: the bound, a multiple of the
      median norm (of the fragment's pseudo-gradients).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Raises:
    ValueError: if ``sync_every`` is not a multiple of ``num_fragments``,
      ``overlap`` is out of range, or a fragment is empty.

  Example:
    >>> import optax
    >>> import loc_opt
    >>> tx = loc_opt.streaming_diloco(
    ...     optax.adamw(4e-4), sync_every=100, num_fragments=4, overlap=1)

  References:
    Douillard et al., *Streaming DiLoCo with overlapping communication:
    Towards a Distributed Free Lunch*, 2025.
  """
  _checks.transformation(inner, 'inner')
  _checks.transformation(outer, 'outer', optional=True)
  p_count = _fragments.num_fragments_of(num_fragments, fragments)
  _check_schedule(sync_every, p_count, overlap)
  if alpha is None:
    alpha = 0.5 if overlap > 0 else 0.0
  alpha = _checks.in_interval(alpha, 'alpha', 0, 1)
  if codec is not None and axis_name is None:
    raise ValueError('streaming_diloco with a codec needs an axis_name')
  robust.check(aggregate, trim=trim, clip_multiple=clip_multiple,
               codec=codec)
  inner = optax.with_extra_args_support(inner)
  cfg = _Config(
      num_fragments=p_count, sync_every=sync_every, overlap=overlap,
      alpha=alpha, outer=_local.nesterov_outer() if outer is None else outer,
      compressor=(None if codec is None or aggregate in robust.GATHERED
                  else compression.as_compressor(codec)),
      comm=compression.Comm(axis_name) if axis_name is not None else None,
      codec_seed=codec_seed, average=robust.averager(
          aggregate, trim=trim, clip_multiple=clip_multiple,
          codec=codec if aggregate in robust.GATHERED else None))

  def split(params):
    return _fragments.pieces(
        _fragments.leaf_fragments(params, fragments, p_count), p_count)

  def init_fn(params):
    return _init(cfg, inner, params, split(params), anchor_dtype)

  def update_fn(updates, state, params=None, *, sync=None, present=None,
                **extra_args):
    inner_updates, inner_state = _local.inner_step(
        inner, 'streaming_diloco', updates, state.inner_state, params,
        extra_args)
    step = _Step(cfg, state, split(params), params, inner_updates, present)
    if sync is None:
      out = _switch(step)
    else:
      out = step.run(*_check_phase(sync, p_count, overlap))
    (out_u, anchor, outer_state, in_flight, codec_states, sends, applies,
     left_out) = out
    new_state = StreamingDilocoState(
        inner_state=inner_state,
        anchor=step.treedef.unflatten(anchor),
        outer_state=outer_state,
        in_flight=in_flight,
        count=optax.safe_increment(state.count),
        sends=sends,
        applies=applies,
        codec_state=codec_states,
        left_out=left_out,
    )
    return step.treedef.unflatten(out_u), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_phase(sync: Phase, num_fragments: int, overlap: int
                 ) -> tuple[int | None, int | None]:
  """``(send, apply)`` of a static phase; ``False`` is ``(None, None)``."""
  if sync is False:
    return None, None
  ok = isinstance(sync, tuple) and len(sync) == 2 and all(
      f is None or (isinstance(f, int) and not isinstance(f, bool)
                    and 0 <= f < num_fragments) for f in sync)
  if ok:
    send, apply = sync
    if overlap:
      ok = (send is None) != (apply is None)
    else:
      ok = send is not None and send == apply
  if not ok:
    raise ValueError(
        f'sync must be None, False or a phase (send, apply) of '
        f'streaming_plan(..., num_fragments={num_fragments}, '
        f'overlap={overlap}), got {sync!r}')
  return sync


def streaming_eval_params(state: StreamingDilocoState, params: optax.Params
                          ) -> Any:
  """The weights to evaluate: the anchor ``phi`` in params dtypes.

  Each fragment of the anchor holds the outer parameters of its last applied
  sync (Streaming DiLoCo, Table 3, evaluates the outer parameters).
  """
  return _local.cast_like(state.anchor, params)
