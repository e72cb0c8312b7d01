"""Collectives over the worker axis that send each element across once.

Inside a worker a value is usually replicated over the ``data`` axis (or
sharded over ``fsdp``). A plain ``lax.pmean`` / ``lax.all_gather`` over the
worker axis of such a value makes every replica send its own copy across
workers. :class:`Comm` first spreads the value over the worker's own devices
(flatten, pad, constrain to ``P(inner axes)``), so each element crosses the
worker boundary once per worker, and lets GSPMD gather it back inside the
worker, over the fast links.

The same object works in *simulation mode*: under ``jax.vmap(...,
axis_name=...)`` (no mesh) every method falls back to the plain collective.
Compressors receive a :class:`Comm` and never name a mesh axis themselves.
"""

from collections.abc import Sequence
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from loc_opt import _checks

# The within-worker axes of `loc_opt.parallel.make_worker_mesh` (kept here
# to avoid an import cycle; a test checks they agree).
INNER_AXES = ('data', 'fsdp', 'tensor')

# Elements of the largest flat buffer an fp32 mean packs leaves into
# (``Comm.bucket_size``): 4M elements, 16 MiB in fp32, whole on a device.
BUCKET_SIZE = 2**22


def pad_to(flat: jax.Array, multiple: int) -> jax.Array:
  """Zero-pads a 1-D array to a multiple of ``multiple``."""
  return jnp.pad(flat, (0, (-flat.size) % multiple))


@dataclasses.dataclass(frozen=True)
class Comm:
  """Collectives over ``axis_name``, spread over the worker's devices.

  Attributes:
    axis_name: the worker axis (a ``vmap`` axis name or a manual
      ``shard_map`` mesh axis).
    spread_over: the within-worker mesh axes to spread values over; those
      absent from the current mesh (or of size 1) are ignored.
    bucket_size: the most elements :meth:`pmean_buckets` packs into one
      flat buffer (leaves at least this large are averaged on their own);
      a positive int, or ``None`` for the module's ``BUCKET_SIZE``.
  """

  axis_name: str = 'worker'
  spread_over: Sequence[str] = INNER_AXES
  bucket_size: int | None = None

  def __post_init__(self):
    if self.bucket_size is not None:
      _checks.positive_int(self.bucket_size, 'bucket_size')

  def bucket(self) -> int:
    """``bucket_size``, or ``BUCKET_SIZE`` where it is ``None``."""
    return BUCKET_SIZE if self.bucket_size is None else self.bucket_size

  @property
  def bound_axis(self) -> str:
    """``axis_name``, checked to be bound where the caller traces (else a
    ``NameError`` that says to wrap the step in ``vmap_workers`` or
    ``shard_map_workers``)."""
    return _checks.axis_bound(self.axis_name, 'a loc_opt cross-worker '
                              'collective')

  # ---------------------------------------------------------------- mesh ---
  def inner_axes(self) -> tuple[str, ...]:
    """The ``spread_over`` axes of the current (abstract) mesh, size > 1."""
    mesh = jax.sharding.get_abstract_mesh()
    names = getattr(mesh, 'axis_names', ()) or ()
    return tuple(a for a in self.spread_over
                 if a in names and mesh.shape[a] > 1)

  def _replicated_inside(self) -> bool:
    """Whether the worker's devices split only the batch (``data``): then
    its parameters, and the trees averaged over workers, are whole on every
    device of the worker. Under FSDP or tensor parallelism (``fsdp`` or
    ``tensor`` of size > 1) they are split, and a buffer made whole on
    every device would cost a full copy of the model per device."""
    mesh = jax.sharding.get_abstract_mesh()
    names = getattr(mesh, 'axis_names', ()) or ()
    return all(mesh.shape[a] == 1 for a in ('fsdp', 'tensor') if a in names)

  def inner_devices(self) -> int:
    """Devices per worker that values are spread over (1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(mesh.shape[a] for a in self.inner_axes())

  def size(self) -> int:
    """Number of workers."""
    return jax.lax.axis_size(self.bound_axis)

  def index(self) -> jax.Array:
    """This worker's index along the worker axis."""
    return jax.lax.axis_index(self.bound_axis)

  def spread(self, flat: jax.Array, multiple: int = 1) -> jax.Array:
    """Pads ``flat`` to ``multiple * inner_devices`` and shards it over them.

    Encoding a spread value runs block-parallel on the worker's devices, and
    the payload it yields is already spread for :meth:`all_gather`.
    """
    axes = self.inner_axes()
    flat = self.pad(flat, multiple)
    if axes:
      flat = jax.lax.with_sharding_constraint(flat, jax.P(axes))
    return flat

  def pad(self, flat: jax.Array, multiple: int = 1) -> jax.Array:
    """Pads ``flat`` as :meth:`spread` does, leaving it whole on every
    device: for a payload that goes to :meth:`pmean` / :meth:`psum` as it
    is (a linear codec's), which spread it themselves."""
    return pad_to(flat, multiple * self.inner_devices())

  def varying(self, tree: Any) -> Any:
    """Marks every leaf as varying over the worker axis inside shard_map.

    Inside ``jax.shard_map`` a collective's result is typed invariant over the
    worker axis, while per-worker values are varying; the two branches of a
    ``lax.cond`` (or a loop carry) must agree. This casts invariant leaves to
    varying there, and is the identity under ``vmap`` or outside a mesh.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if self.axis_name not in (getattr(mesh, 'manual_axes', ()) or ()):
      return tree

    def leaf(x):
      kind = getattr(jax.typeof(x), 'manual_axis_type', None)
      if kind is not None and self.axis_name in kind.varying:
        return x
      return jax.lax.pcast(x, self.bound_axis, to='varying')

    return jax.tree.map(leaf, tree)

  # --------------------------------------------------------- collectives ---
  def _spread_leaf(self, x, collective):
    """Runs ``collective`` on ``x`` flattened and spread; ``x`` whole on
    every device of the worker afterwards.

    Where the worker's devices split only the batch
    (:meth:`_replicated_inside`), inside a ``shard_map`` manual over them:
    each device takes its slice of the (replicated) buffer, ``collective``
    runs on the slices, and one all-gather inside the worker puts the
    result back together. Replicated in and out, so XLA's partitioner does
    not carry the split into the computations around it (left to itself it
    computed the optimizer updates on the halves of every leaf and gathered
    each leaf back: 315 small collectives in the 853k LM's sync step).
    Under FSDP or tensor parallelism the buffer stays spread (a sharding
    constraint) and the partitioner places the rest.
    """
    axes = self.inner_axes()
    if not axes or x.size < 2:
      return collective(x)
    if not self._replicated_inside():
      flat = self.spread(x.reshape(-1))
      return collective(flat)[:x.size].reshape(x.shape)
    flat = self.pad(x.reshape(-1))
    part = flat.size // self.inner_devices()

    def body(full):
      index = jax.lax.axis_index(axes)
      mine = jax.lax.dynamic_slice_in_dim(full, index * part, part)
      return jax.lax.all_gather(collective(mine), axes, tiled=True)

    # The gathered result is the same on every device of the worker (JAX
    # types an all_gather's result as varying, hence check_vma=False).
    out = jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(),
                        in_specs=jax.P(), out_specs=jax.P(),
                        axis_names=set(axes), check_vma=False)(flat)
    return out[:x.size].reshape(x.shape)

  def pmean(self, tree: Any) -> Any:
    """Mean over workers; each element crosses workers once per worker."""
    return jax.tree.map(
        lambda x: self._spread_leaf(
            x, lambda v: jax.lax.pmean(v, self.bound_axis)), tree)

  def _split_inside(self) -> bool:
    """Whether the worker's devices split its parameters (``fsdp`` or
    ``tensor`` > 1) and not the batch too (``data`` is 1 or absent): then a
    parameter-shaped leaf that FSDP / tensor parallelism splits over every
    device of the worker sends each element across workers once when it
    is reduced as it is, in its own shape and sharding."""
    axes = self.inner_axes()
    return bool(axes) and 'data' not in axes and \
        not self._replicated_inside()

  def pmean_buckets(self, tree: Any) -> Any:
    """:meth:`pmean` of a tree of float leaves, bounded in memory.

    Where the worker's devices split the parameters
    (:meth:`_split_inside`: FSDP and / or tensor parallelism, no data
    parallelism inside the worker), each leaf of at least ``bucket_size``
    elements (:meth:`bucket`) is averaged as it is, in its own shape: XLA's partitioner
    keeps its sharding (the parameters' own), each device all-reduces its
    own block across workers, and nothing is flattened, gathered inside the
    worker or held whole on a device. Such a leaf is assumed split over
    every device of the worker (as FSDP splits the parameters); one left
    whole on every device would be sent by each of them. The other leaves
    (and, elsewhere, every leaf) are packed in order into flat buffers of
    at most ``bucket_size`` elements (a larger leaf alone), each averaged
    by :meth:`pmean`: spread over the worker's devices, each element sent
    once. A mean is element-wise, so the values are those of :meth:`pmean`
    of the whole tree, bit for bit.
    """
    leaves, treedef = jax.tree.flatten(tree)
    out = [None] * len(leaves)
    # A subclass with its own mean (GroupComm's, over groups of workers)
    # averages every leaf through it.
    in_place = (type(self).pmean is Comm.pmean) and self._split_inside()
    size = self.bucket()
    rest = []
    for i, x in enumerate(leaves):
      if in_place and math.prod(jnp.shape(x)) >= size:
        out[i] = self._reduce_in_place(x)
      else:
        rest.append(i)
    for bucket in self.buckets([leaves[i] for i in rest]):
      bucket = [rest[j] for j in bucket]
      parts = [leaves[i] for i in bucket]
      flat = (parts[0].reshape(-1) if len(parts) == 1 else
              jnp.concatenate([jnp.ravel(x) for x in parts]))
      mean, start = self.pmean(flat), 0
      for i, x in zip(bucket, parts):
        out[i] = mean[start:start + x.size].reshape(x.shape)
        start += x.size
    return treedef.unflatten(out)

  def buckets(self, leaves: Sequence[Any]) -> list[list[int]]:
    """``leaves``' indices packed in order into buckets of at most
    :meth:`bucket` elements (a larger leaf alone)."""
    size = self.bucket()
    buckets, current, filled = [], [], 0
    for i, x in enumerate(leaves):
      n = math.prod(jnp.shape(x))
      if current and filled + n > size:
        buckets.append(current)
        current, filled = [], 0
      current.append(i)
      filled += n
    if current:
      buckets.append(current)
    return buckets

  def spread_rows(self, x: jax.Array) -> jax.Array:
    """``x`` split by its leading axis over the worker's devices, where
    they split the parameters (:meth:`_split_inside`) and the rows divide
    evenly: flattened, it is then already spread as :meth:`spread` lays a
    buffer out, without a copy of the whole leaf on a device (a leaf split
    along another axis moves once inside the worker). Else ``x``."""
    if (not self._split_inside() or not jnp.ndim(x)
        or jnp.shape(x)[0] % self.inner_devices()):
      return x
    return jax.lax.with_sharding_constraint(x, jax.P(self.inner_axes()))

  def _reduce_in_place(self, x: jax.Array) -> jax.Array:
    """The mean of ``x`` over workers in its own shape and sharding."""
    return jax.lax.pmean(x, self.bound_axis)

  def psum(self, tree: Any) -> Any:
    """Sum over workers; each element crosses workers once per worker."""
    return jax.tree.map(
        lambda x: self._spread_leaf(
            x, lambda v: jax.lax.psum(v, self.bound_axis)), tree)

  def pmax(self, tree: Any) -> Any:
    """Max over workers (meant for scalars such as shared scales)."""
    return jax.tree.map(lambda x: jax.lax.pmax(x, self.bound_axis), tree)

  def all_gather(self, tree: Any) -> Any:
    """Every worker's copy of each leaf, stacked on a new leading axis.

    Each device sends only its own slice of the (spread) payload: an
    ``all_gather`` over the worker axis of an automatically sharded value
    would first gather it inside the worker and then send all of it from
    every device.
    """
    axes = self.inner_axes()

    def leaf(x):
      if not axes or x.size < 2:
        return jax.lax.all_gather(x, self.bound_axis)
      mesh = jax.sharding.get_abstract_mesh()
      flat = self.spread(x.reshape(-1))
      gathered = jax.shard_map(
          lambda p: jax.lax.all_gather(p, self.bound_axis),
          mesh=mesh, in_specs=jax.P(axes), out_specs=jax.P(None, axes),
          axis_names=set(axes))(flat)
      return gathered[:, :x.size].reshape((gathered.shape[0],) + x.shape)

    return jax.tree.map(leaf, tree)

  def all_gather_packed(self, tree: Any) -> Any:
    """:meth:`all_gather` of a whole tree as one byte buffer.

    Every leaf is bitcast to bytes and the bytes are concatenated, so the
    tree crosses workers in a single collective (one message latency, one
    padding) instead of one per leaf; the result is laid out as
    :meth:`all_gather`'s.
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
      return tree
    flat = [jax.lax.bitcast_convert_type(x.reshape(-1), jnp.uint8).reshape(-1)
            for x in leaves]
    sizes = [int(f.size) for f in flat]
    gathered = self.all_gather(jnp.concatenate(flat))
    out, offset = [], 0
    for x, n in zip(leaves, sizes):
      part = gathered[:, offset:offset + n]
      offset += n
      width = jnp.dtype(x.dtype).itemsize
      if width > 1:
        part = part.reshape(part.shape[0], -1, width)
      part = jax.lax.bitcast_convert_type(part, x.dtype)
      out.append(part.reshape((part.shape[0],) + x.shape))
    return jax.tree.unflatten(treedef, out)

  def all_to_all(self, tree: Any) -> Any:
    """Exchanges parts: leaf ``[W, ...]`` row ``j`` goes to worker ``j``.

    The result's row ``i`` is what worker ``i`` sent to this worker. Each
    device sends only its own slice of every row (as :meth:`all_gather`).
    """
    axes = self.inner_axes()

    def leaf(x):
      def exchange(v):
        return jax.lax.all_to_all(v, self.bound_axis, 0, 0, tiled=True)

      w = x.shape[0]
      flat = x.reshape(w, -1)
      if not axes or flat.shape[1] < 2:
        return exchange(flat).reshape(x.shape)
      mesh = jax.sharding.get_abstract_mesh()
      m = flat.shape[1]
      flat = jnp.pad(flat, ((0, 0), (0, (-m) % self.inner_devices())))
      flat = jax.lax.with_sharding_constraint(flat, jax.P(None, axes))
      out = jax.shard_map(exchange, mesh=mesh, in_specs=jax.P(None, axes),
                          out_specs=jax.P(None, axes),
                          axis_names=set(axes))(flat)
      return out[:, :m].reshape(x.shape)

    return jax.tree.map(leaf, tree)

  def ppermute(self, tree: Any,
               perm: Sequence[tuple[int, int]]) -> Any:
    """Point-to-point exchange: worker ``src`` sends each leaf to ``dst``.

    ``perm`` holds static ``(source, destination)`` pairs of worker indices
    (each index at most once as a source and once as a destination); a
    worker that no pair sends to receives zeros, as ``lax.ppermute``. Each
    device sends only its own slice of the (spread) leaf, so each element
    crosses workers once per sending worker; the received slices are
    gathered back inside the worker.
    """
    axes = self.inner_axes()
    perm = tuple((int(s), int(d)) for s, d in perm)

    def exchange(v):
      return jax.lax.ppermute(v, self.bound_axis, perm)

    def leaf(x):
      if not axes or x.size < 2:
        return exchange(x)
      mesh = jax.sharding.get_abstract_mesh()
      flat = self.spread(x.reshape(-1))
      out = jax.shard_map(exchange, mesh=mesh, in_specs=jax.P(axes),
                          out_specs=jax.P(axes), axis_names=set(axes))(flat)
      return out[:x.size].reshape(x.shape)

    return jax.tree.map(leaf, tree)
