"""Drop-Muon: Muon steps on a random subset of layers per step."""

from collections.abc import Callable, Mapping, Sequence
import math
import typing
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loc_opt import _checks
from loc_opt.inner import _matrix

Sampler = Literal['progressive', 'bernoulli']


class SampledLayersState(NamedTuple):
  """State of :func:`sampled_layers`."""
  count: jax.Array  # shape=(), dtype=int32: steps taken.
  key: jax.Array  # shape=(2,), dtype=uint32: PRNG key, folded with count.
  active: jax.Array  # shape=(num_layers,), bool: layers updated last step.
  # The params' tree structure with each leaf's own inner state in place of
  # the leaf (so `optax.tree.map_params` finds a params-shaped tree here).
  inner_states: Any


def _resolve(tree_or_fn, params):
  return tree_or_fn(params) if callable(tree_or_fn) else tree_or_fn


def _leaf_transforms(transforms, param_labels, params):
  """One transform per leaf of ``params`` (flatten order)."""
  leaves = jax.tree.leaves(params)
  if isinstance(transforms, optax.GradientTransformation):
    return [transforms] * len(leaves)
  labels = jax.tree.leaves(_resolve(param_labels, params))
  if len(labels) != len(leaves):
    raise ValueError('param_labels must give one label per leaf')
  return [transforms[label] for label in labels]


def _layer_ids(layers, params):
  """``(layer id of each leaf, number of layers)``."""
  num = len(jax.tree.leaves(params))
  if layers is None:
    return list(range(num)), num
  ids = [int(i) for i in jax.tree.leaves(_resolve(layers, params))]
  if len(ids) != num:
    raise ValueError('layers must give one layer id per leaf')
  num_layers = max(ids) + 1
  if min(ids) < 0 or sorted(set(ids)) != list(range(num_layers)):
    raise ValueError(f'layer ids must cover 0..L-1, got {sorted(set(ids))}')
  return ids, num_layers


def _sample(key, num_layers, drop_prob, *, sampler, start_probs):
  """A bool ``(num_layers,)`` draw of the active layers."""
  if sampler == 'bernoulli':
    return jax.random.uniform(key, (num_layers,)) >= drop_prob
  if start_probs is None:
    start = jax.random.randint(key, (), 0, num_layers)
  else:
    if len(start_probs) != num_layers:
      raise ValueError(f'start_probs has {len(start_probs)} entries for '
                       f'{num_layers} layers')
    logits = jnp.log(jnp.asarray(start_probs, jnp.float32))
    start = jax.random.categorical(key, logits)
  return jnp.arange(num_layers) >= start


def sampled_layers(
    transforms: optax.GradientTransformation
    | Mapping[str, optax.GradientTransformation],
    param_labels: Any | Callable[[Any], Any] | None = None,
    drop_prob: jax.typing.ArrayLike = 0.5,
    *,
    sampler: Sampler = 'progressive',
    start_probs: Sequence[float] | None = None,
    layers: Any | Callable[[Any], Any] | None = None,
    seed: int = 0,
) -> optax.GradientTransformation:
  r"""Applies per-leaf transforms to a random subset of layers per step.

  Every parameter leaf has its own inner state. Each step a set :math:`S_k`
  of layers is drawn; leaves of active layers run their transform, leaves of
  the others emit zero updates and keep their state unchanged (momentum
  included). Samplers:

  * ``'progressive'`` (Randomized Progressive Training): draw a start index
    :math:`s_k` over the ``L`` layers (uniform, or ``start_probs``) and
    activate layers :math:`s_k, \ldots, L-1`, i.e. the ones with the largest
    ids, which should be nearest the output (backpropagation can then stop
    at layer :math:`s_k`; that needs ``stop_gradient`` in the model).
    ``drop_prob`` is unused.
  * ``'bernoulli'``: every layer is dropped independently with probability
    ``drop_prob``.

  Args:
    transforms: one transform for all leaves, or transforms by label. Each
      sees a single leaf (an array), so tree-global transforms (global-norm
      clipping) do not belong here.
    param_labels: with a mapping, the label of each leaf: a tree with the
      params' structure or a function of the params.
    drop_prob: drop probability of the ``'bernoulli'`` sampler.
    sampler: ``'progressive'`` or ``'bernoulli'``.
    start_probs: static probabilities of the start index for
      ``'progressive'`` (length ``L``); default uniform.
    layers: layer id (a Python int in ``[0, L)``) of each leaf, as a tree
      with the params' structure or a function of the params; leaves of one
      layer (weight and bias) are sampled together. Default: each leaf is
      its own layer, numbered in ``jax.tree`` flatten order (for dicts,
      sorted keys). Give it explicitly, input to output, for
      ``'progressive'``.
    seed: seed of the PRNG key in the state (same on all workers).

  Returns:
    A ``GradientTransformation``; ``state.active`` records the last draw.
    ``state.inner_states`` has the params' tree structure with each leaf's
    inner state in the leaf's place, so ``optax.tree.map_params`` maps its
    function over every array of those per-leaf states (the leaf's
    momentum and its step count alike).
  """
  _checks.one_of(sampler, 'sampler', typing.get_args(Sampler))

  def init_fn(params):
    txs = _leaf_transforms(transforms, param_labels, params)
    _, num_layers = _layer_ids(layers, params)
    return SampledLayersState(
        count=jnp.zeros([], jnp.int32),
        key=jax.random.PRNGKey(seed),
        active=jnp.zeros((num_layers,), bool),
        inner_states=jax.tree.unflatten(
            jax.tree.structure(params),
            [tx.init(p) for tx, p in zip(txs, jax.tree.leaves(params))]))

  def update_fn(updates, state, params=None):
    leaves, treedef = jax.tree.flatten(updates)
    param_leaves = ([None] * len(leaves) if params is None
                    else treedef.flatten_up_to(params))
    txs = _leaf_transforms(transforms, param_labels, updates)
    ids, num_layers = _layer_ids(layers, updates)
    active = _sample(jax.random.fold_in(state.key, state.count), num_layers,
                     drop_prob, sampler=sampler, start_probs=start_probs)
    new_updates, new_states = [], []
    for tx, i, g, s, p in zip(txs, ids, leaves,
                              treedef.flatten_up_to(state.inner_states),
                              param_leaves):
      u, s = jax.lax.cond(
          active[i],
          lambda g, s, p, tx=tx: tx.update(g, s, p),
          lambda g, s, p: (jnp.zeros_like(g), s),
          g, s, p)
      new_updates.append(u)
      new_states.append(s)
    return jax.tree.unflatten(treedef, new_updates), SampledLayersState(
        count=optax.safe_increment(state.count), key=state.key,
        active=active, inner_states=treedef.unflatten(new_states))

  # Jitted so that eager callers run one compiled update, not op by op.
  return optax.GradientTransformation(init_fn, jax.jit(update_fn))


def _scale_by_width() -> optax.GradientTransformation:
  """Muon's width factor ``sqrt(max(1, fan_out / fan_in))`` per leaf."""

  def update_fn(updates, state, params=None):
    del params

    def scale(u):
      fan_in, fan_out = _matrix.matrix_shape(u.shape)
      return u * math.sqrt(max(1.0, fan_out / fan_in))

    return jax.tree.map(scale, updates), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def _dimension_numbers(u):
  return optax.contrib.MuonDimensionNumbers(
      reduction_axis=tuple(range(u.ndim - 1)), output_axis=u.ndim - 1)


def scale_by_drop_muon(
    drop_prob: jax.typing.ArrayLike = 0.5,
    beta: jax.typing.ArrayLike = 0.95,
    ns_steps: int = 5,
    eps: jax.typing.ArrayLike = 1e-8,
    adam_b1: jax.typing.ArrayLike = 0.9,
    adam_b2: jax.typing.ArrayLike = 0.999,
    *,
    ns_coeffs: Sequence[float] = _matrix.MUON_NS_COEFFS,
    nesterov: bool = True,
    mu_dtype: Any = None,
    sampler: Sampler = 'progressive',
    start_probs: Sequence[float] | None = None,
    layers: Any | Callable[[Any], Any] | None = None,
    seed: int = 0,
    fallback: optax.GradientTransformation | None = None,
    matrix_mask: _matrix.MatrixMask = None,
) -> optax.GradientTransformation:
  r"""Drop-Muon's direction: Muon on the sampled layers, nothing elsewhere.

  :func:`sampled_layers` around, per matrix leaf,
  ``optax.contrib.scale_by_muon`` followed by Muon's width factor
  :math:`\sqrt{\max(1, \text{fan\_out}/\text{fan\_in})}` (exactly the matrix
  branch of ``optax.contrib.muon``), and ``fallback`` (default Nesterov Adam,
  the other branch of ``optax.contrib.muon``) for the other leaves. Active
  layers take a momentum step and an orthogonalized update; inactive layers
  get a zero update and keep their momentum. Leaves with more than two
  dimensions are orthogonalized as ``(prod(shape[:-1]), shape[-1])``.

  Momentum convention: ``beta`` is Optax's decay of the *old* momentum,
  :math:`M \leftarrow \beta M + (1-\beta) G`, with bias correction and (by
  default) Nesterov. The paper writes :math:`M \leftarrow (1-\beta') M +
  \beta' G`, so :math:`\beta' = 1 - \beta`; use ``nesterov=False`` for its
  plain momentum.

  The alias :func:`drop_muon` applies weight decay after this transform, so
  with ``weight_decay > 0`` inactive layers still decay.

  Args:
    drop_prob: drop probability per layer (``sampler='bernoulli'``).
    beta: momentum decay.
    ns_steps: Newton--Schulz iterations (static).
    eps: Newton--Schulz normalization guard and the fallback Adam's
      :math:`\epsilon`.
    adam_b1: the fallback Adam's :math:`\beta_1`.
    adam_b2: the fallback Adam's :math:`\beta_2`.
    ns_coeffs: quintic Newton--Schulz coefficients.
    nesterov: Nesterov momentum (Muon and the fallback Adam).
    mu_dtype: momentum dtype (default: the params' dtype, as in Optax).
    sampler: ``'progressive'`` (the paper's default, uniform start index) or
      ``'bernoulli'``; see :func:`sampled_layers`.
    start_probs: start-index distribution for ``'progressive'``.
    layers: layer ids of the leaves; see :func:`sampled_layers`.
    seed: seed of the sampler's key.
    fallback: transform for non-matrix leaves.
    matrix_mask: which leaves get the matrix rule: a tree of bools like the
      params, or a function of the params returning one; None: every leaf
      with two or more dimensions.

  Returns:
    A ``GradientTransformation``.

  Example:
    >>> import jax.numpy as jnp
    >>> from loc_opt.inner import drop_muon
    >>> tx = drop_muon(0.02, sampler='bernoulli', drop_prob=0.5)
    >>> state = tx.init({'w': jnp.ones((8, 4)), 'b': jnp.zeros(4)})

  References:
    Gruntkowska, Maziane, Qu, Richtárik, `Drop-Muon: Update Less, Converge
    Faster`, 2025.
  """
  muon = optax.chain(
      _matrix.gathered(optax.contrib.scale_by_muon(
          ns_coeffs=tuple(ns_coeffs), ns_steps=ns_steps, beta=beta, eps=eps,
          mu_dtype=mu_dtype, nesterov=nesterov,
          weight_dimension_numbers=_dimension_numbers)),
      _scale_by_width())
  fallback = _matrix.adam_fallback(fallback, adam_b1, adam_b2, eps,
                                   nesterov=nesterov)
  return sampled_layers(
      {_matrix.MATRIX: muon, _matrix.OTHER: fallback},
      lambda params: _matrix.matrix_labels(params, matrix_mask),
      drop_prob, sampler=sampler, start_probs=start_probs, layers=layers,
      seed=seed)


def drop_muon(
    learning_rate: optax.ScalarOrSchedule,
    drop_prob: jax.typing.ArrayLike = 0.5,
    beta: jax.typing.ArrayLike = 0.95,
    ns_steps: int = 5,
    eps: jax.typing.ArrayLike = 1e-8,
    adam_b1: jax.typing.ArrayLike = 0.9,
    adam_b2: jax.typing.ArrayLike = 0.999,
    weight_decay: jax.typing.ArrayLike = 0.0,
    mask: Any | None = None,
    *,
    ns_coeffs: Sequence[float] = _matrix.MUON_NS_COEFFS,
    nesterov: bool = True,
    mu_dtype: Any = None,
    sampler: Sampler = 'progressive',
    start_probs: Sequence[float] | None = None,
    layers: Any | Callable[[Any], Any] | None = None,
    seed: int = 0,
    fallback: optax.GradientTransformation | None = None,
    matrix_mask: _matrix.MatrixMask = None,
) -> optax.GradientTransformation:
  """Drop-Muon: :func:`scale_by_drop_muon`, weight decay, learning rate.

  With every layer active (``sampler='bernoulli', drop_prob=0``) this equals
  ``optax.contrib.muon(learning_rate, beta=beta, ...)`` on both matrix and
  fallback leaves. See :func:`scale_by_drop_muon` for the arguments;
  ``weight_decay`` and ``mask`` go to ``optax.add_decayed_weights``.

  References:
    Gruntkowska, Maziane, Qu, Richtárik, `Drop-Muon: Update Less, Converge
    Faster`, 2025.
  """
  return optax.chain(
      scale_by_drop_muon(
          drop_prob, beta, ns_steps, eps, adam_b1, adam_b2,
          ns_coeffs=ns_coeffs, nesterov=nesterov, mu_dtype=mu_dtype,
          sampler=sampler, start_probs=start_probs, layers=layers,
          seed=seed, fallback=fallback, matrix_mask=matrix_mask),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
