r"""DeMo: decoupled momentum, synchronized by its fast DCT components only.

A data-parallel optimizer that never all-reduces gradients. Every worker
keeps its own momentum; on every step it extracts the momentum's "fast"
components (the ``k`` largest coefficients of a block-wise DCT), removes
exactly what it extracted from its local buffer (the rest stays as error
feedback), all-gathers the compact ``(indices, values)`` messages of all
workers and takes a sign step on their decoded mean. All workers apply the
same update, so they stay identical.

The messages use the per-tile top-k wire format that SparseLoCo shares
(:class:`loc_opt.outer._tiles.SparseTiles`): tile-local indices (12-bit
packed by default) plus values, exchanged with an all-gather and averaged
with :func:`loc_opt.compression.dct.scatter_mean`.

Pitfall (the chunk divisor rule): a dimension whose only divisor between 2
and ``chunk`` is missing (a prime above ``chunk``, e.g. 67) is tiled in
chunks of 1, and a tensor with chunk 1 along every tiled dimension has
one-element tiles whose top-1 is the whole tensor: it is sent **dense**, at
index-plus-value cost per element (worse than fp32). Vocabulary-sized
dimensions are the usual culprit (50257 = 29 x 1733 only gets 29-wide
chunks); pad them to a multiple of 64 or pick ``chunk``.
:func:`loc_opt.compression.dct.chunk_sizes` warns when it happens, and
:func:`demo_payload_bytes` shows the cost.

References:
  Peng, Quesnelle, Kingma, *DeMo: Decoupled Momentum Optimization*, 2024
  (ICLR 2026). https://arxiv.org/abs/2411.19870
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loc_opt import _checks
from loc_opt import compression
from loc_opt.compression import dct
from loc_opt.outer import plan as plan_lib
from loc_opt.outer._tiles import check_tile_args
from loc_opt.outer._tiles import exchange
from loc_opt.outer._tiles import SparseTiles
from loc_opt.outer._tiles import tree_bytes
from loc_opt.outer._tiles import UINT12

MOMENTUM_FORMS = ('lr_scaled', 'ema')
ScalarOrSchedule = float | jax.typing.ArrayLike | optax.Schedule


class DemoState(NamedTuple):
  """State of :func:`scale_by_demo` (one worker's copy).

  Attributes:
    momentum: the momentum residual ``m`` after extraction, one per leaf,
      same shape as the param, float32 (``promote_types(param, float32)``).
    count: int32 scalar, steps taken (indexes the learning-rate schedule).
  """

  momentum: optax.Updates
  count: jax.Array


def demo_tiles(topk: int = 32, chunk: int = 64, *, index_dtype: Any = UINT12,
               value_dtype: Any = jnp.float32) -> SparseTiles:
  """DeMo's wire format: ``topk`` DCT coefficients of every tile."""
  if not jnp.issubdtype(value_dtype, jnp.floating):
    raise ValueError(f'value_dtype must be a float dtype, got {value_dtype}')
  return SparseTiles(k=lambda _, kk=int(topk): kk, chunk=int(chunk),
                     use_dct=True, index_dtype=index_dtype,
                     value_dtype=value_dtype)


def scale_by_demo(
    learning_rate: ScalarOrSchedule = 1.0,
    *,
    beta: jax.typing.ArrayLike = 0.999,
    topk: int = 32,
    chunk: int = 64,
    momentum: str = 'lr_scaled',
    sign: bool = True,
    aggregate: str = 'mean_of_selected',
    axis_name: str | None = 'worker',
    index_dtype: Any = UINT12,
    value_dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
  r"""DeMo's direction: the sign of the workers' mean fast momentum.

  Per worker, per tensor, with :math:`\eta_t` the learning rate:

  .. math::

    m &\leftarrow \beta m + \eta_t g
        \quad (\text{or } \beta m + (1 - \beta) g \text{ with ``'ema'``}) \\
    q &= \mathrm{IDCT}(\mathrm{topk}(\mathrm{DCT}(m))), \qquad
    m \leftarrow m - q \\
    U &= \mathrm{IDCT}(\mathrm{scatter\_mean}_w(\mathrm{topk}_w)), \qquad
    u = \mathrm{sign}(U)

  The DCT is the orthonormal DCT-II of every tile (tiles of at most
  ``chunk`` per side, by the divisor rule of
  :mod:`loc_opt.compression.dct`); top-k keeps the ``topk`` largest
  coefficients of each tile. ``m - q`` keeps what was not sent, so the
  residual is error feedback and ``beta m_old + eta g = q + m_new``. The
  messages of all workers are all-gathered (over ``axis_name``, spread over
  each worker's devices) and a coefficient chosen by several workers is
  averaged over those workers. Every worker computes the same ``U``.

  The returned direction is ``sign(U)`` (``U`` with ``sign=False``); chain a
  learning-rate scaling after it (see :func:`demo`).

  ``update(..., sync=...)``: DeMo exchanges on every step, so ``None`` and
  ``True`` both run the exchange (:func:`demo_plan` always says ``True``);
  ``sync=False`` skips it and uses this worker's own ``q`` (the one-worker
  step), a program with no cross-worker collective.

  Args:
    learning_rate: the learning rate ``eta`` (or schedule) that scales the
      gradient into the momentum (``'lr_scaled'``; unused with ``'ema'``).
    beta: the momentum decay (0.999 in the paper).
    topk: DCT coefficients sent per tile (clipped to the tile's size).
    chunk: the largest tile side (64: 64 x 64 tiles).
    momentum: ``'lr_scaled'`` (the reference code, ``beta m + eta g``) or
      ``'ema'`` (the revised paper, ``beta m + (1 - beta) g``).
    sign: take the sign of ``U`` (signSGD); ``False`` returns ``U``.
    aggregate: how coefficients of several workers combine,
      ``'mean_of_selected'`` (reference) or ``'mean_over_workers'``.
    axis_name: the worker axis; ``None`` for one worker.
    index_dtype: ``'uint12'`` (two indices in three bytes), an integer
      dtype, or ``None`` (narrowest that holds a tile position).
    value_dtype: float dtype the coefficients travel in (float32; bfloat16
      halves the value bytes, and what is dropped stays in ``m``).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import optax
    >>> from loc_opt import outer
    >>> tx = optax.chain(outer.scale_by_demo(1e-3, axis_name=None),
    ...                  optax.scale_by_learning_rate(1e-3))

  References:
    Peng, Quesnelle, Kingma, *DeMo: Decoupled Momentum Optimization*, 2024.
  """
  check_tile_args(topk, chunk, index_dtype)
  _checks.one_of(momentum, 'momentum', MOMENTUM_FORMS)
  _checks.one_of(aggregate, 'aggregate', dct.AGGREGATES)
  if not _checks.is_traced(beta):
    _checks.in_interval(beta, 'beta', 0, 1, closed='left')
  tiles = demo_tiles(topk, chunk, index_dtype=index_dtype,
                     value_dtype=value_dtype)
  comm = compression.Comm(axis_name) if axis_name is not None else None

  def init_fn(params):
    return DemoState(
        momentum=jax.tree.map(
            lambda p: jnp.zeros_like(
                p, jnp.promote_types(p.dtype, jnp.float32)), params),
        count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, *, sync=None, **extra_args):
    del params, extra_args
    if momentum == 'lr_scaled':
      lr = (learning_rate(state.count) if callable(learning_rate)
            else learning_rate)
      scale = jnp.asarray(lr, jnp.float32)
    else:
      scale = 1.0 - jnp.asarray(beta, jnp.float32)
    acc = jax.tree.map(
        lambda m, g: beta * m + scale * g.astype(m.dtype), state.momentum,
        updates)
    leaves, treedef = jax.tree.flatten(acc)
    encoded = [tiles.encode(m) for m in leaves]
    residual = [m - q.astype(m.dtype) for m, (_, q) in zip(leaves, encoded)]
    if sync is False or comm is None:
      means = [q for _, q in encoded]
    else:
      gathered = exchange([msg for msg, _ in encoded], comm)
      means = [tiles.mean(w, m.shape, aggregate=aggregate)
               for w, m in zip(gathered, leaves)]
    directions = [jnp.sign(u) if sign else u for u in means]
    new_updates = jax.tree.map(
        lambda d, g: d.astype(g.dtype), treedef.unflatten(directions),
        updates)
    new_state = DemoState(momentum=treedef.unflatten(residual),
                          count=optax.safe_increment(state.count))
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def demo(
    learning_rate: ScalarOrSchedule,
    *,
    beta: jax.typing.ArrayLike = 0.999,
    topk: int = 32,
    chunk: int = 64,
    weight_decay: jax.typing.ArrayLike = 0.0,
    momentum: str = 'lr_scaled',
    sign: bool = True,
    aggregate: str = 'mean_of_selected',
    axis_name: str | None = 'worker',
    index_dtype: Any = UINT12,
    value_dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
  r"""DeMo: decoupled momentum with sign steps on the shared fast components.

  :func:`scale_by_demo`, decoupled weight decay and the learning rate:

  .. math::

    \theta \leftarrow \theta - \eta_t (\mathrm{sign}(U) + \lambda \theta),

  i.e. ``theta <- (1 - eta lambda) theta - eta sign(U)``: every coordinate
  moves by exactly ``eta`` (plus the decay). The learning rate enters twice
  in the default ``'lr_scaled'`` form (in the momentum, as in the reference
  code, and in the step); with ``sign=True`` the first only sets the
  momentum's scale, with ``sign=False`` the step is ``eta^2``-sized (use
  ``'ema'`` there). Every step exchanges messages: one worker sends
  ``demo_payload_bytes(params)`` bytes per step and receives that from each
  other worker.

  Args:
    learning_rate: the learning rate ``eta``, or a schedule.
    beta: the momentum decay (0.999).
    topk: DCT coefficients sent per tile (32 of 64 x 64).
    chunk: the largest tile side (64). See the module docstring for prime
      dimensions (chunk 1: dense transmission).
    weight_decay: decoupled weight decay ``lambda`` (0 in the paper's runs).
    momentum: ``'lr_scaled'`` or ``'ema'`` (see :func:`scale_by_demo`).
    sign: sign step (``True``) or the raw decoded mean.
    aggregate: ``'mean_of_selected'`` or ``'mean_over_workers'``.
    axis_name: the worker axis; ``None`` for one worker.
    index_dtype: ``'uint12'``, an integer dtype, or ``None``.
    value_dtype: float dtype of the sent coefficients.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; pass the phase as the
    keyword-only ``sync`` (see :func:`scale_by_demo`).

  Example:
    >>> import loc_opt
    >>> tx = loc_opt.demo(4e-4, beta=0.999, topk=32)

  References:
    Peng, Quesnelle, Kingma, *DeMo: Decoupled Momentum Optimization*, 2024
    (ICLR 2026).
  """
  return optax.chain(
      scale_by_demo(learning_rate, beta=beta, topk=topk, chunk=chunk,
                    momentum=momentum, sign=sign, aggregate=aggregate,
                    axis_name=axis_name, index_dtype=index_dtype,
                    value_dtype=value_dtype),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate),
  )


def demo_plan() -> plan_lib.Plan:
  """DeMo exchanges on every step: one program, phase ``True``."""
  return plan_lib.Plan(lambda count: True)


def demo_eval_params(state: Any, params: optax.Params) -> Any:
  """The weights to evaluate: the parameters themselves (all workers apply
  the same update, so they hold the same weights)."""
  del state
  return params


def demo_payload_bytes(params: Any, *, topk: int = 32, chunk: int = 64,
                       index_dtype: Any = UINT12,
                       value_dtype: Any = jnp.float32) -> int:
  """Bytes one worker sends per step (its messages for all leaves).

  Per tile ``min(topk, tile size)`` coefficients, each a value of
  ``value_dtype`` plus an index (1.5 bytes with ``'uint12'``): 32 of 4096
  at fp32 is 32 * 5.5 / 4096 = 0.043 bytes per parameter (vs 4 for fp32
  gradients).

  Args:
    params: a tree of arrays or ``jax.ShapeDtypeStruct``.
    topk, chunk, index_dtype, value_dtype: as in :func:`demo`.

  Returns:
    The bytes.
  """
  check_tile_args(topk, chunk, index_dtype)
  return tree_bytes(demo_tiles(topk, chunk, index_dtype=index_dtype,
                                value_dtype=value_dtype), params)
