"""Compressors: stateful means over workers where only payloads cross.

A :class:`Compressor` averages a pytree over the worker axis through some
compression scheme and may keep per-worker state (error-feedback buffers,
warm-start factors, momentum). It is the common shape of every scheme in this
package:

* :func:`from_codec` turns any stateless :class:`~loc_opt.compression.Codec`
  into a compressor (all-gather of packed payloads, or an all-reduce of
  linear payloads);
* low-rank and other schemes with their own collectives (PowerSGD, TernGrad,
  DGC) implement ``mean`` directly, usually leaf by leaf with
  :func:`leafwise`;
* wrappers add error feedback (:mod:`loc_opt.compression.feedback`) or send
  some leaves uncompressed (:func:`partition`).

Two users sit on top: :func:`~loc_opt.compression.compressed_all_reduce`
(:mod:`loc_opt.compression.all_reduce`), a gradient transformation for
data-parallel training, and ``loc_opt.diloco(..., codec=...)`` for
pseudo-gradients.

Contract of ``mean(tree, state, comm, key) -> (mean, transmitted, state)``:

* ``tree`` is this worker's value; ``mean`` (float32 leaves) is identical on
  every worker;
* ``transmitted`` is this worker's value as the scheme reconstructs it from
  what was sent (what error feedback subtracts), float32;
* ``key`` is a PRNG key identical on all workers (schemes that need
  independent draws fold in ``comm.index()``);
* collectives go through ``comm`` (:class:`~loc_opt.compression.comm.Comm`)
  only, so the same code runs under ``vmap`` and ``shard_map``.
"""

from collections.abc import Callable
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from loc_opt import _checks
from loc_opt.compression import codecs as codecs_lib
from loc_opt.compression import comm as comm_lib

Eligible = Callable[[tuple[Any, ...], Any], bool]


class Compressor(NamedTuple):
  """A mean over workers through a compression scheme.

  Attributes:
    name: a readable name, e.g. ``'ef(topk)'``.
    init: ``tree -> state`` for one worker (``tree`` may hold
      ``jax.ShapeDtypeStruct`` leaves).
    mean: ``(tree, state, comm, key) -> (mean, transmitted, state)``; see the
      module docstring.
    payload_bytes: ``tree -> int``, the bytes one worker sends per call
      (operands of its cross-worker collectives), from the leaf shapes.
    feedback: whether the scheme already keeps an error (PowerSGD, DGC, or
      any error-feedback wrapper); wrapping it in another one would count
      the same error twice, and
      :func:`~loc_opt.compression.build_compressor` refuses to.
    elementwise: whether ``mean`` is the plain fp32 mean, element by
      element and leaf by leaf, with no state (:func:`from_codec` of the
      identity codec): averaging each leaf on its own gives the same
      values, which lets the non-finite guard of the DiLoCo family recover
      leaf by leaf (``loc_opt.outer._local.guarded_mean``).
  """

  name: str
  init: Callable[[Any], Any]
  mean: Callable[..., tuple[Any, Any, Any]]
  payload_bytes: Callable[[Any], int]
  feedback: bool = False
  elementwise: bool = False


def f32(tree: Any) -> Any:
  """Casts every leaf to float32."""
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def mean_leaves(
    tree: Any,
    states: Any,
    comm: comm_lib.Comm,
    key: jax.Array,
    mean_leaf: Callable[..., tuple[jax.Array, jax.Array, Any]],
    *,
    plain: Callable[[Any], bool] | None = None,
    plain_leaf: Callable[[jax.Array, Any], tuple[jax.Array, Any]] | None = None,
) -> tuple[Any, Any, list[Any]]:
  """The mean of ``tree`` leaf by leaf, plain leaves in one fp32 ``pmean``.

  The common body of the ``mean`` of compressors that treat each leaf on its
  own and send some leaves (vectors, small matrices) uncompressed: those are
  averaged together in float32, report themselves as transmitted, and keep
  their state unless ``plain_leaf`` updates it.

  Args:
    tree: this worker's pytree.
    states: one state per leaf, in ``jax.tree.leaves`` order.
    comm: the collectives.
    key: PRNG key; leaf ``i`` gets ``jax.random.fold_in(key, i)``.
    mean_leaf: ``(x, state, key) -> (mean, transmitted, state)`` for the
      leaves that are not plain.
    plain: ``leaf -> bool``, the leaves averaged in fp32 (``None``: none).
    plain_leaf: ``(mean, state) -> (output, state)`` applied to a plain
      leaf's fp32 mean (``None``: the mean as it is).

  Returns:
    ``(mean, transmitted, states)``: two trees like ``tree`` and the list of
    new per-leaf states.
  """
  leaves, treedef = jax.tree.flatten(tree)
  chosen = [i for i, x in enumerate(leaves) if plain is not None and plain(x)]
  plain_means = dict(zip(chosen, comm.pmean(
      [jnp.asarray(leaves[i], jnp.float32) for i in chosen])))
  means, sent, new = [], [], []
  for i, (x, s) in enumerate(zip(leaves, states, strict=True)):
    if i in plain_means:
      m = plain_means[i]
      if plain_leaf is not None:
        m, s = plain_leaf(m, s)
      t = jnp.asarray(x, jnp.float32)
    else:
      m, t, s = mean_leaf(x, s, jax.random.fold_in(key, i))
    means.append(m)
    sent.append(t)
    new.append(s)
  return treedef.unflatten(means), treedef.unflatten(sent), new


def leafwise(
    name: str,
    mean_leaf: Callable[..., tuple[jax.Array, jax.Array, Any]],
    bytes_leaf: Callable[[tuple[int, ...]], int],
    init_leaf: Callable[[Any], Any] = lambda x: (),
) -> Compressor:
  """A compressor that treats each leaf on its own.

  Args:
    name: the compressor's name.
    mean_leaf: ``(x, state, comm, key) -> (mean, transmitted, state)`` for one
      leaf; ``key`` is already specific to the leaf.
    bytes_leaf: ``shape -> bytes`` one worker sends for a leaf of that shape.
    init_leaf: ``x -> state`` for one leaf.

  Returns:
    The compressor; its state is a tuple with one entry per leaf.
  """

  def init(tree):
    return tuple(init_leaf(x) for x in jax.tree.leaves(tree))

  def mean(tree, state, comm, key):
    means, sent, new = mean_leaves(
        tree, state, comm, key, lambda x, s, k: mean_leaf(x, s, comm, k))
    return means, sent, tuple(new)

  def payload_bytes(tree):
    return int(sum(bytes_leaf(tuple(x.shape)) for x in jax.tree.leaves(tree)))

  return Compressor(name, init, mean, payload_bytes)


REDUCTIONS = ('gather', 'two_phase')


def _concat_payloads(payloads: list[Any]) -> tuple[Any, list[Any]]:
  """One payload of several: each payload leaf flattened and concatenated
  over the parts; and, per part, the shapes of its leaves."""
  joined = jax.tree.map(lambda *xs: jnp.concatenate([jnp.ravel(x)
                                                     for x in xs]),
                        *payloads)
  shapes = [[x.shape for x in jax.tree.leaves(p)] for p in payloads]
  return joined, shapes


def _split_gathered(gathered: Any, shapes: list[list[tuple[int, ...]]]
                    ) -> list[Any]:
  """The parts of every worker's :func:`_concat_payloads` payload, from
  their all-gather (leaves ``[W, total]``); leaves ``[W, *shape]``."""
  leaves, treedef = jax.tree.flatten(gathered)
  starts = [0] * len(leaves)
  parts = []
  for part in shapes:
    pieces = []
    for j, (x, shape) in enumerate(zip(leaves, part)):
      n = math.prod(shape)
      pieces.append(x[:, starts[j]:starts[j] + n].reshape(
          (x.shape[0],) + tuple(shape)))
      starts[j] += n
    parts.append(treedef.unflatten(pieces))
  return parts


def _padded(n: int, unit: int) -> int:
  return -(-n // unit) * unit


def _per_tensor_mean(codec: codecs_lib.Codec, leaves: list[jax.Array],
                     comm: comm_lib.Comm, key: jax.Array,
                     enc_key: jax.Array) -> tuple[list[Any], list[Any]]:
  """The all-gather mean of a codec with one scale per array, tensor by
  tensor.

  Each leaf is padded to the codec's block size and encoded on its own
  (key ``fold_in(enc_key, i)`` for leaf ``i``); the payloads are joined
  leaf by leaf (all codes in one array, all scales in another), so one
  payload crosses workers as before, with one scale per tensor.

  Returns:
    ``(means, sent)``: per leaf, the flat float32 mean over workers and this
    worker's decoded contribution (padded lengths).
  """
  flats = [comm_lib.pad_to(jnp.ravel(x).astype(jnp.float32),
                           codec.block_size) for x in leaves]
  payloads = [codec.encode(f, jax.random.fold_in(enc_key, i))
              for i, f in enumerate(flats)]
  joined, shapes = _concat_payloads(payloads)
  gathered = _split_gathered(comm.all_gather(joined), shapes)
  means, sent = [], []
  for f, own, every in zip(flats, payloads, gathered):
    n = f.size
    sent.append(codec.decode(own, n, key))
    decoded = jax.vmap(lambda p, n=n: codec.decode(p, n, key))(every)
    means.append(jnp.mean(decoded, axis=0))
  return means, sent


def _bucketed(mean: Callable[..., Any], groups: list[list[int]],
              leaves: list[Any], treedef: Any, state: Any,
              comm: comm_lib.Comm, key: jax.Array
              ) -> tuple[Any, Any, Any]:
  """``mean`` (a stateless :func:`from_codec` mean) bucket by bucket:
  bucket ``b`` of ``groups`` with key ``fold_in(key, b)`` (``key`` for the
  first); a bucket of one leaf is first split by rows over the worker's
  devices (:meth:`~loc_opt.compression.Comm.spread_rows`)."""
  means, sent = [None] * len(leaves), [None] * len(leaves)
  for b, group in enumerate(groups):
    parts = [leaves[i] for i in group]
    if len(parts) == 1:
      parts = [comm.spread_rows(parts[0])]
    m, t, _ = mean(parts, state, comm,
                   key if b == 0 else jax.random.fold_in(key, b))
    for i, mi, ti in zip(group, m, t):
      means[i], sent[i] = mi, ti
  return treedef.unflatten(means), treedef.unflatten(sent), state


def _decode_all(codec: codecs_lib.Codec, payloads: Any, n: int,
                key: jax.Array) -> jax.Array:
  return jax.vmap(lambda p: codec.decode(p, n, key))(payloads)


def _flat_mean(codec: codecs_lib.Codec, flat: jax.Array, comm: Any,
               key: jax.Array, enc_key: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
  """``(mean over workers, own decoded values)`` of one flat buffer sent
  as one payload (``reduce='gather'``, or a linear codec's all-reduce)."""
  flat = (comm.pad if codec.linear else comm.spread)(flat, codec.block_size)
  n = flat.size
  payload = codec.encode(flat, enc_key)
  own = codec.decode(payload, n, key)
  if codec.linear:
    return codec.decode(comm.pmean(payload), n, key), own
  gathered = _decode_all(codec, comm.all_gather(payload), n, key)
  return jnp.mean(gathered, axis=0), own


def _two_phase_mean(codec: codecs_lib.Codec, flat: jax.Array, comm: Any,
                    key: jax.Array, enc_key: jax.Array, workers: int
                    ) -> tuple[jax.Array, jax.Array]:
  """``(mean over workers, own decoded values)`` of one flat buffer by
  ``reduce='two_phase'``: parts exchanged all-to-all, averaged, re-encoded
  and all-gathered."""
  w = comm.size()
  if w != workers:
    raise ValueError(f'the worker axis {comm.axis_name!r} has {w} '
                     f'workers, but the codec was built for {workers}')
  flat = comm.spread(flat, codec.block_size * w)
  n = flat.size // w
  rows = flat.reshape(w, n)
  parts = jax.vmap(lambda r, j: codec.encode(
      r, jax.random.fold_in(enc_key, j)))(rows, jnp.arange(w))
  own = _decode_all(codec, parts, n, key).reshape(-1)
  mine = jnp.mean(_decode_all(codec, comm.all_to_all(parts), n, key), axis=0)
  again = codec.encode(mine, jax.random.fold_in(enc_key, w))
  avg = _decode_all(codec, comm.all_gather(again), n, key).reshape(-1)
  return avg, own


def from_codec(codec: codecs_lib.Codec, *, reduce: str = 'gather',
               workers: int | None = None) -> Compressor:
  """The mean over workers of a tree sent through ``codec``.

  The identity codec (fp32 values; ``exact`` and ``linear``) is an
  element-wise mean and needs no flat buffer: the tree goes to
  :meth:`~loc_opt.compression.Comm.pmean_buckets`, which under FSDP or
  tensor parallelism averages every large leaf in its own shape and
  sharding (no copy of the whole tree, nor of a whole leaf, on a device)
  and the small leaves in flat buckets of at most ``comm.bucket_size``
  elements.

  Other codecs: all leaves are flattened into one float32 buffer (as
  gradient buckets do),
  padded to whole blocks on each of the worker's devices, spread over those
  devices and encoded there, so padding costs at most a few blocks for the
  whole tree. A tree of more than ``comm.bucket_size`` elements is cut, in
  leaf order, into buckets of at most that many (a larger leaf alone,
  first split by its leading axis over the worker's devices where FSDP or
  tensor parallelism splits them: ``Comm.spread_rows``), each sent as such
  a buffer with the key folded with its index (the first bucket's is
  ``key``): a bounded buffer instead of the whole tree, and a smaller tree
  as before, bit for bit (except ``reduce='two_phase'`` and per-tensor
  codecs, which keep one buffer). Linear codecs (random-k with a shared mask)
  average the payloads with an all-reduce and decode once. The others:

  * ``reduce='gather'``: all-gather the packed payloads; every worker decodes
    all of them and averages, so all workers get the same mean. Each worker
    sends its payload once and receives ``W - 1`` of them.
  * ``reduce='two_phase'``: split the buffer into ``W`` parts, encode each,
    exchange them with an all-to-all so that worker ``j`` receives everyone's
    part ``j`` (a reduce-scatter of packed payloads), decode and average it
    in fp32, re-encode the average and all-gather the averaged parts. Each
    worker sends and receives about two payloads whatever ``W``; the price is
    a second rounding of the averaged values, which error feedback does not
    see (the spec's aggregation option (c)).

  Args:
    codec: the wire format.
    reduce: ``'gather'`` or ``'two_phase'`` (ignored for linear codecs).
    workers: the number of workers; required by ``'two_phase'``, whose
      payload depends on it (checked against the worker axis when traced).

  Returns:
    A stateless compressor.
  """
  _checks.one_of(reduce, 'reduce', REDUCTIONS)
  two_phase = reduce == 'two_phase' and not codec.linear
  if two_phase and codec.per_tensor:
    raise ValueError(
        f'reduce=\'two_phase\' splits a buffer into per-worker parts and '
        f'cannot keep one scale per tensor: give codec {codec.name!r} a '
        'block_size')
  if two_phase:
    workers = _checks.positive_int(
        workers, 'workers (for reduce=\'two_phase\')', arrays=True)

  elementwise = codec.exact and codec.linear

  def mean(tree, state, comm, key):
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
      return tree, tree, state
    if elementwise:  # fp32: no buffer of the whole tree (see above)
      # An exact codec decodes what it encodes: the fp32 values themselves.
      own = [jnp.asarray(x, jnp.float32) for x in leaves]
      return (treedef.unflatten(comm.pmean_buckets(own)),
              treedef.unflatten(own), state)
    if not two_phase and not codec.per_tensor:
      groups = comm.buckets(leaves)
      if len(groups) > 1:  # bounded buffers (see above)
        return _bucketed(mean, groups, leaves, treedef, state, comm, key)
    sizes = [int(jnp.size(x)) for x in leaves]
    flat = jnp.concatenate(
        [jnp.ravel(x).astype(jnp.float32) for x in leaves])
    enc_key = key
    if codec.randomness == 'per_worker':
      enc_key = jax.random.fold_in(key, comm.index())
    if codec.per_tensor:
      means, sent = _per_tensor_mean(codec, leaves, comm, key, enc_key)
      means, sent = (treedef.unflatten([v[:x.size].reshape(x.shape) for v, x
                                        in zip(vs, leaves)])
                     for vs in (means, sent))
      return means, sent, state
    if two_phase:
      avg, own = _two_phase_mean(codec, flat, comm, key, enc_key, workers)
    else:
      avg, own = _flat_mean(codec, flat, comm, key, enc_key)

    def split(v):
      out, start = [], 0
      for x, size in zip(leaves, sizes):
        out.append(v[start:start + size].reshape(jnp.shape(x)))
        start += size
      return treedef.unflatten(out)

    return split(avg), split(own), state

  def payload_bytes(tree):
    n = sum(_size(x) for x in jax.tree.leaves(tree))
    if not n:
      return 0
    if codec.per_tensor:  # each tensor padded to whole blocks, own scale
      return sum(codec.payload_bytes(_padded(_size(x), codec.block_size))
                 for x in jax.tree.leaves(tree))
    if not two_phase:
      return codec.payload_bytes(n)
    # all-to-all operand (W encoded parts) + the averaged part all-gathered
    part = -(-n // (codec.block_size * workers)) * codec.block_size
    return workers * codec.payload_bytes(part) + codec.payload_bytes(part)

  name = codec.name if not two_phase else f'{codec.name}/two_phase'
  return Compressor(name, lambda tree: (), mean, payload_bytes,
                    elementwise=elementwise)


def to_compressor(scheme: 'Compressor | codecs_lib.Codec | None') -> Compressor:
  """A compressor from a compressor, a codec, or ``None`` (fp32 mean).

  Names (``'int8'``) are resolved one layer up, by
  :func:`loc_opt.compression.as_compressor`, which every library function
  that takes a codec goes through.
  """
  if scheme is None:
    return from_codec(codecs_lib.identity())
  if isinstance(scheme, codecs_lib.Codec):
    return from_codec(scheme)
  if isinstance(scheme, Compressor):
    return scheme
  raise TypeError(f'expected a Compressor, Codec or codec name, got '
                  f'{type(scheme)}')


def min_size(size: int) -> Eligible:
  """An eligibility predicate: leaves with at least ``size`` elements."""
  def eligible(path, x):
    del path
    return _size(x) >= size
  return eligible


def skip_paths(*substrings: str) -> Eligible:
  """An eligibility predicate by name: leaves whose path contains none of
  ``substrings`` (case-insensitive, on ``jax.tree_util.keystr(path)``).

  MuLoCo sends norm gains (and, in its quantization sweeps, the embedding
  and the output head) uncompressed and without error feedback::

    eligible = skip_paths('norm', 'embed', 'head')

  Args:
    *substrings: parts of a path, e.g. ``'norm'`` matches
      ``['layer_0']['attn_norm']['scale']``.

  Returns:
    ``(path, leaf) -> bool``.
  """
  parts = tuple(str(s).lower() for s in substrings)

  def eligible(path, x):
    del x
    name = jax.tree_util.keystr(path).lower()
    return not any(p in name for p in parts)

  return eligible


def all_of(*predicates: Eligible | None) -> Eligible | None:
  """The leaves every predicate accepts (``None`` entries are ignored;
  ``None`` if all are)."""
  chosen = [p for p in predicates if p is not None]
  if not chosen:
    return None
  if len(chosen) == 1:
    return chosen[0]
  return lambda path, x: all(p(path, x) for p in chosen)


def matrices(path, x) -> bool:
  """An eligibility predicate: leaves with two or more dimensions."""
  del path
  return len(x.shape) >= 2


def partition(compressor: Compressor, eligible: Eligible | None) -> Compressor:
  """Sends eligible leaves through ``compressor``, the others in fp32.

  Ineligible leaves (small ones, biases, norms) take a plain mean and get no
  state, in particular no error-feedback buffer (the PowerSGD hook keeps one
  for them, which accumulates a zero-mean random walk).

  Args:
    compressor: the scheme for eligible leaves.
    eligible: ``(key_path, leaf) -> bool``, decided from shapes and paths
      only; ``None`` makes every leaf eligible.

  Returns:
    The compressor.
  """
  if eligible is None:
    return compressor

  def split(tree):
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    mask = [bool(eligible(p, x)) for p, x in with_path]
    leaves = [x for _, x in with_path]
    return leaves, mask, treedef

  def init(tree):
    leaves, mask, _ = split(tree)
    return compressor.init([x for x, m in zip(leaves, mask) if m])

  def mean(tree, state, comm, key):
    leaves, mask, treedef = split(tree)
    chosen = [x for x, m in zip(leaves, mask) if m]
    rest = [jnp.asarray(x, jnp.float32) for x, m in zip(leaves, mask)
            if not m]
    means, sent, state = compressor.mean(chosen, state, comm, key)
    rest_means = comm.pmean(rest)
    it_c, it_s, it_r, it_x = iter(means), iter(sent), iter(rest_means), \
        iter(rest)
    out_mean = [next(it_c) if m else next(it_r) for m in mask]
    out_sent = [next(it_s) if m else next(it_x) for m in mask]
    return treedef.unflatten(out_mean), treedef.unflatten(out_sent), state

  def payload_bytes(tree):
    leaves, mask, _ = split(tree)
    plain = sum(4 * _size(x) for x, m in zip(leaves, mask) if not m)
    return compressor.payload_bytes(
        [x for x, m in zip(leaves, mask) if m]) + plain

  return Compressor(f'partition({compressor.name})', init, mean,
                    payload_bytes, compressor.feedback)


def _size(x) -> int:
  return math.prod(x.shape)
