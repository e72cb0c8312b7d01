r"""SparseLoCo: DiLoCo with sparse, 2-bit, error-fed pseudo-gradients.

Every worker runs the inner optimizer on its own data. Every ``sync_every``
steps it adds its pseudo-gradient ``anchor - local`` into a decaying
error-feedback buffer, sends only the ``k`` largest entries of every tile of
that buffer with their values quantized to 2 bits, and removes what it sent
(after quantization) from the buffer. The workers' messages are
all-gathered and averaged entry by entry, and the anchor takes one plain SGD
step on that average (no outer momentum: the buffer plays its role). The
local parameters are then reset to the anchor.

References:
  Sarfi, Thérien, Lidin, Belilovsky, *Communication Efficient LLM
  Pre-training with SparseLoCo*, 2025. https://arxiv.org/abs/2508.15706

  Douillard et al., *DiLoCo: Distributed Low-Communication Training of
  Language Models*, 2023.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loc_opt import compression
from loc_opt.compression import dct
from loc_opt.compression import quant
from loc_opt.outer.demo import check_tile_args
from loc_opt.outer.demo import exchange
from loc_opt.outer.demo import SparseTiles
from loc_opt.outer.demo import UINT12
from loc_opt.outer.diloco import init_anchor
from loc_opt.outer import plan as plan_lib

# SparseLoCo's k is given for 64 x 64 tiles.
REFERENCE_TILE = 4096


class SparselocoState(NamedTuple):
  """State of :func:`sparseloco` (one worker's copy).

  Attributes:
    inner_state: the inner optimizer's state, never averaged or reset.
    anchor: the outer parameters ``phi`` (same tree as the params; dtype
      ``promote_types(param dtype, anchor_dtype)``, fp32 by default).
    error: the error-feedback buffer ``e``, same tree and dtypes as
      ``anchor``, kept across syncs.
    count: int32 scalar, inner steps taken.
    steps_since_sync: int32 scalar, inner steps since the last sync.
    num_syncs: int32 scalar, syncs done (indexes the outer learning-rate
      schedule and the value codec's key).
  """

  inner_state: optax.OptState
  anchor: optax.Params
  error: optax.Updates
  count: jax.Array
  steps_since_sync: jax.Array
  num_syncs: jax.Array


def _value_codec(value_codec: Any) -> compression.Codec | None:
  if value_codec is None:
    return None
  if isinstance(value_codec, str):
    if value_codec != 'two_bit':
      raise ValueError(f"value_codec must be 'two_bit', None or a Codec, got "
                       f'{value_codec!r}')
    # One block per tensor: the statistics of all of a tensor's kept values.
    return quant.two_bit_codec(None)
  if not isinstance(value_codec, compression.Codec):
    raise ValueError(f"value_codec must be 'two_bit', None or a Codec, got "
                     f'{value_codec!r}')
  return value_codec


def _check_int(name: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or (
      value < 1):
    raise ValueError(f'{name} must be a positive int, got {value!r}')
  return int(value)


def sparseloco_tiles(topk: int = 128, tile: int = 64, *,
                     value_codec: Any = 'two_bit',
                     index_dtype: Any = UINT12) -> SparseTiles:
  """SparseLoCo's wire format: per tile the ``scaled_k`` largest entries of
  the buffer (no DCT), values through ``value_codec``."""
  topk = _check_int('topk', topk)
  tile = _check_int('tile', tile)
  check_tile_args(topk, tile, index_dtype)
  return SparseTiles(
      k=lambda n, kk=topk: dct.scaled_k(kk, n, REFERENCE_TILE),
      chunk=tile, use_dct=False, index_dtype=index_dtype,
      value_codec=_value_codec(value_codec))


def sparseloco(
    inner: optax.GradientTransformation,
    *,
    sync_every: int,
    ef_decay: jax.typing.ArrayLike = 0.95,
    topk: int = 128,
    tile: int = 64,
    value_codec: str | compression.Codec | None = 'two_bit',
    learning_rate: jax.typing.ArrayLike | optax.Schedule = 1.0,
    aggregate: str = 'mean_of_selected',
    axis_name: str | None = 'worker',
    anchor_dtype: Any = jnp.float32,
    index_dtype: Any = UINT12,
) -> optax.GradientTransformationExtraArgs:
  r"""SparseLoCo: sparse, quantized error feedback instead of outer momentum.

  Inner steps are the inner optimizer's. On a sync step (every
  ``H = sync_every`` steps) worker ``r``, with local parameters
  ``theta'_r = theta_r + u`` after its inner update, does

  .. math::

    \Delta_r &= \phi - \theta'_r, \qquad e_r \leftarrow \beta e_r + \Delta_r
    \\
    s_r &= Q(\mathrm{topk}_{tile}(e_r)), \qquad e_r \leftarrow e_r - s_r \\
    A &= \mathrm{scatter\_mean}_r(s_r), \qquad
    \phi \leftarrow \phi - \eta A, \qquad \theta_r \leftarrow \phi

  Tiles are 64 x 64 for 2-D leaves (by the divisor rule of
  :mod:`loc_opt.compression.dct`; higher ranks as ``[dim0, rest]``) and
  64-long segments for 1-D ones. ``topk`` is the count for a 4096-element
  tile; a tile of ``n`` elements keeps ``round(topk n / 4096)``, at least 1
  (2 of a 64-long segment at ``topk=128``). ``Q`` is the 2-bit statistical
  quantizer over a tensor's kept values (:func:`loc_opt.compression.
  two_bit_codec`); the buffer loses exactly the dequantized values, so it
  absorbs both the sparsification and the quantization error. Messages
  (12-bit tile-local indices, 2-bit codes, a shift and a 4-entry table per
  tensor) are all-gathered over ``axis_name``; an entry chosen by ``c``
  workers is averaged over those ``c`` (``aggregate='mean_of_selected'``,
  the reference code) or over all workers (``'mean_over_workers'``).

  Deviation from the reference code: there the outer learning rate scales
  the buffer's input *and* the SGD step (``eta^2`` overall). Here ``eta``
  is applied once, in the SGD step; at the default ``eta = 1`` the two
  agree.

  The returned update on a sync step is ``phi_new - theta``, so
  ``optax.apply_updates`` lands on the new anchor. The phase ``sync``
  (keyword-only, static) is ``False`` for an inner step (no cross-worker
  collective), ``True`` for a sync step, or ``None`` to decide with
  ``lax.cond`` on the state's counter; :func:`sparseloco_plan` gives the
  phases.

  Args:
    inner: the inner optimizer (e.g. ``optax.adamw(1e-3, b2=0.95)``).
    sync_every: the sync period H (15 in the paper).
    ef_decay: the buffer's decay ``beta`` (0.95).
    topk: entries kept per 4096-element tile (128: 3.1 % density).
    tile: the largest tile side (64).
    value_codec: ``'two_bit'`` (default; one block per tensor, whose kept
      values are zero-padded to a multiple of 4, the padding entering the
      statistics), ``None`` (fp32 values), or a
      :class:`loc_opt.compression.Codec` applied to each tensor's kept values
      (a stochastic one draws from a key folded with the sync index and, for
      ``'per_worker'`` randomness, the worker index).
    learning_rate: the outer SGD learning rate ``eta`` (1.0), or a schedule
      of the sync index.
    aggregate: ``'mean_of_selected'`` or ``'mean_over_workers'``.
    axis_name: the worker axis; ``None`` for one worker.
    anchor_dtype: the minimum precision of the anchor and the buffer.
    index_dtype: ``'uint12'`` (two indices in three bytes), an integer
      dtype, or ``None`` (narrowest that holds a tile position).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import optax
    >>> import loc_opt
    >>> tx = loc_opt.sparseloco(optax.adamw(1e-3), sync_every=15)

  References:
    Sarfi, Thérien, Lidin, Belilovsky, *Communication Efficient LLM
    Pre-training with SparseLoCo*, 2025.
  """
  sync_every = _check_int('sync_every', sync_every)
  if aggregate not in dct.AGGREGATES:
    raise ValueError(f'aggregate must be one of {dct.AGGREGATES}, got '
                     f'{aggregate!r}')
  if not isinstance(ef_decay, jax.core.Tracer):
    if not 0.0 <= float(ef_decay) <= 1.0:
      raise ValueError(f'ef_decay must be in [0, 1], got {ef_decay}')
  tiles = sparseloco_tiles(topk, tile, value_codec=value_codec,
                           index_dtype=index_dtype)
  codec = tiles.value_codec
  inner = optax.with_extra_args_support(inner)
  comm = compression.Comm(axis_name) if axis_name is not None else None

  def init_fn(params):
    anchor = init_anchor(params, anchor_dtype)
    zero = jnp.zeros([], jnp.int32)
    return SparselocoState(
        inner_state=inner.init(params),
        anchor=anchor,
        error=jax.tree.map(jnp.zeros_like, anchor),
        count=zero,
        steps_since_sync=zero,
        num_syncs=zero,
    )

  def update_fn(updates, state, params=None, *, sync=None, **extra_args):
    if params is None:
      raise ValueError('sparseloco needs params: call update(updates, state, '
                       'params)')
    inner_updates, inner_state = inner.update(
        updates, state.inner_state, params, **extra_args)

    def outer_step(_):
      local = optax.apply_updates(params, inner_updates)
      error = jax.tree.map(
          lambda e, a, x: ef_decay * e + (a - x.astype(a.dtype)),
          state.error, state.anchor, local)
      key = jax.random.fold_in(jax.random.key(0), state.num_syncs)
      enc_key = key
      if (codec is not None and codec.randomness == 'per_worker'
          and comm is not None):
        enc_key = jax.random.fold_in(key, comm.index())
      leaves, treedef = jax.tree.flatten(error)
      encoded = [tiles.encode(e, enc_key) for e in leaves]
      error = treedef.unflatten(
          [e - s.astype(e.dtype) for e, (_, s) in zip(leaves, encoded)])
      gathered = exchange([msg for msg, _ in encoded], comm)
      mean = treedef.unflatten(
          [tiles.mean(w, e.shape, key, aggregate=aggregate)
           for w, e in zip(gathered, leaves)])
      lr = (learning_rate(state.num_syncs) if callable(learning_rate)
            else learning_rate)
      anchor = jax.tree.map(lambda a, m: a - (lr * m).astype(a.dtype),
                            state.anchor, mean)
      new_updates = jax.tree.map(
          lambda a, p: (a - p.astype(a.dtype)).astype(p.dtype), anchor,
          params)
      out = (new_updates, anchor, error, jnp.ones([], jnp.int32))
      return comm.varying(out) if comm is not None else out

    def inner_only(_):
      out = (inner_updates, state.anchor, state.error,
             jnp.zeros([], jnp.int32))
      return comm.varying(out) if comm is not None else out

    out = plan_lib.branch(
        sync, lambda: state.steps_since_sync + 1 >= sync_every,
        lambda: outer_step(None), lambda: inner_only(None))
    new_updates, anchor, error, synced = out
    count, since, num_syncs = plan_lib.advance(
        state.count, state.steps_since_sync, state.num_syncs, synced)
    new_state = SparselocoState(
        inner_state=inner_state,
        anchor=anchor,
        error=error,
        count=count,
        steps_since_sync=since,
        num_syncs=num_syncs,
    )
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def sparseloco_plan(sync_every: int) -> plan_lib.Plan:
  """Phases of :func:`sparseloco`: ``True`` at counts ``H - 1, 2H - 1, ...``,
  else ``False`` (no communication)."""
  return plan_lib.Plan(plan_lib.every(_check_int('sync_every', sync_every)))


def sparseloco_eval_params(state: SparselocoState,
                           params: optax.Params) -> Any:
  """The weights to evaluate: the anchor ``phi`` in params dtypes."""
  return jax.tree.map(lambda a, p: a.astype(p.dtype), state.anchor, params)


def sparseloco_payload_bytes(
    params: Any, *, topk: int = 128, tile: int = 64,
    value_codec: str | compression.Codec | None = 'two_bit',
    index_dtype: Any = UINT12) -> int:
  """Bytes one worker sends per sync (its messages for all leaves).

  With ``topk=128`` per 64 x 64 tile, 12-bit indices and 2-bit values:
  ``128 * (1.5 + 0.25) / 4096 = 0.055`` bytes per parameter plus 20 bytes
  (shift and table) per tensor, vs 4 for an fp32 pseudo-gradient.

  Args:
    params: a tree of arrays or ``jax.ShapeDtypeStruct``.
    topk, tile, value_codec, index_dtype: as in :func:`sparseloco`.

  Returns:
    The bytes.
  """
  tiles = sparseloco_tiles(topk, tile, value_codec=value_codec,
                           index_dtype=index_dtype)
  return sum(tiles.payload_bytes(jnp.shape(x))
             for x in jax.tree.leaves(params))
