"""A decoder-only Transformer language model in Flax NNX.

The architecture is a small pre-norm GPT with current defaults:

* byte-level token embedding (``vocab_size=256``), no position table:
  positions enter through rotary embeddings (RoPE) on queries and keys, so the
  model has no parameter tied to ``max_len`` (``max_len`` only bounds the
  sequence length ``apply`` accepts);
* ``num_layers`` blocks ``x += Attn(RMSNorm(x)); x += MLP(RMSNorm(x))`` with
  causal multi-head self-attention and a GELU MLP, no biases, no dropout;
* a final RMSNorm and an untied output head (its own ``[d_model, vocab]``
  kernel), so the embedding and the head can be sharded independently.

Every parameter is annotated with ``nnx.with_partitioning`` over the
within-worker mesh axes ``'fsdp'`` and ``'tensor'`` (Megatron layout: the
first matmul of a pair is split over its output, the second over its input):

====================  ==================  ======================
parameter             shape               sharding
====================  ==================  ======================
embed/embedding       [vocab, d_model]    (None, 'fsdp')
attn/{query,key,      [d_model, d_model]  ('fsdp', 'tensor')
value}/kernel
attn/out/kernel       [d_model, d_model]  ('tensor', 'fsdp')
mlp/up/kernel         [d_model, d_ff]     ('fsdp', 'tensor')
mlp/down/kernel       [d_ff, d_model]     ('tensor', 'fsdp')
*_norm/scale          [d_model]           (None,)
head/kernel           [d_model, vocab]    ('fsdp', 'tensor')
====================  ==================  ======================

The embedding table is not split over the vocabulary: with the table sharded
``('tensor', 'fsdp')`` the XLA SPMD partitioner (jaxlib 0.12, CPU) aborts on
the token gather inside a ``shard_map`` manual over ``worker`` ("Check failed:
partition_group_list.num_replica_groups() ..."). The vocabulary is small
(bytes), so splitting only the feature dimension costs nothing.

Activations carry no sharding constraints; GSPMD propagates shardings from the
parameters, so the same code runs with no mesh, on a mesh, and inside a
``jax.shard_map`` that is manual over the ``worker`` axis only.

References:
  Vaswani et al., Attention Is All You Need, 2017.
  Radford et al., Language Models are Unsupervised Multitask Learners, 2019.
  Su et al., RoFormer: Enhanced Transformer with Rotary Position Embedding,
  2021.
  Zhang and Sennrich, Root Mean Square Layer Normalization, 2019.
"""

import dataclasses
import math
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from loc_opt.models import core

FSDP, TENSOR = core.FSDP, core.TENSOR
_init = nnx.initializers


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Sizes and dtypes of a :class:`Transformer`.

  Attributes:
    vocab_size: number of token ids (256 for bytes).
    d_model: width of the residual stream.
    num_layers: number of Transformer blocks.
    num_heads: attention heads; ``d_model // num_heads`` must be even (RoPE).
    d_ff: hidden width of the MLP.
    max_len: longest sequence ``apply`` accepts.
    dtype: dtype of activations and matmuls (``'float32'``, ``'bfloat16'``
      or a ``jnp`` dtype). Softmax, norms' statistics and logits are float32.
    param_dtype: dtype in which parameters are stored.
  """

  vocab_size: int = 256
  d_model: int = 128
  num_layers: int = 2
  num_heads: int = 4
  d_ff: int = 512
  max_len: int = 256
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    core.check_positive(
        self,
        ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'd_ff', 'max_len'),
    )
    if self.d_model % self.num_heads:
      raise ValueError(
          f'model.d_model ({self.d_model}) must be divisible by '
          f'model.num_heads ({self.num_heads})'
      )
    if (self.d_model // self.num_heads) % 2:
      raise ValueError(
          f'model.d_model // model.num_heads ({self.d_model} // '
          f'{self.num_heads}) must be even for rotary position embeddings'
      )
    for field in ('dtype', 'param_dtype'):
      dtype = core.as_dtype(getattr(self, field), f'model.{field}')
      object.__setattr__(self, field, dtype)

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


def _linear(
    config: TransformerConfig,
    in_features: int,
    out_features: int,
    sharding: tuple[str | None, ...],
    init: jax.nn.initializers.Initializer,
    rngs: nnx.Rngs,
) -> nnx.Linear:
  return nnx.Linear(
      in_features,
      out_features,
      use_bias=False,
      dtype=config.dtype,
      param_dtype=config.param_dtype,
      kernel_init=nnx.with_partitioning(init, sharding),
      rngs=rngs,
  )


def _rms_norm(config: TransformerConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
  return nnx.RMSNorm(
      config.d_model,
      epsilon=1e-6,
      dtype=config.dtype,
      param_dtype=config.param_dtype,
      scale_init=nnx.with_partitioning(_init.ones_init(), (None,)),
      rngs=rngs,
  )


def rope_tables(
    length: int, head_dim: int, base: float = 10_000.0
) -> tuple[jax.Array, jax.Array]:
  """Sines and cosines ``[length, head_dim // 2]`` (float32) for RoPE."""
  inv_freq = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  return jnp.sin(angles), jnp.cos(angles)


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
  """Rotates ``x`` ``[B, T, H, Dh]`` by position (half-split convention)."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  sin, cos = sin[:, None, :], cos[:, None, :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class Attention(nnx.Module):
  """Causal multi-head self-attention with rotary position embeddings."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.num_heads = config.num_heads
    self.head_dim = config.head_dim
    d, fan_in = config.d_model, _init.lecun_normal()
    # Residual projections are scaled down by 1/sqrt(2 L) (GPT-2).
    residual = _init.variance_scaling(
        1.0 / (2 * config.num_layers), 'fan_in', 'truncated_normal'
    )
    self.query = _linear(config, d, d, (FSDP, TENSOR), fan_in, rngs)
    self.key = _linear(config, d, d, (FSDP, TENSOR), fan_in, rngs)
    self.value = _linear(config, d, d, (FSDP, TENSOR), fan_in, rngs)
    self.out = _linear(config, d, d, (TENSOR, FSDP), residual, rngs)

  def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array):
    b, t, _ = x.shape
    heads = lambda y: y.reshape(b, t, self.num_heads, self.head_dim)
    q = apply_rope(heads(self.query(x)), sin, cos)
    k = apply_rope(heads(self.key(x)), sin, cos)
    v = heads(self.value(x))
    scores = jnp.einsum(
        'bqhd,bkhd->bhqk', q, k, preferred_element_type=jnp.float32
    ) / math.sqrt(self.head_dim)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    y = jnp.einsum('bhqk,bkhd->bqhd', probs, v)
    return self.out(y.reshape(b, t, self.num_heads * self.head_dim))


class MLP(nnx.Module):
  """``down(gelu(up(x)))`` with the tanh approximation of GELU.

  Not the exact (erf) GELU: in JAX 0.12 ``lax.erf`` fails to trace inside a
  ``jax.shard_map`` that checks varying manual axes ("Primitive polynomial
  requires varying manual axes to match"), and the model must run there.
  """

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    d, f = config.d_model, config.d_ff
    residual = _init.variance_scaling(
        1.0 / (2 * config.num_layers), 'fan_in', 'truncated_normal'
    )
    self.up = _linear(config, d, f, (FSDP, TENSOR), _init.lecun_normal(), rngs)
    self.down = _linear(config, f, d, (TENSOR, FSDP), residual, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.gelu(self.up(x), approximate=True))


class Block(nnx.Module):
  """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.attn_norm = _rms_norm(config, rngs)
    self.attn = Attention(config, rngs=rngs)
    self.mlp_norm = _rms_norm(config, rngs)
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array):
    x = x + self.attn(self.attn_norm(x), sin, cos)
    return x + self.mlp(self.mlp_norm(x))


class Transformer(nnx.Module):
  """Decoder-only Transformer LM: int tokens ``[B, T]`` -> logits ``[B, T, V]``.

  Blocks are attributes ``layer_0 ... layer_{L-1}`` (string keys, so the pure
  parameter dict has only string keys and checkpoints cleanly).

  Flax shards annotated variables eagerly by default, which needs a mesh;
  build the module under ``nnx.use_eager_sharding(False)`` (as
  :func:`build_transformer` does) or under ``jax.set_mesh`` with a mesh that
  has both ``'fsdp'`` and ``'tensor'`` axes.

  Example:
    >>> with nnx.use_eager_sharding(False):
    ...   model = Transformer(TransformerConfig(), rngs=nnx.Rngs(params=0))
    >>> model(jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 256)
  """

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.embed = nnx.Embed(
        config.vocab_size,
        config.d_model,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        embedding_init=nnx.with_partitioning(
            _init.normal(stddev=1.0), (None, FSDP)
        ),
        rngs=rngs,
    )
    for i in range(config.num_layers):
      setattr(self, f'layer_{i}', Block(config, rngs=rngs))
    self.final_norm = _rms_norm(config, rngs)
    # A small head makes the initial prediction nearly uniform (loss about
    # ln(vocab_size)) while keeping logits dependent on the input.
    self.head = _linear(
        config,
        config.d_model,
        config.vocab_size,
        (FSDP, TENSOR),
        _init.normal(stddev=0.02),
        rngs,
    )

  def __call__(self, tokens: jax.Array) -> jax.Array:
    config = self.config
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(
          f'tokens must be integers of shape [batch, length], got '
          f'{tokens.dtype}{list(tokens.shape)}'
      )
    length = tokens.shape[1]
    if length > config.max_len:
      raise ValueError(
          f'sequence length {length} exceeds model.max_len ({config.max_len})'
      )
    sin, cos = rope_tables(length, config.head_dim)
    # The lookup is a one-hot matmul: with a byte vocabulary it costs little,
    # it is deterministic, and GSPMD partitions it over a batch-sharded input
    # without gathering the tokens (a gather-based lookup inside the worker
    # shard_map all-gathers tokens and embeddings across the data axis).
    one_hot = jax.nn.one_hot(tokens, config.vocab_size, dtype=config.dtype)
    x = one_hot @ self.embed.embedding[...].astype(config.dtype)
    for i in range(config.num_layers):
      x = getattr(self, f'layer_{i}')(x, sin, cos)
    return self.head(self.final_norm(x)).astype(jnp.float32)


def build_transformer(config: TransformerConfig) -> core.Model:
  """The functional :class:`~loc_opt.models.core.Model` of a Transformer LM.

  Args:
    config: the sizes and dtypes.

  Returns:
    A ``Model`` whose ``apply(params, tokens)`` maps int tokens ``[B, T]``
    (``T <= max_len``) to float32 logits ``[B, T, vocab_size]``.

  Example:
    >>> model = build_transformer(TransformerConfig(num_layers=1))
    >>> params = model.init(jax.random.key(0))
    >>> model.apply(params, jnp.zeros((2, 8), jnp.int32)).shape
    (2, 8, 256)
  """
  return core.from_nnx(lambda rngs: Transformer(config, rngs=rngs))
