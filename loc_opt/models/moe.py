"""Mixture-of-Experts MLP: top-k token-choice routing with a capacity.

The MoE variant of the reference LM (``model.moe.num_experts > 0``) replaces
each block's MLP by ``E`` expert MLPs and a router. Routing follows GShard
and Switch Transformer: per token the router's softmax over experts picks
the ``k`` largest (``top_k`` 1 or 2); every sequence is a *group* of ``S``
tokens, and each expert takes at most ``C = ceil(capacity_factor * S * k /
E)`` of a group's tokens, first choices before second choices, in token
order; the assignments past ``C`` are *dropped* (the token's residual
stream carries it past the layer, and the drop is counted).
``capacity_factor <= 0`` sets ``C = S``: nothing is ever dropped.

Dispatch and combine are einsums with a one-hot ``[G, S, E, C]`` tensor
(GShard's formulation), which XLA's SPMD partitioner turns into
all-to-alls when the groups (the batch) and the experts are split over the
same mesh axis: the expert kernels ``[E, d, f]`` carry the logical axis
``'expert'``, which the default rules map to ``fsdp`` (see
``docs/moe.md`` for why that axis and not a new one).

Gates: with ``k = 1`` the chosen expert's probability (Switch), with
``k = 2`` the two probabilities renormalized to sum to one (GShard). The
auxiliary losses, added to the training loss with their coefficients:

* load balancing (Switch): ``E * sum_e f_e P_e``, ``f_e`` the fraction of
  the token assignments routed to ``e`` (before capacity), ``P_e`` the
  mean router probability of ``e``; 1 at a uniform router;
* router z-loss (ST-MoE): ``mean_tokens(logsumexp(logits)^2)``.

An optional shared expert (DeepSeekMoE) is a dense MLP every token passes
through, added to the routed experts' output.

References:
  Lepikhin et al., GShard: Scaling Giant Models with Conditional
  Computation and Automatic Sharding, 2020.
  Fedus, Zoph, Shazeer, Switch Transformers: Scaling to Trillion Parameter
  Models with Simple and Efficient Sparsity, 2021.
  Zoph et al., ST-MoE: Designing Stable and Transferable Sparse Expert
  Models, 2022.
  Dai et al., DeepSeekMoE: Towards Ultimate Expert Specialization in
  Mixture-of-Experts Language Models, 2024.
"""

import dataclasses
import math
import numbers
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

_init = nnx.initializers
TOP_K = (1, 2)
DISPATCH = ('all_to_all', 'xla')
# The path of a router's kernel in the parameter tree (router sync, drift).
ROUTER_PATTERN = r'(^|/)router/'


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """The ``model.moe`` section.

  Attributes:
    num_experts: experts per block; 0 (default) keeps the dense MLP.
    top_k: experts per token, 1 or 2.
    capacity_factor: an expert's slots per group are ``ceil(capacity_factor
      * S * top_k / num_experts)``; ``<= 0``: ``S`` (no token dropped).
    balance_loss: coefficient of the load-balancing loss.
    z_loss: coefficient of the router z-loss.
    shared_expert: whether every token also passes a dense MLP.
    dispatch: ``'all_to_all'`` (default): the dispatched tokens are laid
      out by group (token-sharded) and then by expert, so the reshard
      between the two is an all-to-all (GShard), and back for the combine;
      ``'xla'``: only the expert-sharded layout is given and XLA's SPMD
      partitioner picks the rest (on CPU it gathers a worker's tokens onto
      every expert device and reduces the partial outputs). Same values.
  """

  num_experts: int = 0
  top_k: int = 1
  capacity_factor: float = 1.25
  balance_loss: float = 0.01
  z_loss: float = 0.001
  shared_expert: bool = False
  dispatch: str = 'all_to_all'

  def __post_init__(self):
    e = self.num_experts
    if isinstance(e, bool) or not isinstance(e, numbers.Integral) or e < 0:
      raise ValueError(f'model.moe.num_experts must be an int >= 0, got {e!r}')
    if self.top_k not in TOP_K or isinstance(self.top_k, bool):
      raise ValueError(f'model.moe.top_k must be 1 or 2, got {self.top_k!r}')
    if e and self.top_k > e:
      raise ValueError(f'model.moe.top_k ({self.top_k}) exceeds '
                       f'model.moe.num_experts ({e})')
    for field in ('capacity_factor', 'balance_loss', 'z_loss'):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f'model.moe.{field} must be a number, got '
                         f'{value!r}')
    for field in ('balance_loss', 'z_loss'):
      if getattr(self, field) < 0:
        raise ValueError(f'model.moe.{field} must be >= 0, got '
                         f'{getattr(self, field)!r}')
    if self.dispatch not in DISPATCH:
      raise ValueError(f'model.moe.dispatch must be one of {list(DISPATCH)}, '
                       f'got {self.dispatch!r}')
    if type(self.shared_expert) is not bool:
      raise ValueError('model.moe.shared_expert must be a bool, got '
                       f'{self.shared_expert!r}')

  @property
  def enabled(self) -> bool:
    return self.num_experts > 0


def as_moe_config(value: Any) -> MoeConfig:
  """``model.moe`` as a :class:`MoeConfig`: ``None`` (dense), a mapping of
  its fields, or a :class:`MoeConfig`."""
  if value is None:
    return MoeConfig()
  if isinstance(value, MoeConfig):
    return value
  if hasattr(value, 'to_dict'):
    value = value.to_dict()
  if not isinstance(value, dict):
    raise ValueError(f'model.moe must be a mapping of fields, got {value!r}')
  known = {f.name for f in dataclasses.fields(MoeConfig)}
  unknown = sorted(set(value) - known)
  if unknown:
    raise ValueError(f'model.moe.{unknown[0]} is not a field; valid fields: '
                     f'{sorted(known)}')
  return MoeConfig(**value)


def capacity(moe: MoeConfig, group_size: int) -> int:
  """Slots per expert and group (see :class:`MoeConfig`)."""
  if moe.capacity_factor <= 0:
    return group_size
  slots = moe.capacity_factor * group_size * moe.top_k / moe.num_experts
  return max(1, min(group_size, math.ceil(slots)))


def route(logits: jax.Array, top_k: int, slots: int
          ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """Top-k token-choice routing of ``[G, S, E]`` router logits.

  Returns:
    ``(dispatch, combine, stats)``: ``dispatch`` ``[G, S, E, C]`` is 1
    where token ``s`` of group ``g`` takes slot ``c`` of expert ``e``;
    ``combine`` is ``dispatch`` times the gate; ``stats`` (float32):
    ``load`` ``[E]`` (fraction of the assignments per expert, before
    capacity), ``dropped`` (fraction of the assignments dropped),
    ``entropy`` (mean over tokens of the router's entropy, nats),
    ``balance_loss`` and ``z_loss`` (see the module docstring).
  """
  logits = logits.astype(jnp.float32)
  num_experts = logits.shape[-1]
  probs = jax.nn.softmax(logits, axis=-1)
  remaining, masks, gates = probs, [], []
  for _ in range(top_k):
    mask = jax.nn.one_hot(jnp.argmax(remaining, axis=-1), num_experts,
                          dtype=jnp.float32)
    masks.append(mask)
    gates.append(jnp.sum(probs * mask, axis=-1))
    remaining = jnp.where(mask > 0, -1.0, remaining)
  if top_k > 1:
    total = sum(gates)
    gates = [g / total for g in gates]
  # Slots: first choices in token order, then second choices after them.
  filled = jnp.zeros(logits.shape[:1] + logits.shape[2:], jnp.float32)
  dispatch = combine = 0.0
  for mask, gate in zip(masks, gates):
    position = jnp.cumsum(mask, axis=1) - 1 + filled[:, None, :]
    slot = jnp.sum(position * mask, axis=-1).astype(jnp.int32)  # [G, S]
    # one_hot of a slot >= C is all zeros: the assignment is dropped.
    taken = mask[..., None] * jax.nn.one_hot(slot, slots,
                                             dtype=jnp.float32)[:, :, None]
    dispatch = dispatch + taken
    combine = combine + gate[..., None, None] * taken
    filled = filled + jnp.sum(mask, axis=1)
  assigned = sum(masks)  # [G, S, E]
  load = jnp.mean(assigned, axis=(0, 1)) / top_k
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  stats = {
      'load': load,
      'dropped': 1.0 - jnp.sum(dispatch) / (top_k * assigned.shape[0]
                                            * assigned.shape[1]),
      'entropy': -jnp.mean(jnp.sum(probs * log_probs, axis=-1)),
      'balance_loss': num_experts * jnp.sum(
          load * jnp.mean(probs, axis=(0, 1))),
      'z_loss': jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
  }
  return dispatch, combine, stats


class MoeMLP(nnx.Module):
  """Router and ``E`` expert MLPs (``down(gelu(up(x)))``, tanh GELU).

  ``__call__(x)`` maps the residual stream ``[B, T, d]`` to ``(y, stats)``
  with ``stats`` as :func:`route` gives them and ``aux_loss``, the
  weighted sum of the auxiliary losses.
  """

  def __init__(self, config: Any, *, rngs: nnx.Rngs,
               shared: nnx.Module | None = None):
    self.config = config
    moe = config.moe
    e, d, f = moe.num_experts, config.d_model, config.d_ff
    residual = _init.variance_scaling(
        1.0 / (2 * config.num_layers), 'fan_in', 'truncated_normal',
        in_axis=-2, out_axis=-1, batch_axis=(0,))
    fan_in = _init.variance_scaling(1.0, 'fan_in', 'truncated_normal',
                                    in_axis=-2, out_axis=-1, batch_axis=(0,))
    self.router = nnx.Linear(
        d, e, use_bias=False, dtype=jnp.float32,
        param_dtype=config.param_dtype,
        kernel_init=nnx.with_partitioning(_init.normal(stddev=0.02),
                                          ('embed', None)),
        rngs=rngs)
    key = rngs.params()
    self.up = nnx.Param(
        fan_in(key, (e, d, f), config.param_dtype),
        out_sharding=('expert', 'embed', 'mlp'))
    key = rngs.params()
    self.down = nnx.Param(
        residual(key, (e, f, d), config.param_dtype),
        out_sharding=('expert', 'mlp', 'embed'))
    self.shared = shared

  def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
    config, moe = self.config, self.config.moe
    dtype = config.dtype
    with jax.named_scope('router'):
      logits = self.router(x.astype(jnp.float32))
      dispatch, combine, stats = route(logits, moe.top_k,
                                       capacity(moe, x.shape[1]))
    with jax.named_scope('experts'):
      # Token-sharded (each device its groups' slots of every expert), then
      # expert-sharded: the reshard between the two is an all-to-all when
      # the groups and the experts split over the same mesh axis (GShard).
      by_group = moe.dispatch == 'all_to_all'
      inputs = jnp.einsum('gsec,gsd->egcd', dispatch.astype(dtype), x)
      if by_group:
        inputs = config.constrain(inputs, None, 'batch', None, None)
      inputs = config.constrain(inputs, 'expert', 'batch', None, 'embed')
      hidden = jnp.einsum('egcd,edf->egcf', inputs,
                          self.up[...].astype(dtype))
      hidden = config.constrain(hidden, 'expert', 'batch', None, 'mlp')
      hidden = jax.nn.gelu(hidden, approximate=True)
      out = jnp.einsum('egcf,efd->egcd', hidden,
                       self.down[...].astype(dtype))
      out = config.constrain(out, 'expert', 'batch', None, 'embed')
      if by_group:
        out = config.constrain(out, None, 'batch', None, None)  # all-to-all
      y = jnp.einsum('gsec,egcd->gsd', combine.astype(dtype), out)
      y = config.constrain(y, 'batch', 'length', 'embed')
    if self.shared is not None:
      y = y + self.shared(x)
    stats['aux_loss'] = (moe.balance_loss * stats['balance_loss']
                         + moe.z_loss * stats['z_loss'])
    return y, stats
