"""Robust aggregation of pseudo-gradients: median, trimmed mean, clipping.

The DiLoCo family averages the workers' pseudo-gradients with an all-reduce.
One worker that sends a wrong pseudo-gradient (a bug, a bad node, or an
adversary in open training) moves that mean arbitrarily far. The rules here
bound what one worker can do:

* ``'median'``: the coordinate-wise median over the workers.
* ``'trimmed_mean'``: per coordinate, drop the ``trim`` largest and the
  ``trim`` smallest values and average the rest.
* ``'norm_clipped_mean'``: scale each worker's pseudo-gradient down to at
  most ``clip_multiple`` times the median of the workers' norms, then take
  the mean.

What they cost on the wire. A median or a trimmed mean needs every worker's
value of each coordinate, not a sum: the pseudo-gradients are all-gathered
(one flat fp32 buffer per worker, with this worker's "included" flag in its
last element). Each worker sends its payload once, as for an all-reduce, but
receives all ``M`` of them: through a ring, ``(M - 1) n`` bytes per worker
against ``2 (M - 1) / M n`` for an all-reduce, ``M / 2`` times the time.
The norm-clipped mean needs only the ``M`` norms: an all-gather of two
scalars per worker, then the usual all-reduce of the clipped values (so it
takes a codec, which compresses that all-reduce). The median and the
trimmed mean take a codec too (``codec='int8'``, ``'fp4_e3m0'``, ...): each
worker encodes its pseudo-gradient (per tensor for per-tensor codecs), the
payloads are all-gathered and every worker decodes all ``M`` of them before
the statistic, so the gather shrinks by the codec's ratio. A compressor
with state (error feedback) is refused there: its residual assumes the mean
is what it corrects.

Absent workers (``present=False``) and workers whose pseudo-gradient is not
finite are left out of every statistic: the median and trimmed mean sort the
included values only (the others are set to ``+inf`` and masked), the
clipped mean takes the median of the included norms and averages over the
included workers. With no worker included the result is zero (the anchor
stays).

References:
  Yin, Chen, Ramchandran, Bartlett, *Byzantine-Robust Distributed Learning:
  Towards Optimal Statistical Rates*, ICML 2018 (coordinate-wise median and
  trimmed mean). https://arxiv.org/abs/1803.01498

  Karimireddy, He, Jaggi, *Learning from History for Byzantine Robust
  Optimization*, ICML 2021 (centered clipping; the clipped mean here
  centres at zero, the anchor, and bounds by the median norm).
  https://arxiv.org/abs/2012.10333
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from loc_opt import _checks
from loc_opt import compression
from loc_opt.outer import _local

AGGREGATES = ('mean', 'median', 'trimmed_mean', 'norm_clipped_mean')
# The rules that all-gather every worker's pseudo-gradient (fp32, or a
# stateless codec's payloads).
GATHERED = ('median', 'trimmed_mean')

# ``(delta, codec_state, present, **mean_kwargs) -> (mean, sent,
# codec_state, included)``, as ``_local.guarded_mean``.
Average = Callable[..., tuple[Any, Any, Any, jax.Array]]


# ------------------------------------------------------------ statistics ---
def _sorted_included(values: jax.Array, mask: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
  """``values`` ``[M, ...]`` sorted along the workers with the excluded
  ones last (as ``+inf``), and the number ``k`` of included workers."""
  shape = (-1,) + (1,) * (values.ndim - 1)
  mask = jnp.reshape(mask, shape)
  k = jnp.sum(mask.astype(jnp.int32))
  return jnp.sort(jnp.where(mask, values, jnp.inf), axis=0), k


def _trimmed(values: jax.Array, mask: jax.Array, trim: Any) -> jax.Array:
  """Per coordinate, the mean of the included values ranked ``t .. k-t-1``
  with ``t = min(trim, (k - 1) // 2)`` (0 when ``k == 0``)."""
  s, k = _sorted_included(values, mask)
  t = jnp.clip(jnp.asarray(trim, jnp.int32), 0, jnp.maximum(k - 1, 0) // 2)
  rank = jnp.reshape(jnp.arange(values.shape[0]),
                     (-1,) + (1,) * (values.ndim - 1))
  keep = (rank >= t) & (rank < k - t)
  total = jnp.sum(jnp.where(keep, s, 0.), axis=0)
  return jnp.where(k > 0, total / jnp.maximum(k - 2 * t, 1), 0.)


def median(values: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """The coordinate-wise median over axis 0 of the rows where ``mask``.

  With an even number ``k`` of included rows, the mean of the two middle
  values (as ``numpy.median``); zero when no row is included.

  Args:
    values: ``[M, ...]``, one row per worker.
    mask: ``[M]`` bool, the rows to use (default: all).

  Returns:
    ``values.shape[1:]``.
  """
  mask = jnp.ones(values.shape[:1], bool) if mask is None else mask
  return _trimmed(values, mask, values.shape[0])


def trimmed_mean(values: jax.Array, mask: jax.Array | None = None,
                 trim: int = 1) -> jax.Array:
  """The coordinate-wise ``trim``-trimmed mean over axis 0.

  Per coordinate, the ``trim`` largest and ``trim`` smallest of the ``k``
  included values are dropped and the rest averaged. When fewer than
  ``2 trim + 1`` rows are included, as many as leave one or two values are
  dropped (the median).

  Args:
    values: ``[M, ...]``, one row per worker.
    mask: ``[M]`` bool, the rows to use (default: all).
    trim: values dropped at each end (``>= 0``).

  Returns:
    ``values.shape[1:]``.
  """
  mask = jnp.ones(values.shape[:1], bool) if mask is None else mask
  return _trimmed(values, mask, trim)


def clip_scales(norms: jax.Array, mask: jax.Array,
                clip_multiple: Any) -> jax.Array:
  """Per worker, ``min(1, c median(norms[mask]) / norm)``: the factor that
  clips its pseudo-gradient to ``c`` times the median included norm."""
  bound = clip_multiple * median(norms, mask)
  safe = jnp.where(norms > 0, norms, 1.)
  return jnp.where(norms > bound, bound / safe, 1.)


# --------------------------------------------------------- the averages ---
def _flat(tree: Any) -> jax.Array:
  return jnp.concatenate([jnp.ravel(x).astype(jnp.float32)
                          for x in jax.tree.leaves(tree)])


def _unflat(flat: jax.Array, like: Any) -> Any:
  leaves, treedef = jax.tree.flatten(like)
  out, start = [], 0
  for x in leaves:
    out.append(flat[start:start + x.size].reshape(x.shape).astype(x.dtype))
    start += x.size
  return treedef.unflatten(out)


def _gather(comm: compression.Comm | None, flat: jax.Array) -> jax.Array:
  """``[M, n]``: every worker's ``flat`` (one all-gather)."""
  return flat[None] if comm is None else comm.all_gather(flat)


def _included(delta: Any, present: jax.Array | None) -> jax.Array:
  finite = _local.all_finite(delta)
  return finite if present is None else jnp.logical_and(present, finite)


def gather_codec(scheme: Any) -> compression.Codec:
  """The codec a gathering rule sends through: a ``Codec``, or a name (or
  ``(name, kwargs)``) of ``loc_opt.compression.CODECS``."""
  if isinstance(scheme, compression.Codec):
    return scheme
  name, kwargs = (scheme, {}) if isinstance(scheme, str) else (
      scheme if isinstance(scheme, tuple) and len(scheme) == 2 else
      (None, None))
  if isinstance(name, str) and name in compression.CODECS:
    return compression.make_codec(name, field='codec', **dict(kwargs))
  raise ValueError(
      f'aggregate=\'median\' / \'trimmed_mean\' gather and decode every '
      'worker\'s payload: codec must be a stateless codec (an object or a '
      f'name of loc_opt.compression.CODECS, e.g. \'int8\'), got {scheme!r} '
      '(a compressor with error feedback is not one)')


def _decoded_rows(codec: compression.Codec, parts: list[jax.Array],
                  comm: compression.Comm | None, key: jax.Array
                  ) -> jax.Array:
  """``[M, n]``: every worker's ``parts`` (flat fp32 arrays, concatenated)
  as decoded from its all-gathered payloads."""
  enc_key = key
  if codec.randomness == 'per_worker' and comm is not None:
    enc_key = jax.random.fold_in(key, comm.index())
  rows = []
  for x in parts:
    n = x.size
    size = n + (-n) % codec.block_size
    payload = codec.encode(jnp.pad(x, (0, size - n)), enc_key)
    gathered = jax.tree.map(lambda p: _gather(comm, p), payload)
    rows.append(jax.vmap(lambda p, size=size: codec.decode(p, size, key))(
        gathered)[:, :n])
  return jnp.concatenate(rows, axis=1)


def _gathered_average(statistic: Callable[[jax.Array, jax.Array],
                                          jax.Array],
                      codec: compression.Codec | None = None) -> Average:
  """A median-like rule: all-gather the flat fp32 pseudo-gradients (this
  worker's included flag in the last element), or the payloads of
  ``codec`` (and the flags apart), and apply ``statistic``."""

  def average(delta, codec_state, present, *, comm, seed=0, index=0,
              **unused):
    del unused  # compressor (None), mean_fn
    included = _included(delta, present)
    if codec is None:
      flat = jnp.where(included, _flat(delta), 0.)
      rows = _gather(comm, jnp.append(flat, included.astype(jnp.float32)))
      values, mask = rows[:, :-1], rows[:, -1] > 0.5
    else:
      leaves = [jnp.where(included, jnp.ravel(x).astype(jnp.float32), 0.)
                for x in jax.tree.leaves(delta)]
      parts = leaves if codec.per_tensor else [jnp.concatenate(leaves)]
      key = jax.random.fold_in(jax.random.key(seed), index)
      values = _decoded_rows(codec, parts, comm, key)
      mask = _gather(comm, included.astype(jnp.float32)[None])[:, 0] > 0.5
    mean = statistic(values, mask)
    return _unflat(mean, delta), delta, codec_state, included

  return average


def _clipped_average(clip_multiple: Any) -> Average:
  """The norm-clipped mean: gather the norms, clip, mean of the included
  (through the codec, if any)."""

  def average(delta, codec_state, present, *, comm, **kwargs):
    included = _included(delta, present)
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                        for x in jax.tree.leaves(delta)))
    norm = jnp.where(included, norm, 0.)
    pair = jnp.stack([norm, included.astype(jnp.float32)])
    rows = pair[None] if comm is None else jax.lax.all_gather(
        pair, comm.axis_name)
    scales = clip_scales(rows[:, 0], rows[:, 1] > 0.5, clip_multiple)
    own = scales[0] if comm is None else scales[comm.index()]
    clipped = jax.tree.map(lambda x: (x * own).astype(x.dtype), delta)
    # Spread over the worker's devices: each element crosses once.
    kwargs['mean_fn'] = _local.identity if comm is None else comm.pmean
    return _local.present_mean(clipped, codec_state, included, comm=comm,
                               **kwargs) + (included,)

  return average


def check(aggregate: str, *, trim: Any = 1, clip_multiple: Any = 1.0,
          codec: Any = None, reduce_fn: Any = None) -> None:
  """Validates an aggregation rule and its arguments.

  Raises:
    ValueError: an unknown ``aggregate``, a negative ``trim``, a
      non-positive ``clip_multiple``, or a codec / ``reduce_fn`` with a rule
      that cannot take one.
  """
  _checks.one_of(aggregate, 'aggregate', AGGREGATES)
  _checks.nonnegative_int(trim, 'trim')
  _checks.positive_float(clip_multiple, 'clip_multiple')
  if aggregate in GATHERED and codec is not None:
    gather_codec(codec)
  if aggregate != 'mean' and reduce_fn is not None:
    raise ValueError(f'aggregate={aggregate!r} brings its own collectives '
                     'and takes no reduce_fn')


def averager(aggregate: str = 'mean', *, trim: Any = 1,
             clip_multiple: Any = 1.0, codec: Any = None) -> Average:
  """The average over workers that ``aggregate`` names.

  ``'mean'`` is ``_local.guarded_mean`` itself (the all-reduce, with the
  recovery round for non-finite workers); the others are described in the
  module docstring.

  Args:
    aggregate: one of :data:`AGGREGATES`.
    trim: ``'trimmed_mean'``: values dropped at each end, per coordinate.
      The worker count must exceed ``2 trim`` (checked when traced).
    clip_multiple: ``'norm_clipped_mean'``: the bound, a multiple of the
      median of the included workers' norms.
    codec: ``'median'`` / ``'trimmed_mean'``: gather through this stateless
      codec (:func:`gather_codec`); None: fp32.

  Returns:
    ``average(delta, codec_state, present, *, compressor, comm, seed,
    index, mean_fn) -> (mean, sent, codec_state, included)``.
  """
  check(aggregate, trim=trim, clip_multiple=clip_multiple,
        codec=codec if aggregate in GATHERED else None)
  codec = gather_codec(codec) if codec is not None else None
  if aggregate == 'mean':
    return _local.guarded_mean
  if aggregate == 'norm_clipped_mean':
    return _clipped_average(clip_multiple)
  if aggregate == 'median':
    return _gathered_average(median, codec)

  def trimmed(values, mask):
    if 2 * trim >= values.shape[0]:
      raise ValueError(f'trim={trim} drops every one of the '
                       f'{values.shape[0]} workers; use trim < M / 2')
    return trimmed_mean(values, mask, trim)

  return _gathered_average(trimmed, codec)
