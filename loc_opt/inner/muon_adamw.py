r"""Muon on the hidden matrices, AdamW on the rest, chosen by parameter name.

MuLoCo's inner optimizer: Muon (momentum, then a Newton--Schulz
orthogonalization of each matrix update) on the 2-D *hidden* matrices of a
Transformer (attention and MLP kernels), and AdamW on the token embedding,
the output head, norm gains, biases and every other leaf with fewer than two
dimensions. The split is by the parameter's path, not by its rank:
``optax.contrib.muon`` sends every 2-D leaf to Muon by default, embedding and
head included.

.. math::

  u = \begin{cases}
    -\eta \, (\mathrm{NS}(m_t) + \lambda w) & \text{hidden matrices (Muon)} \\
    -\rho \eta \, \mathrm{AdamW}(g)_t & \text{the others}
  \end{cases}

with ``m_t`` Muon's (Nesterov) momentum, ``NS`` the quintic Newton--Schulz
iteration and Muon's width factor (``optax.contrib.scale_by_muon``), and
``rho = adamw_lr_ratio``: AdamW's learning rate is a fixed multiple of
Muon's, so both follow the same schedule (``make_optimizer`` injects the
scheduled value of ``learning_rate``) while AdamW keeps its own scale.

References:
  Jordan et al., *Muon: An optimizer for hidden layers in neural networks*,
  2024 (blog post).

  Thérien, Huang, Rish, Belilovsky, *MuLoCo: Muon is a practical inner
  optimizer for DiLoCo*, 2025 (arXiv 2505.23725): the parameter groups.
"""

from collections.abc import Sequence
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

MUON = 'muon'
ADAMW = 'adamw'
# Path parts of the reference Transformer LM (loc_opt.models.transformer)
# whose leaves go to AdamW: token embedding, output head, norm gains.
ADAMW_PATHS = ('embed', 'head', 'norm')


def muon_adamw_labels(params: Any,
                      adamw_paths: Sequence[str] = ADAMW_PATHS) -> Any:
  """``'muon'`` or ``'adamw'`` for every leaf of ``params``.

  A leaf goes to AdamW when its path (``jax.tree_util.keystr``, lower case)
  contains one of ``adamw_paths`` or when it has fewer than two dimensions;
  every other leaf (the hidden matrices) goes to Muon.

  Args:
    params: a tree of arrays or ``jax.ShapeDtypeStruct``.
    adamw_paths: path parts that select AdamW.

  Returns:
    A tree of labels with the structure of ``params``.
  """
  parts = tuple(p.lower() for p in adamw_paths)

  def label(path, x):
    name = jax.tree_util.keystr(path).lower()
    if len(x.shape) < 2 or any(p in name for p in parts):
      return ADAMW
    return MUON

  return jax.tree_util.tree_map_with_path(label, params)


def muon_dimension_numbers(params: Any,
                           adamw_paths: Sequence[str] = ADAMW_PATHS) -> Any:
  """``optax.contrib.muon``'s ``muon_weight_dimension_numbers`` for the
  labels of :func:`muon_adamw_labels`: ``None`` (AdamW) or the last two axes
  as ``(reduction, output)``, leading axes (stacked layers) as batch."""
  labels = muon_adamw_labels(params, adamw_paths)

  def dims(label, x):
    if label == ADAMW:
      return None
    return optax.contrib.MuonDimensionNumbers(len(x.shape) - 2,
                                              len(x.shape) - 1)

  return jax.tree.map(dims, labels, params)


def muon_adamw(
    learning_rate: optax.ScalarOrSchedule,
    adamw_lr_ratio: jax.typing.ArrayLike = 1.0,
    momentum: jax.typing.ArrayLike = 0.95,
    weight_decay: jax.typing.ArrayLike = 0.0,
    adamw_b1: jax.typing.ArrayLike = 0.9,
    adamw_b2: jax.typing.ArrayLike = 0.95,
    adamw_weight_decay: jax.typing.ArrayLike = 0.0,
    eps: jax.typing.ArrayLike = 1e-8,
    *,
    ns_steps: int = 5,
    ns_coeffs: Sequence[float] | Sequence[Sequence[float]] = (
        3.4445, -4.7750, 2.0315),
    nesterov: bool = True,
    adamw_paths: Sequence[str] = ADAMW_PATHS,
    width_scale: str = 'max1',
) -> optax.GradientTransformation:
  """Muon on the hidden matrices, AdamW (its own rate) on the rest.

  ``optax.contrib.muon`` with its parameter split given by
  :func:`muon_dimension_numbers` (by path) and AdamW's learning rate set to
  ``adamw_lr_ratio`` times Muon's. As in ``optax.contrib.muon``, ``eps`` and
  ``nesterov`` are shared by both branches (with ``nesterov`` the AdamW
  branch is NAdamW). Muon's update of a ``fan_in x fan_out`` matrix is
  scaled by ``sqrt(max(1, fan_out / fan_in))`` (``width_scale='max1'``,
  Jordan's and optax's rule) or by ``sqrt(fan_out / fan_in)``
  (``'spectral'``: Dion's ``adjust_lr='spectral_norm'``, which MuLoCo's
  research code uses; a 512 -> 128 projection then gets 0.5, not 1). With
  ``'spectral'`` Muon's weight decay stays ``lr * weight_decay * w``, unscaled
  by the width factor, as in Dion.

  Args:
    learning_rate: Muon's learning rate (a float or a schedule).
    adamw_lr_ratio: AdamW's learning rate over Muon's.
    momentum: Muon's momentum ``beta``.
    weight_decay: Muon's decoupled weight decay (times the learning rate).
    adamw_b1: AdamW's first-moment decay.
    adamw_b2: AdamW's second-moment decay.
    adamw_weight_decay: AdamW's decoupled weight decay.
    eps: the epsilon of the Newton--Schulz normalization and of AdamW.
    ns_steps: Newton--Schulz iterations.
    ns_coeffs: the quintic's ``(a, b, c)``, one triple for every iteration
      (default Jordan's) or one per iteration (e.g. :data:`DION_NS_COEFFS`).
    nesterov: Nesterov momentum (both branches).
    adamw_paths: path parts whose leaves go to AdamW (see
      :func:`muon_adamw_labels`).
    width_scale: ``'max1'`` or ``'spectral'`` (see above).

  Returns:
    The gradient transformation.

  Example:
    >>> tx = muon_adamw(0.02, adamw_lr_ratio=0.15, weight_decay=0.01)
    >>> tx = loc_opt.diloco(tx, sync_every=30,
    ...                     codec=('statistical', {'bits': 2}))
  """
  if callable(learning_rate):
    adamw_lr = lambda count: adamw_lr_ratio * learning_rate(count)
  else:
    adamw_lr = adamw_lr_ratio * learning_rate
  paths = tuple(adamw_paths)
  if width_scale not in WIDTH_SCALES:
    raise ValueError(f'width_scale must be one of {WIDTH_SCALES}, got '
                     f'{width_scale!r}')
  spectral = width_scale == 'spectral'
  coeffs = tuple(ns_coeffs)
  if coeffs and isinstance(coeffs[0], Sequence):
    coeffs = tuple(tuple(float(v) for v in c) for c in coeffs)
    if len(coeffs) != ns_steps or any(len(c) != 3 for c in coeffs):
      raise ValueError(f'ns_coeffs per iteration must be ns_steps={ns_steps} '
                       f'triples, got {coeffs}')
  muon = optax.contrib.muon(
      learning_rate, ns_coeffs=coeffs, ns_steps=ns_steps, beta=momentum,
      eps=eps,
      weight_decay=0.0 if spectral else weight_decay, nesterov=nesterov,
      adam_b1=adamw_b1, adam_b2=adamw_b2,
      adam_weight_decay=adamw_weight_decay, adam_learning_rate=adamw_lr,
      muon_weight_dimension_numbers=lambda params: muon_dimension_numbers(
          params, paths))
  if not spectral:
    return muon
  return optax.chain(muon, _spectral_width(learning_rate, weight_decay,
                                           paths))


WIDTH_SCALES = ('max1', 'spectral')
# Newton--Schulz coefficients per iteration of Dion's Muon
# (``zeropower_via_newtonschulz5``), which MuLoCo's research code uses.
DION_NS_COEFFS = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                  (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
                  (2.8366, -3.0525, 1.2012))


def _spectral_width(learning_rate: optax.ScalarOrSchedule,
                    weight_decay: jax.typing.ArrayLike,
                    paths: tuple[str, ...]) -> optax.GradientTransformation:
  """After ``optax.contrib.muon`` (no weight decay): each Muon update times
  ``min(1, sqrt(fan_out / fan_in))``, turning its ``sqrt(max(1, fan_out /
  fan_in))`` into ``sqrt(fan_out / fan_in)``, then Muon's decoupled weight
  decay ``-lr * weight_decay * w``."""

  def init_fn(params):
    del params
    return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError('muon_adamw(width_scale=\'spectral\') needs params')
    lr = (learning_rate(state.count) if callable(learning_rate)
          else learning_rate)
    labels = muon_adamw_labels(updates, paths)

    def leaf(label, u, p):
      if label != MUON:
        return u
      fan_in, fan_out = u.shape[-2], u.shape[-1]
      factor = min(1., math.sqrt(fan_out / fan_in))
      return (factor * u - lr * weight_decay * p).astype(u.dtype)

    return (jax.tree.map(leaf, labels, updates, params),
            optax.ScaleByScheduleState(
                count=optax.safe_increment(state.count)))

  return optax.GradientTransformation(init_fn, update_fn)
