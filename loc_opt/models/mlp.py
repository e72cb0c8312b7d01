"""A small MLP in Flax NNX, for tests and quick experiments.

``num_layers`` dense layers ``in_dim -> hidden -> ... -> hidden -> out_dim``
with (tanh-approximate) GELU between them. Integer inputs are one-hot encoded to
``in_dim`` first, so with ``in_dim = out_dim = 256`` the model maps byte
tokens ``[B, T]`` to next-byte logits ``[B, T, 256]``: a bigram language model
with the same interface as the Transformer, cheap enough for trainer tests.
Float inputs ``[..., in_dim]`` are used as they are.

Kernels alternate ``('fsdp', 'tensor')`` and ``('tensor', 'fsdp')`` (Megatron
pairs); biases are replicated.
"""

import dataclasses
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from loc_opt.models import core

FSDP, TENSOR = core.FSDP, core.TENSOR


@dataclasses.dataclass(frozen=True)
class MLPConfig:
  """Sizes and dtypes of an :class:`MLP`.

  Attributes:
    in_dim: input features (or vocabulary size for integer inputs).
    hidden: width of the hidden layers.
    out_dim: output features.
    num_layers: number of dense layers (1 is a linear model).
    dtype: dtype of activations and matmuls; outputs are float32.
    param_dtype: dtype in which parameters are stored.
  """

  in_dim: int = 256
  hidden: int = 128
  out_dim: int = 256
  num_layers: int = 2
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    core.check_positive(self, ('in_dim', 'hidden', 'out_dim', 'num_layers'))
    for field in ('dtype', 'param_dtype'):
      dtype = core.as_dtype(getattr(self, field), f'model.{field}')
      object.__setattr__(self, field, dtype)


class MLP(nnx.Module):
  """Dense layers ``dense_0`` to ``dense_{L-1}`` with GELU in between.

  Build it under ``nnx.use_eager_sharding(False)`` (or a mesh with ``'fsdp'``
  and ``'tensor'`` axes): the sharding annotations are otherwise applied
  eagerly and need a mesh.

  Example:
    >>> with nnx.use_eager_sharding(False):
    ...   mlp = MLP(MLPConfig(in_dim=3, out_dim=2), rngs=nnx.Rngs(params=0))
    >>> mlp(jnp.ones((4, 3))).shape
    (4, 2)
  """

  def __init__(self, config: MLPConfig, *, rngs: nnx.Rngs):
    self.config = config
    dims = (
        [config.in_dim] + [config.hidden] * (config.num_layers - 1)
        + [config.out_dim]
    )
    for i in range(config.num_layers):
      sharding = (FSDP, TENSOR) if i % 2 == 0 else (TENSOR, FSDP)
      layer = nnx.Linear(
          dims[i],
          dims[i + 1],
          dtype=config.dtype,
          param_dtype=config.param_dtype,
          kernel_init=nnx.with_partitioning(
              nnx.initializers.lecun_normal(), sharding
          ),
          bias_init=nnx.with_partitioning(
              nnx.initializers.zeros_init(), (None,)
          ),
          rngs=rngs,
      )
      setattr(self, f'dense_{i}', layer)

  def __call__(self, x: jax.Array) -> jax.Array:
    config = self.config
    if jnp.issubdtype(x.dtype, jnp.integer):
      x = jax.nn.one_hot(x, config.in_dim, dtype=config.dtype)
    elif x.shape[-1:] != (config.in_dim,):
      raise ValueError(
          f'inputs must end in model.in_dim ({config.in_dim}), got {x.shape}'
      )
    for i in range(config.num_layers):
      x = getattr(self, f'dense_{i}')(x)
      if i < config.num_layers - 1:
        x = jax.nn.gelu(x, approximate=True)
    return x.astype(jnp.float32)


def build_mlp(config: MLPConfig) -> core.Model:
  """The functional :class:`~loc_opt.models.core.Model` of an :class:`MLP`.

  Args:
    config: the sizes and dtypes.

  Returns:
    A ``Model``; ``apply(params, x)`` maps int tokens ``[...]`` or features
    ``[..., in_dim]`` to float32 outputs ``[..., out_dim]``.
  """
  return core.from_nnx(lambda rngs: MLP(config, rngs=rngs))
