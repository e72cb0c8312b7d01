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
import optax

from loc_opt import _checks
from loc_opt import compression
from loc_opt.compression import dct
from loc_opt.compression import quant
from loc_opt.outer import _local
from loc_opt.outer import plan as plan_lib
from loc_opt.outer._tiles import check_tile_args
from loc_opt.outer._tiles import exchange
from loc_opt.outer._tiles import SparseTiles
from loc_opt.outer._tiles import tree_bytes
from loc_opt.outer._tiles import UINT12

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


def sparseloco_tiles(topk: int = 128, tile: int = 64, *,
                     value_codec: Any = 'two_bit',
                     index_dtype: Any = UINT12) -> SparseTiles:
  """SparseLoCo's wire format: per tile the ``scaled_k`` largest entries of
  the buffer (no DCT), values through ``value_codec``."""
  topk = _checks.positive_int(topk, 'topk', arrays=True)
  tile = _checks.positive_int(tile, 'tile', arrays=True)
  check_tile_args(topk, tile, index_dtype)
  return SparseTiles(
      k=lambda n, kk=topk: dct.scaled_k(kk, n, REFERENCE_TILE),
      chunk=tile, use_dct=False, index_dtype=index_dtype,
      value_codec=_value_codec(value_codec))


def _sparse_mean(tiles: SparseTiles, comm: compression.Comm | None,
                 aggregate: str, error: Any, num_syncs: jax.Array
                 ) -> tuple[Any, Any]:
  """The sync's exchange: every leaf of the buffer ``error`` is encoded,
  what was sent leaves the buffer, and the messages of all workers are
  all-gathered and averaged.

  Returns:
    ``(mean, error)``: the float32 average of the messages and the buffer
    after extraction.
  """
  codec = tiles.value_codec
  key = jax.random.fold_in(jax.random.key(0), num_syncs)
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
  return mean, error


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
  _checks.transformation(inner, 'inner')
  sync_every = _checks.positive_int(sync_every, 'sync_every', arrays=True)
  _checks.one_of(aggregate, 'aggregate', dct.AGGREGATES)
  if not _checks.is_traced(ef_decay):
    _checks.in_interval(ef_decay, 'ef_decay', 0, 1)
  tiles = sparseloco_tiles(topk, tile, value_codec=value_codec,
                           index_dtype=index_dtype)
  inner = optax.with_extra_args_support(inner)
  comm = compression.Comm(axis_name) if axis_name is not None else None

  init_fn = _local.periodic_init(
      SparselocoState, inner, anchor_dtype,
      lambda anchor: dict(error=jax.tree.map(jnp.zeros_like, anchor)))

  def sync_step(state, params, local, _):
    delta = _local.pseudo_gradient(state.anchor, local)
    error = jax.tree.map(lambda e, d: ef_decay * e + d, state.error, delta)
    mean, error = _sparse_mean(tiles, comm, aggregate, error, state.num_syncs)
    lr = (learning_rate(state.num_syncs) if callable(learning_rate)
          else learning_rate)
    anchor = jax.tree.map(lambda a, m: a - (lr * m).astype(a.dtype),
                          state.anchor, mean)
    return _local.updates_to(anchor, params), dict(anchor=anchor,
                                                   error=error)

  update_fn = _local.periodic_update(
      inner, sync_every, name='sparseloco', sync_step=sync_step,
      fields=('anchor', 'error'), phase=_local.any_phase,
      varying=_local.varying_fn(comm))
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def sparseloco_plan(sync_every: int) -> plan_lib.Plan:
  """Phases of :func:`sparseloco`: ``True`` at counts ``H - 1, 2H - 1, ...``,
  else ``False`` (no communication)."""
  return plan_lib.Plan(plan_lib.every(
      _checks.positive_int(sync_every, 'sync_every', arrays=True)))


def sparseloco_eval_params(state: SparselocoState,
                           params: optax.Params) -> Any:
  """The weights to evaluate: the anchor ``phi`` in params dtypes."""
  return _local.cast_like(state.anchor, params)


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
  return tree_bytes(tiles, params)
