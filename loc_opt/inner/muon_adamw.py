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
from typing import Any

import jax
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
    nesterov: bool = True,
    adamw_paths: Sequence[str] = ADAMW_PATHS,
) -> optax.GradientTransformation:
  """Muon on the hidden matrices, AdamW (its own rate) on the rest.

  ``optax.contrib.muon`` with its parameter split given by
  :func:`muon_dimension_numbers` (by path) and AdamW's learning rate set to
  ``adamw_lr_ratio`` times Muon's. As in ``optax.contrib.muon``, ``eps`` and
  ``nesterov`` are shared by both branches (the AdamW branch is then
  NAdamW), and Muon's update is scaled by ``sqrt(max(1, fan_out /
  fan_in))``.

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
    nesterov: Nesterov momentum (both branches).
    adamw_paths: path parts whose leaves go to AdamW (see
      :func:`muon_adamw_labels`).

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
  return optax.contrib.muon(
      learning_rate, ns_steps=ns_steps, beta=momentum, eps=eps,
      weight_decay=weight_decay, nesterov=nesterov, adam_b1=adamw_b1,
      adam_b2=adamw_b2, adam_weight_decay=adamw_weight_decay,
      adam_learning_rate=adamw_lr,
      muon_weight_dimension_numbers=lambda params: muon_dimension_numbers(
          params, paths))
