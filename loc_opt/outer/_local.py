"""The local-update skeleton shared by DiLoCo and its family.

Every local-update method keeps outer parameters, the *anchor* ``phi``,
beside each worker's local parameters ``theta``. Each step runs the inner
optimizer; on a sync step the worker forms its local parameters after the
inner update, ``theta' = theta + u``, and its pseudo-gradient
``phi - theta'`` (a descent direction, handed to an outer optimizer as its
gradient), and the step's update lands the worker on its new parameters
(``target - theta``), so that ``optax.apply_updates`` stays the only way
parameters change.

This module holds those pieces (:func:`init_anchor`, :func:`pseudo_gradient`,
:func:`updates_to`, the counters, the mean over workers, :func:`nesterov_outer`)
and :func:`periodic_init` / :func:`periodic_update`, the init and step of the
methods that sync every ``H`` inner steps (DiLoCo, Eager updates, EDiT, CO2,
NoLoCo, SparseLoCo): the inner step, the choice between the sync and the
inner branch (a static phase, or ``lax.cond`` on the counters) and the
counters' advance. Each method supplies only its sync branch; Streaming
DiLoCo, DES-LOC and asynchronous local SGD, whose steps differ, use the
pieces.

References:
  Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen,
  *DiLoCo: Distributed Low-Communication Training of Language Models*, 2023.
  https://arxiv.org/abs/2311.08105
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from loc_opt import compression
from loc_opt.outer import plan as plan_lib

# ``sync_step(state, params, local, payload) -> (updates, new fields)``.
SyncStep = Callable[[Any, optax.Params, optax.Params, Any],
                    tuple[optax.Updates, dict[str, Any]]]


# --------------------------------------------------------------- pieces ---
def init_anchor(params: optax.Params, anchor_dtype: Any = jnp.float32
                ) -> optax.Params:
  """The outer parameters at initialisation: a copy of ``params`` in at
  least ``anchor_dtype`` (``promote_types(param dtype, anchor_dtype)``)."""
  return jax.tree.map(
      lambda p: jnp.asarray(p, jnp.promote_types(p.dtype, anchor_dtype)),
      params)


def nesterov_outer(
    learning_rate: float = 0.7, momentum: float = 0.9
) -> optax.GradientTransformation:
  """The DiLoCo outer optimizer: SGD with Nesterov momentum (lr 0.7, mu 0.9).

  ``v <- mu v + g;  phi <- phi - lr (g + mu v)``, as ``optax.sgd(...,
  nesterov=True)``.
  """
  return optax.sgd(learning_rate, momentum=momentum, nesterov=True)


def pseudo_gradient(anchor: optax.Params, local: optax.Params
                    ) -> optax.Params:
  """``anchor - local`` in the anchor's dtypes: the descent direction that
  the outer optimizer takes as its gradient."""
  return jax.tree.map(lambda a, x: a - x.astype(a.dtype), anchor, local)


def updates_to(target: Any, params: optax.Params) -> optax.Updates:
  """The update (in the params' dtypes) that moves ``params`` to ``target``:
  ``target - params``, computed in the target's dtypes."""
  return jax.tree.map(lambda t, p: (t - p.astype(t.dtype)).astype(p.dtype),
                      target, params)


def cast_like(tree: Any, params: optax.Params) -> Any:
  """``tree`` (e.g. the anchor) in the params' dtypes: the weights that the
  ``*_eval_params`` functions return."""
  return jax.tree.map(lambda a, p: a.astype(p.dtype), tree, params)


def num_params(params: Any) -> int:
  """Elements in a tree of arrays or ``jax.ShapeDtypeStruct``."""
  return sum(int(x.size) for x in jax.tree.leaves(params))


def pseudo_gradient_bytes(
    params: Any, dtype: Any = jnp.float32,
    codec: compression.Scheme = None) -> int:
  """Bytes one worker sends per sync: its pseudo-gradient at ``dtype``, or
  the payload of ``codec`` when given."""
  if codec is not None:
    return compression.as_compressor(codec).payload_bytes(params)
  return num_params(params) * jnp.dtype(dtype).itemsize


def identity(tree: Any) -> Any:
  """``tree`` itself: the mean over one worker, or ``varying`` off a mesh."""
  return tree


def zero_counters() -> dict[str, jax.Array]:
  """The initial ``count``, ``steps_since_sync`` and ``num_syncs`` (int32
  zeros) of a method's state."""
  zero = jnp.zeros([], jnp.int32)
  return dict(count=zero, steps_since_sync=zero, num_syncs=zero)


def varying_fn(comm: compression.Comm | None) -> Callable[[Any], Any]:
  """``comm.varying`` (marks values as per-worker inside ``shard_map``), or
  the identity without a worker axis."""
  return comm.varying if comm is not None else identity


def inner_step(inner: optax.GradientTransformationExtraArgs, name: str,
               updates: optax.Updates, inner_state: optax.OptState,
               params: optax.Params | None, extra_args: dict[str, Any]
               ) -> tuple[optax.Updates, optax.OptState]:
  """The inner optimizer's update; ``name`` names the method in the error
  raised when ``params`` are missing (every local method needs them)."""
  if params is None:
    raise ValueError(f'{name} needs params: call update(updates, state, '
                     'params)')
  return inner.update(updates, inner_state, params, **extra_args)


def codec_mean(compressor: compression.Compressor,
               comm: compression.Comm, seed: int, index: jax.Array,
               delta: Any, codec_state: Any) -> tuple[Any, Any, Any]:
  """The mean over workers of ``delta`` through ``compressor``.

  The key shared by all workers is ``fold_in(key(seed), index)``.

  Returns:
    ``(mean, sent, codec_state)``: the mean and this worker's contribution
    to it (after compression), both in ``delta``'s dtypes, and the
    compressor's new state (typed per-worker inside ``shard_map``).
  """
  key = jax.random.fold_in(jax.random.key(seed), index)
  mean, sent, codec_state = compressor.mean(delta, codec_state, comm, key)

  def cast(tree):
    return jax.tree.map(lambda m, d: m.astype(d.dtype), tree, delta)

  # e.g. PowerSGD's all-reduced query: typed like the per-worker state.
  return cast(mean), cast(sent), comm.varying(codec_state)


def worker_mean(delta: Any, codec_state: Any, *,
                compressor: compression.Compressor | None,
                comm: compression.Comm | None, seed: int, index: jax.Array,
                mean_fn: Callable[[Any], Any]) -> tuple[Any, Any, Any]:
  """The mean over workers of the pseudo-gradient ``delta``.

  Through ``compressor`` when there is one (:func:`codec_mean`, key folded
  with ``index``), else ``mean_fn(delta)`` (e.g. ``lax.pmean`` over the
  worker axis).

  Returns:
    ``(mean, sent, codec_state)``; ``sent`` is ``delta`` as it entered the
    mean.
  """
  if compressor is not None:
    return codec_mean(compressor, comm, seed, index, delta, codec_state)
  return mean_fn(delta), delta, codec_state


def all_finite(tree: Any) -> jax.Array:
  """Whether every element of every float leaf of ``tree`` is finite."""
  flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
           if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def select_leaf(pred: jax.Array, new: jax.Array, old: jax.Array
                ) -> jax.Array:
  """``new`` where ``pred`` else ``old`` (PRNG keys through their data)."""
  if jnp.issubdtype(new.dtype, jax.dtypes.prng_key):
    data = jnp.where(pred, jax.random.key_data(new), jax.random.key_data(old))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(new))
  return jnp.where(pred, new, old)


def _select(pred: jax.Array, new: Any, old: Any) -> Any:
  """:func:`select_leaf` over two trees."""
  return jax.tree.map(lambda n, o: select_leaf(pred, n, o), new, old)


def present_mean(delta: Any, codec_state: Any, present: jax.Array, *,
                 compressor: compression.Compressor | None,
                 comm: compression.Comm | None, seed: int, index: jax.Array,
                 mean_fn: Callable[[Any], Any]) -> tuple[Any, Any, Any]:
  """The mean of ``delta`` over the workers where ``present`` is true.

  An absent worker contributes zeros (its ``delta`` is never read, so a
  NaN in it goes nowhere) and the sum is divided by the number of present
  workers, which travels with the values: one float32 scalar per worker
  more than :func:`worker_mean` sends. With no worker present the mean is
  zero (the anchor stays). Through ``compressor``, an absent worker sends
  the codec's encoding of zeros and keeps its codec state (error buffers)
  as it was; this is exact for codecs that encode zeros as zeros and keep
  no shared estimate (every quantizer and sparsifier here, classic error
  feedback), but not for EF21 / EControl, whose shared estimate assumes
  every worker's message.

  Returns:
    ``(mean, sent, codec_state)`` as :func:`worker_mean`.
  """
  weight = present.astype(jnp.float32)
  masked = jax.tree.map(lambda d: jnp.where(present, d, jnp.zeros_like(d)),
                        delta)
  if compressor is None:
    total, share = mean_fn((masked, weight))
    sent, new_state = masked, codec_state
  else:
    total, sent, new_state = codec_mean(compressor, comm, seed, index,
                                        masked, codec_state)
    new_state = _select(present, new_state, codec_state)
    share = comm.pmean(weight)
  scale = jnp.where(share > 0, 1 / jnp.maximum(share, 1e-30), 0.)
  mean = jax.tree.map(lambda t: (t * scale).astype(t.dtype), total)
  return mean, sent, new_state


def guarded_mean(delta: Any, codec_state: Any, present: jax.Array | None,
                 **kwargs) -> tuple[Any, Any, Any, jax.Array]:
  """The mean over workers that leaves out absent and non-finite workers.

  With ``present`` given (worker dropout), :func:`present_mean` over the
  workers that are present and whose ``delta`` is finite. Without it, the
  plain :func:`worker_mean`; only if that mean is not finite (some worker
  sent NaN / Inf) a second round, under ``lax.cond`` so that it costs
  nothing when every worker is finite, recomputes it over the finite
  workers. The recovery round's bytes are a conditional branch of the
  compiled program (``loc_opt.parallel.CollectiveReport.branches``), not
  part of a sync's unconditional bytes.

  Args:
    delta: this worker's pseudo-gradient.
    codec_state: the compressor's state (``()`` without one).
    present: per-worker bool scalar, or None (every worker present).
    **kwargs: ``compressor``, ``comm``, ``seed``, ``index`` and ``mean_fn``
      as :func:`worker_mean` takes them.

  Returns:
    ``(mean, sent, codec_state, included)``: as :func:`worker_mean`, and
    whether this worker's ``delta`` entered the mean (bool scalar).
  """
  finite = all_finite(delta)
  if present is not None:
    included = jnp.logical_and(present, finite)
    return present_mean(delta, codec_state, included, **kwargs) + (
        included,)
  plain = worker_mean(delta, codec_state, **kwargs)
  compressor = kwargs.get('compressor')
  if compressor is not None and compressor.elementwise:
    return _leafwise_guard(delta, plain, finite, **kwargs)

  def recover():
    return present_mean(delta, codec_state, finite, **kwargs) + (finite,)

  # A finite mean means every delta was finite: ``finite`` is true there.
  return jax.lax.cond(all_finite(plain[0]), lambda: plain + (finite,),
                      recover)


def _leafwise_guard(delta: Any, plain: tuple[Any, Any, Any],
                    finite: jax.Array, **kwargs
                    ) -> tuple[Any, Any, Any, jax.Array]:
  """:func:`guarded_mean`'s recovery leaf by leaf, for an element-wise
  fp32 mean (``Compressor.elementwise``).

  One ``lax.cond`` per leaf instead of one over the tree: a conditional
  holds its operands and its result, and over the whole tree that kept
  the pseudo-gradient, the plain mean and the result, three copies of the
  parameters, alive at once (issue 46); per leaf each result replaces its
  leaf of the mean as the program goes. The values are those of the
  whole-tree recovery (each leaf's mean is element-wise, the count of
  finite workers is the same scalar all-reduce), and a finite mean means
  every worker was finite, so ``sent`` is ``delta`` where this worker is
  finite and zeros where not, in both cases, without a conditional.
  """
  mean, sent, codec_state = plain
  ok = all_finite(mean)

  def leaf(d, m):
    def recover():
      return present_mean(d, (), finite, **kwargs)[0]

    return jax.lax.cond(ok, lambda: m, recover)

  sent = jax.tree.map(lambda s: jnp.where(finite, s, jnp.zeros_like(s)),
                      sent)
  return jax.tree.map(leaf, delta, mean), sent, codec_state, finite


# ---------------------------------------------------------------- phases ---
def periodic_init(
    state_cls: Callable[..., Any],
    inner: optax.GradientTransformation,
    anchor_dtype: Any,
    fields: Callable[[optax.Params], dict[str, Any]],
) -> Callable[[optax.Params], Any]:
  """The ``init`` of a local method that syncs every ``H`` inner steps.

  Args:
    state_cls: the method's state, a NamedTuple with ``inner_state``,
      ``anchor`` and the counters of :func:`zero_counters`.
    inner: the inner optimizer.
    anchor_dtype: the minimum precision of the anchor (see
      :func:`init_anchor`).
    fields: ``anchor -> {field: initial value}`` for the method's other
      fields (e.g. its outer optimizer's state).

  Returns:
    ``init_fn(params)``.
  """

  def init_fn(params):
    anchor = init_anchor(params, anchor_dtype)
    return state_cls(inner_state=inner.init(params), anchor=anchor,
                     **fields(anchor), **zero_counters())

  return init_fn


def bool_phase(sync: Any) -> tuple[Any, None]:
  """The phase of a method whose steps are inner or sync steps only:
  ``sync`` must be ``None``, ``True`` or ``False``."""
  if sync not in (None, True, False):
    raise ValueError(f'sync must be None, True or False, got {sync!r}')
  return sync, None


def any_phase(sync: Any) -> tuple[Any, None]:
  """As :func:`bool_phase` without the check: any truthy phase syncs."""
  return sync, None


def periodic_update(
    inner: optax.GradientTransformationExtraArgs,
    sync_every: Any,
    *,
    name: str,
    fields: Sequence[str],
    sync_step: SyncStep,
    phase: Callable[[Any], tuple[Any, Any]] = bool_phase,
    varying: Callable[[Any], Any] = identity,
    period: Callable[[Any, jax.Array], jax.Array] | None = None,
    takes_present: bool = False,
) -> Callable[..., tuple[optax.Updates, Any]]:
  """The ``update`` of a local method that syncs every ``H`` inner steps.

  Each call runs the inner optimizer, then either the method's sync branch
  or the inner branch (the inner updates, the state fields unchanged):
  statically from ``update(..., sync=...)``, or on device when
  ``steps_since_sync + 1 >= H`` (``lax.cond``). The state (a NamedTuple
  with ``inner_state``, ``count``, ``steps_since_sync`` and ``num_syncs``)
  comes back with the new inner state, the branch's fields and the counters
  advanced.

  Args:
    inner: the inner optimizer (with extra-args support).
    sync_every: ``H`` (handed to ``period`` when given).
    name: the method's name, for error messages.
    fields: the state fields the sync branch replaces (the inner branch
      keeps them).
    sync_step: ``(state, params, local, payload) -> (updates, {field: new
      value})``, the sync branch; ``local`` is ``theta' = params + inner
      update`` and ``payload`` the second entry of ``phase(sync)``.
    phase: ``sync -> (branch, payload)``: checks the static ``sync``
      argument, and gives :func:`loc_opt.outer.plan.branch` its phase
      (``None``: decide on device) and the sync branch its payload.
    varying: applied to both branches' outputs (see :func:`varying_fn`).
    period: ``(sync_every, count) -> H`` in force at inner step ``count``;
      default ``sync_every`` itself.
    takes_present: whether the method supports worker dropout: then
      ``update(..., present=...)`` (a per-worker bool scalar, None: present)
      reaches ``sync_step`` as a fifth argument; otherwise passing it is an
      error.

  Returns:
    ``update_fn(updates, state, params, *, sync=None, present=None,
    **extra_args)``.
  """

  def update_fn(updates, state, params=None, *, sync=None, present=None,
                **extra_args):
    if present is not None and not takes_present:
      raise ValueError(f'{name} does not support worker dropout '
                       '(update(..., present=...))')
    inner_updates, inner_state = inner_step(
        inner, name, updates, state.inner_state, params, extra_args)
    branch_phase, payload = phase(sync)

    def on_sync():
      local = optax.apply_updates(params, inner_updates)
      args = (present,) if takes_present else ()
      new_updates, new = sync_step(state, params, local, payload, *args)
      if set(new) != set(fields):
        raise ValueError(f'{name}: the sync step replaces {sorted(new)}'
                         f', not the fields {sorted(fields)}')
      return varying((new_updates, new)), jnp.ones([], jnp.int32)

    def on_inner():
      kept = {f: getattr(state, f) for f in fields}
      return varying((inner_updates, kept)), jnp.zeros([], jnp.int32)

    def due():
      h = sync_every if period is None else period(sync_every, state.count)
      return state.steps_since_sync + 1 >= h

    (new_updates, new), synced = plan_lib.branch(branch_phase, due, on_sync,
                                                 on_inner)
    count, since, num_syncs = plan_lib.advance(
        state.count, state.steps_since_sync, state.num_syncs, synced)
    return new_updates, state._replace(
        inner_state=inner_state, count=count, steps_since_sync=since,
        num_syncs=num_syncs, **new)

  return update_fn
