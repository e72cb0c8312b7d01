"""The functional model interface: Flax NNX modules as pure functions.

The trainer and the optimizers see a model only as plain pytrees: ``init``
returns parameters as a nested ``dict`` of arrays, ``apply`` is a pure function
of those parameters, and ``specs`` says how each parameter is sharded inside a
worker. :func:`from_nnx` derives all of it from any Flax NNX module whose
parameters carry ``nnx.with_partitioning`` annotations.
"""

from collections.abc import Callable, Iterable, Sequence
import math
import numbers
from typing import Any, NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp

PyTree = Any
P = jax.P

# Axis names a model may use in its within-worker sharding annotations.
FSDP = 'fsdp'
TENSOR = 'tensor'


class Model(NamedTuple):
  """A model as pure functions of plain pytrees.

  Attributes:
    init: ``rng -> params``; ``params`` is a nested ``dict`` of ``jax.Array``
      (no ``nnx.Variable`` or ``nnx.State``). Jittable, and ``jax.eval_shape``
      of it gives the abstract parameters.
    apply: ``(params, inputs) -> outputs``. For language models ``inputs`` are
      int32 tokens ``[B, T]`` and the outputs float32 logits ``[B, T, V]``.
      Pure, jittable, ``vmap``-able over a leading parameter axis.
    specs: the structure of ``params``, each leaf a ``jax.P`` over the
      within-worker axis names ``'fsdp'`` and ``'tensor'``. Pass it through
      :func:`resolve_specs` for a mesh that lacks one of them.
    num_params: the total number of scalar parameters.
    apply_aux: ``(params, inputs) -> (outputs, aux)`` for a model with
      auxiliary outputs (a Mixture-of-Experts LM: ``aux['aux_loss']``, a
      float32 scalar the training loss adds, and routing statistics); None
      for a model without them.
  """

  init: Callable[[jax.Array], PyTree]
  apply: Callable[[PyTree, jax.Array], jax.Array]
  specs: PyTree
  num_params: int
  apply_aux: Callable[[PyTree, jax.Array], tuple[jax.Array, Any]] | None = None


def from_nnx(make: Callable[[nnx.Rngs], nnx.Module],
             aux_method: str | None = None) -> Model:
  """Wraps a Flax NNX module constructor as a functional :class:`Model`.

  The module is built once abstractly (``nnx.eval_shape``, no memory) to read
  its graph definition, parameter shapes and sharding annotations. ``init``
  builds it for real and returns ``nnx.to_pure_dict`` of its state; ``apply``
  rebuilds the module from a pure dict with ``nnx.merge`` inside the trace
  and calls it.

  Variables are created with eager sharding off: annotations are recorded as
  metadata (and surface in ``specs``) but never placed at construction, so
  ``init`` works with no mesh set, and placing the parameters is the caller's
  job (``jax.jit(init, out_shardings=...)``).

  Args:
    make: builds the module from an ``nnx.Rngs`` that has a ``params`` stream.
      Every ``nnx.Param`` should carry an ``out_sharding`` annotation
      (``nnx.with_partitioning``); unannotated ones are replicated.
    aux_method: the name of a method of the module that returns
      ``(outputs, aux)``; it becomes ``Model.apply_aux`` (None: no
      ``apply_aux``).

  Returns:
    A :class:`Model`.

  Example:
    >>> model = from_nnx(lambda rngs: nnx.Linear(2, 3, rngs=rngs))
    >>> params = model.init(jax.random.key(0))
    >>> model.apply(params, jnp.ones((1, 2))).shape
    (1, 3)
  """

  def build(rng: jax.Array) -> nnx.Module:
    with nnx.use_eager_sharding(False):
      return make(nnx.Rngs(params=rng))

  abstract = nnx.eval_shape(lambda: build(jax.random.key(0)))
  graphdef, abstract_state = nnx.split(abstract)
  specs = nnx.to_pure_dict(nnx.get_partition_spec(abstract_state))
  shapes = nnx.to_pure_dict(abstract_state)
  num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
  treedef = jax.tree.structure(shapes)

  def init(rng: jax.Array) -> PyTree:
    _, state = nnx.split(build(rng))
    return nnx.to_pure_dict(state)

  def merged(params: PyTree) -> nnx.Module:
    if jax.tree.structure(params) != treedef:
      raise ValueError(
          'params do not have the structure of this model; expected '
          f'{treedef}, got {jax.tree.structure(params)}'
      )
    with nnx.use_eager_sharding(False):
      return nnx.merge(graphdef, params)

  def apply(params: PyTree, inputs: jax.Array) -> jax.Array:
    return merged(params)(inputs)

  apply_aux = None
  if aux_method is not None:
    def apply_aux(params: PyTree, inputs: jax.Array):
      return getattr(merged(params), aux_method)(inputs)

  return Model(init=init, apply=apply, specs=specs, num_params=num_params,
               apply_aux=apply_aux)


def _keep_axes(entry: Any, names: frozenset[str]) -> Any:
  """A ``PartitionSpec`` entry without the axis names outside ``names``."""
  if entry is None or entry is P.UNCONSTRAINED:
    return entry
  if isinstance(entry, str):
    return entry if entry in names else None
  kept = tuple(a for a in entry if a in names)
  if not kept:
    return None
  return kept[0] if len(kept) == 1 else kept


def resolve_specs(
    specs: PyTree, mesh_axis_names: Iterable[str] | jax.sharding.Mesh
) -> PyTree:
  """Drops from ``specs`` every axis name that the mesh does not have.

  A model annotates its parameters over ``'fsdp'`` and ``'tensor'``; on a mesh
  with only one of them (or neither) the missing axis means "replicated".
  Entries that name several axes keep those that exist.

  Args:
    specs: a pytree of ``jax.P`` (for example ``Model.specs``).
    mesh_axis_names: the mesh's axis names, or the mesh itself.

  Returns:
    ``specs`` with the same structure, each ``jax.P`` naming only mesh axes.

  Example:
    >>> resolve_specs({'w': jax.P('fsdp', 'tensor')}, ('worker', 'fsdp'))
    {'w': P('fsdp', None)}
  """
  if isinstance(mesh_axis_names, jax.sharding.Mesh):
    mesh_axis_names = mesh_axis_names.axis_names
  names = frozenset(mesh_axis_names)

  def resolve(spec: P) -> P:
    return P(*(_keep_axes(entry, names) for entry in spec))

  return jax.tree.map(resolve, specs, is_leaf=lambda x: isinstance(x, P))


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  r"""Per-position softmax cross-entropy, vocabulary-parallel, in float32.

  .. math::
    \ell_{bt} = \log\textstyle\sum_v e^{z_{btv}} - \sum_v [v = y_{bt}]\,
      z_{btv}

  The target's logit is picked by a mask over the vocabulary (an iota
  compared with the target), not by a gather: when the vocabulary dimension
  of ``logits`` is split over a mesh axis (tensor parallelism) every shard
  computes its partial max, sum of exponentials and masked sum, and GSPMD
  combines them with small all-reduces over ``[..]`` rows. A
  ``take_along_axis`` over a split vocabulary instead aborts XLA's SPMD
  partitioner (jaxlib 0.12, ``PartitionGather``). The values equal
  ``optax.softmax_cross_entropy_with_integer_labels`` bit for bit (the mask
  adds exact zeros), and so do the gradients.

  Args:
    logits: ``[..., V]`` unnormalized scores (any float dtype; upcast).
    targets: ``[...]`` integer labels in ``[0, V)``.

  Returns:
    ``[...]`` float32 losses in nats.

  References:
    Shoeybi et al., Megatron-LM: Training Multi-Billion Parameter Language
    Models Using Model Parallelism, 2019 (vocabulary-parallel
    cross-entropy).
  """
  logits = logits.astype(jnp.float32)
  targets = jnp.asarray(targets)
  vocab = jax.lax.broadcasted_iota(targets.dtype, logits.shape,
                                   logits.ndim - 1)
  picked = jnp.where(vocab == targets[..., None], logits, 0.0)
  return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(picked, axis=-1)


def lm_loss(
    logits: jax.Array,
    targets: jax.Array,
    mask: jax.Array | None = None,
) -> jax.Array:
  r"""Mean next-token cross-entropy, in float32.

  .. math::
    \ell = \frac{\sum_{b,t} m_{bt}\,(\log\textstyle\sum_v e^{z_{btv}}
      - z_{b t y_{bt}})}{\max(1, \sum_{b,t} m_{bt})}

  The caller aligns the two: ``logits = apply(params, tokens[:, :-1])`` and
  ``targets = tokens[:, 1:]``. Computed by :func:`cross_entropy`, so it
  partitions over a vocabulary split across devices.

  Args:
    logits: ``[..., V]`` unnormalized scores (any float dtype; upcast).
    targets: ``[...]`` integer labels in ``[0, V)``.
    mask: optional ``[...]`` weights (bool or float); positions with weight 0
      do not count. Default: every position counts.

  Returns:
    A float32 scalar: the (masked) mean cross-entropy in nats.
  """
  if logits.shape[:-1] != targets.shape:
    raise ValueError(
        f'logits {logits.shape} and targets {targets.shape} disagree: '
        'logits must be targets.shape + (vocab_size,)'
    )
  losses = cross_entropy(logits, targets)
  if mask is None:
    return jnp.mean(losses)
  if mask.shape != targets.shape:
    raise ValueError(
        f'mask {mask.shape} must have the shape of targets {targets.shape}'
    )
  mask = mask.astype(jnp.float32)
  return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def as_dtype(value: Any, field: str) -> jnp.dtype:
  """Parses a floating dtype given as a string or dtype-like ``value``.

  Args:
    value: ``'float32'``, ``'bfloat16'``, ``jnp.float32``, ...
    field: the config field name for the error message.

  Returns:
    The ``jnp.dtype``.

  Raises:
    ValueError: if ``value`` is not a floating dtype.
  """
  try:
    dtype = jnp.dtype(value)
  except TypeError as e:
    raise ValueError(
        f'{field} must be a floating dtype such as "float32" or "bfloat16", '
        f'got {value!r}'
    ) from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f'{field} must be a floating dtype, got {value!r}')
  return dtype


def check_choice(value: str, values: Sequence[str], field: str) -> None:
  """Raises a ``ValueError`` naming ``model.<field>`` unless ``value`` is one
  of ``values``."""
  if value not in values:
    raise ValueError(f'model.{field} must be one of {list(values)}, got '
                     f'{value!r}')


def resolve_auto(value: str, values: Sequence[str], field: str,
                 on_cpu: str) -> str:
  """``value`` (checked by :func:`check_choice`), with ``'auto'`` resolved
  to ``on_cpu`` on CPU backends and ``'xla'`` elsewhere.

  ``'auto'`` asks for the default backend, so call it after the backend's
  configuration (e.g. ``jax_num_cpu_devices``) is set.
  """
  check_choice(value, values, field)
  if value == 'auto':
    return on_cpu if jax.default_backend() == 'cpu' else 'xla'
  return value


def check_positive(config: Any, fields: Sequence[str]) -> None:
  """Raises a ``ValueError`` naming the first non-positive-int field."""
  for field in fields:
    value = getattr(config, field)
    integral = isinstance(value, numbers.Integral)
    if isinstance(value, bool) or not integral or value < 1:
      raise ValueError(f'model.{field} must be a positive int, got {value!r}')
