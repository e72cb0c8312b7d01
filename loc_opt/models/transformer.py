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

Every parameter and the activations at block boundaries are annotated with
*logical* axis names (``loc_opt.models.sharding``), which the config's
``axis_rules`` map to the within-worker mesh axes. With the default rules the
parameters are FSDP-sharded over ``'fsdp'`` and Megatron-sharded over
``'tensor'`` (the first matmul of a pair is split over its output, the second
over its input):

====================  ==================  ==================  ================
parameter             shape               logical axes        default sharding
====================  ==================  ==================  ================
embed/embedding       [vocab, d_model]    (vocab, embed)      (tensor, fsdp)
attn/{query,key,      [d_model, d_model]  (embed, heads)      (fsdp, tensor)
value}/kernel
attn/out/kernel       [d_model, d_model]  (heads, embed)      (tensor, fsdp)
mlp/up/kernel         [d_model, d_ff]     (embed, mlp)        (fsdp, tensor)
mlp/down/kernel       [d_ff, d_model]     (mlp, embed)        (tensor, fsdp)
*_norm/scale          [d_model]           (None,)             replicated
head/kernel           [d_model, vocab]    (embed, vocab)      (fsdp, tensor)
====================  ==================  ==================  ================

Activations are constrained (``jax.lax.with_sharding_constraint``) at block
boundaries: the residual stream ``(batch, length, embed)`` is split over the
batch axes (``data``, ``fsdp``; ``worker`` too under plain ``jit``) and
whole in ``d_model``; the attention heads and the MLP hidden units over
``tensor``; the logits over ``tensor`` in the vocabulary, which the
vocabulary-parallel loss (``loc_opt.models.core.cross_entropy``) reads
without a gather. The token embedding is a one-hot matmul, so a vocabulary
split over ``tensor`` partitions as a matmul (partial sums all-reduced over
``tensor``, Megatron's vocabulary-parallel embedding) instead of a gather,
which XLA's SPMD partitioner (jaxlib 0.12) cannot split. Without a mesh in
context (one device, ``jax.vmap`` runners) the constraints are no-ops, so
the same code runs everywhere; inside a ``jax.shard_map`` manual over
``worker`` they use the remaining axes.

References:
  Vaswani et al., Attention Is All You Need, 2017.
  Radford et al., Language Models are Unsupervised Multitask Learners, 2019.
  Su et al., RoFormer: Enhanced Transformer with Rotary Position Embedding,
  2021.
  Zhang and Sennrich, Root Mean Square Layer Normalization, 2019.
  Shoeybi et al., Megatron-LM: Training Multi-Billion Parameter Language
  Models Using Model Parallelism, 2019.
"""

import dataclasses
from typing import Any

from flax import nnx
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from loc_opt.models import core
from loc_opt.models import fused_backward as _fused
from loc_opt.models import moe as _moe
from loc_opt.models import projections as _projections
from loc_opt.models import sharding
from loc_opt.models import weight_grad as _weight_grad
# The attention's functions, importable from here as before.
from loc_opt.models.attention import ATTENTION
from loc_opt.models.attention import apply_rope
from loc_opt.models.attention import attend
from loc_opt.models.attention import query_blocks
from loc_opt.models.attention import resolve_causal_blocks
from loc_opt.models.attention import rope_attention
from loc_opt.models.attention import rope_tables

_init = nnx.initializers
# Rematerialization of a block in the backward pass: what it keeps.
REMAT = {
    'none': None,  # no jax.checkpoint: keep every activation
    'full': jax.checkpoint_policies.nothing_saveable,  # keep the inputs only
    'dots': jax.checkpoint_policies.checkpoint_dots,  # keep matmul outputs
    'dots_no_batch':  # keep weight matmul outputs, recompute attention
        jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    # 'full', but keep each block's attention output, which a tensor-split
    # mesh all-reduces: the recompute then moves no activation all-reduce.
    'full_tp': jax.checkpoint_policies.save_only_these_names(
        'attention_output'),
}


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
    param_dtype: dtype in which parameters are stored. Mixed precision, the
      usual setting at scale, is ``dtype='bfloat16'`` with
      ``param_dtype='float32'``: matmuls take bfloat16 operands and
      accumulate in float32 (attention scores, softmax, norms' statistics
      and the loss are float32), while parameters, gradients and optimizer
      state stay float32.
    attention: ``'einsum'`` (default; the explicit formula with float32
      scores, its forward bit-identical to earlier releases; under
      ``weight_grad='narrow'``, the CPU default, its float32 gradients come
      from the narrow-transpose VJP of :func:`attend`, equal to JAX's rule
      to float32 rounding), or through
      ``jax.nn.dot_product_attention`` with ``implementation`` ``None``
      (``'auto'``: JAX picks, e.g. cuDNN's fused kernel on GPU where it
      applies), ``'xla'`` or ``'cudnn'`` (GPU only). Numerically equal up to
      rounding.
    axis_rules: logical axis name -> mesh axes (a mapping or pairs; ``None``
      for :data:`loc_opt.models.sharding.DEFAULT_RULES`), for parameters and
      activations alike.
    scan_layers: ``False`` (default): blocks are parameters ``layer_0 ...
      layer_{L-1}`` applied by an unrolled loop. ``True``: one ``layers``
      subtree whose leaves stack the blocks on a leading axis (logical axis
      ``'layers'``), applied by ``jax.lax.scan``, so compile time does not
      grow with depth. Initial values are those of the unrolled model
      (``layers[i] == layer_i``). Streaming DiLoCo's fragments need the
      unstacked layout (they split the parameters by block leaf).
    remat: what a block keeps for the backward pass (:data:`REMAT`):
      ``'none'``, ``'full'`` (recompute the block from its input),
      ``'dots'`` or ``'dots_no_batch'`` (``jax.checkpoint_policies``), or
      ``'full_tp'``: ``'full'`` but keeping each block's attention output
      (one residual-stream activation per block), so that on a mesh with
      ``tensor`` the recompute repeats no all-reduce of the activations.
    weight_grad: how the gradients that contract over the tokens are
      computed (``loc_opt.models.weight_grad``): those of the dense layers'
      and the embedding's weights, and with ``attention='einsum'`` and
      float32 operands those of the attention's keys and values.
      ``'xla'``: JAX's transpose rules. ``'narrow'``: custom VJPs that
      transpose the narrow operand and keep every matmul row-major (the
      same products; the dense gradients bit-identical to JAX's rule on
      XLA:CPU, the attention's equal to float32 rounding; about 1.5x the
      training throughput of the reference LM on XLA:CPU). ``'auto'``
      (default): ``'narrow'`` on CPU, ``'xla'`` elsewhere.
    backward: the backward rules of the elementwise layers
      (``loc_opt.models.fused_backward``): ``'fused'``: RMSNorm and GELU
      save only their inputs and compute their gradients in one pass, and
      with ``weight_grad`` narrow the rotary embedding is differentiated
      inside the attention's custom VJP (:func:`rope_attention`); float32
      only; the forwards are the same operations, the gradients equal to
      JAX's rules to float32 rounding. ``'xla'``: JAX's rules. ``'auto'``
      (default): ``'fused'`` on CPU, ``'xla'`` elsewhere.
    causal_blocks: query blocks of the causal attention where
      :func:`rope_attention` computes it (``weight_grad`` narrow and
      ``backward`` fused, float32): block ``i`` scores only the keys up to
      its last query, so the blocks of scores above the diagonal are not
      computed (a quarter of the scores for 2). 1 computes all ``T x T``;
      a count that does not divide ``T`` falls back to 1. The outputs and
      gradients equal the full formula's to float32 rounding. ``'auto'``
      (default): 2 in a CPU process on one core, else 1
      (:func:`loc_opt.models.attention.resolve_causal_blocks`); a count may
      come as a string (``--config.model.causal_blocks=2``).
    moe: the Mixture-of-Experts settings (``model.moe``, a mapping of the
      fields of :class:`loc_opt.models.moe.MoeConfig`, or None): with
      ``num_experts > 0`` every block's MLP is a :class:`~loc_opt.models.
      moe.MoeMLP` (experts of width ``d_ff``, sharded over the logical axis
      ``'expert'``), and the model's ``apply_aux`` gives the auxiliary
      loss and the routing statistics.
  """

  vocab_size: int = 256
  d_model: int = 128
  num_layers: int = 2
  num_heads: int = 4
  d_ff: int = 512
  max_len: int = 256
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  attention: str = 'einsum'
  axis_rules: Any = None
  scan_layers: bool = False
  remat: str = 'none'
  weight_grad: str = 'auto'
  backward: str = 'auto'
  causal_blocks: Any = 'auto'
  moe: Any = None

  def __post_init__(self):
    object.__setattr__(self, 'moe', _moe.as_moe_config(self.moe))
    core.check_positive(
        self,
        ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'd_ff', 'max_len'),
    )
    if isinstance(self.causal_blocks, str) and self.causal_blocks != 'auto':
      # A config file's 'auto' field takes a count as a string.
      if not self.causal_blocks.isdigit():
        raise ValueError("model.causal_blocks must be 'auto' or a positive "
                         f'int, got {self.causal_blocks!r}')
      object.__setattr__(self, 'causal_blocks', int(self.causal_blocks))
    if self.causal_blocks != 'auto':
      core.check_positive(self, ('causal_blocks',))
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
    if self.remat not in REMAT:
      raise ValueError(f'model.remat must be one of {sorted(REMAT)}, got '
                       f'{self.remat!r}')
    if type(self.scan_layers) is not bool:
      raise ValueError(f'model.scan_layers must be a bool, got '
                       f'{self.scan_layers!r}')
    _weight_grad.check(self.weight_grad)
    _fused.check(self.backward)
    if self.attention not in ATTENTION:
      raise ValueError(f'model.attention must be one of {sorted(ATTENTION)}, '
                       f'got {self.attention!r}')
    try:
      rules = sharding.normalize_rules(self.axis_rules)
    except ValueError as e:
      raise ValueError(f'model.axis_rules: {e}') from e
    object.__setattr__(self, 'axis_rules', rules)

  def constrain(self, x: jax.Array, *logical: str | None) -> jax.Array:
    """Constrains activation ``x`` to the logical axes (see ``sharding``)."""
    return sharding.constrain(x, logical, self.axis_rules)

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  def fused(self) -> bool:
    """Whether the float32 fused backward rules apply (``backward``
    resolves to ``'fused'``, float32 activations and parameters)."""
    return (_fused.resolve(self.backward) == 'fused'
            and self.dtype == jnp.float32 and self.param_dtype == jnp.float32)


def _linear(
    config: TransformerConfig,
    in_features: int,
    out_features: int,
    logical: tuple[str | None, ...],
    init: jax.nn.initializers.Initializer,
    rngs: nnx.Rngs,
) -> nnx.Linear:
  return nnx.Linear(
      in_features,
      out_features,
      use_bias=False,
      dot_general=_weight_grad.for_config(config.weight_grad),
      dtype=config.dtype,
      param_dtype=config.param_dtype,
      kernel_init=nnx.with_partitioning(init, logical),
      rngs=rngs,
  )


def _norm(config: TransformerConfig, layer: nnx.RMSNorm, x: jax.Array
          ) -> jax.Array:
  """``layer(x)``, through ``fused_backward.rms_norm`` (the same forward,
  a one-pass backward) when ``config.fused()``."""
  with jax.named_scope('rms_norm'):
    if config.fused():
      return _fused.rms_norm(x, layer.scale[...], layer.epsilon)
    return layer(x)


def _rms_norm(config: TransformerConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
  return nnx.RMSNorm(
      config.d_model,
      epsilon=1e-6,
      dtype=config.dtype,
      param_dtype=config.param_dtype,
      scale_init=nnx.with_partitioning(_init.ones_init(), (None,)),
      rngs=rngs,
  )


class Attention(nnx.Module):
  """Causal multi-head self-attention with rotary position embeddings."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    d, fan_in = config.d_model, _init.lecun_normal()
    # Residual projections are scaled down by 1/sqrt(2 L) (GPT-2).
    residual = _init.variance_scaling(
        1.0 / (2 * config.num_layers), 'fan_in', 'truncated_normal'
    )
    into_heads = ('embed', 'heads')
    self.query = _linear(config, d, d, into_heads, fan_in, rngs)
    self.key = _linear(config, d, d, into_heads, fan_in, rngs)
    self.value = _linear(config, d, d, into_heads, fan_in, rngs)
    self.out = _linear(config, d, d, ('heads', 'embed'), residual, rngs)

  def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array):
    config = self.config
    b, t, _ = x.shape

    def heads(y):
      y = y.reshape(b, t, config.num_heads, config.head_dim)
      return config.constrain(y, 'batch', 'length', 'heads', 'kv')

    projections = (self.query, self.key, self.value)
    if sharding.is_split('heads', config.num_heads, config.axis_rules):
      q, k, v = map(heads, _projections.one_product(config, x,
                                                    projections))
    else:
      q, k, v = (heads(f(x)) for f in projections)
    weight_grad = _weight_grad.resolve(config.weight_grad)
    with jax.named_scope('attention_core'):
      if (config.attention == 'einsum' and weight_grad == 'narrow'
          and config.fused()):
        y = rope_attention(q, k, v, sin, cos,
                           resolve_causal_blocks(config.causal_blocks))
      else:
        y = attend(apply_rope(q, sin, cos), apply_rope(k, sin, cos), v,
                   config.attention, weight_grad)
    y = _projections.dense(config, self.out,
                           heads(y).reshape(b, t, config.d_model),
                           ('heads', 'embed'))
    return checkpoint_name(y, 'attention_output')


class MLP(nnx.Module):
  """``down(gelu(up(x)))`` with the tanh approximation of GELU.

  Not the exact (erf) GELU: in JAX 0.12 ``lax.erf`` fails to trace inside a
  ``jax.shard_map`` that checks varying manual axes ("Primitive polynomial
  requires varying manual axes to match"), and the model must run there.
  """

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    d, f = config.d_model, config.d_ff
    residual = _init.variance_scaling(
        1.0 / (2 * config.num_layers), 'fan_in', 'truncated_normal'
    )
    self.up = _linear(config, d, f, ('embed', 'mlp'), _init.lecun_normal(),
                      rngs)
    self.down = _linear(config, f, d, ('mlp', 'embed'), residual, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    up = _projections.dense(self.config, self.up, x, ('embed', 'mlp'))
    hidden = self.config.constrain(up, 'batch', 'length', 'mlp')
    with jax.named_scope('gelu'):
      if self.config.fused():
        hidden = _fused.gelu_tanh(hidden)
      else:
        hidden = jax.nn.gelu(hidden, approximate=True)
    return _projections.dense(self.config, self.down, hidden,
                              ('mlp', 'embed'))


class Block(nnx.Module):
  """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

  Input and output are the residual stream, constrained to
  ``('batch', 'length', 'embed')``.
  """

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.attn_norm = _rms_norm(config, rngs)
    self.attn = Attention(config, rngs=rngs)
    self.mlp_norm = _rms_norm(config, rngs)
    if config.moe.enabled:  # returns (y, routing statistics)
      shared = MLP(config, rngs=rngs) if config.moe.shared_expert else None
      self.mlp = _moe.MoeMLP(config, rngs=rngs, shared=shared)
    else:
      self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array):
    """The block's output; with MoE, ``(output, routing statistics)``."""
    residual = lambda y: self.config.constrain(y, 'batch', 'length', 'embed')
    norm = lambda layer, x: _norm(self.config, layer, x)
    x = residual(x + self.attn(norm(self.attn_norm, x), sin, cos))
    if not self.config.moe.enabled:
      return residual(x + self.mlp(norm(self.mlp_norm, x)))
    y, stats = self.mlp(norm(self.mlp_norm, x))
    return residual(x + y), stats


def _stack(blocks: list[Block]) -> Block:
  """One block whose parameters stack those of ``blocks`` on axis 0."""
  graphdef, *states = (nnx.split(b)[1] if i else nnx.split(b)
                       for i, b in enumerate(blocks))
  graphdef, first = graphdef
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), first, *states)
  return nnx.merge(graphdef, stacked)


def _with_stats(out) -> tuple[jax.Array, dict[str, jax.Array]]:
  """A block's output as ``(x, stats)`` (no statistics: dense)."""
  return out if isinstance(out, tuple) else (out, {})


def _call_block(block: Block, x, sin, cos, remat: str
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """``block(x, sin, cos)`` as ``(x, stats)``, rematerialized per
  ``remat``."""
  if remat == 'none':
    return _with_stats(block(x, sin, cos))
  graphdef, state = nnx.split(block)
  run = lambda state, x: _with_stats(nnx.merge(graphdef, state)(x, sin, cos))
  return jax.checkpoint(run, policy=REMAT[remat])(state, x)


def _scan_blocks(layers: Block, x, sin, cos, remat: str
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Applies the stacked blocks in order with ``jax.lax.scan``; the
  statistics come stacked over the blocks."""
  graphdef, state = nnx.split(layers)

  def body(x, layer_state):
    run = lambda state, x: _with_stats(nnx.merge(graphdef, state)(x, sin,
                                                                  cos))
    if remat != 'none':
      run = jax.checkpoint(run, policy=REMAT[remat])
    return run(layer_state, x)

  return jax.lax.scan(body, x, state)


class Transformer(nnx.Module):
  """Decoder-only Transformer LM: int tokens ``[B, T]`` -> logits ``[B, T, V]``.

  Blocks are attributes ``layer_0 ... layer_{L-1}`` (string keys, so the pure
  parameter dict has only string keys and checkpoints cleanly), or with
  ``scan_layers`` one stacked ``layers`` block scanned over.

  Parameters are annotated with logical axis names; build the module under
  ``nnx.use_eager_sharding(False)`` (as :func:`build_transformer` does), which
  records them as metadata without placing anything.

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
            _init.normal(stddev=1.0), ('vocab', 'embed')
        ),
        rngs=rngs,
    )
    blocks = [Block(config, rngs=rngs) for _ in range(config.num_layers)]
    if config.scan_layers:
      self.layers = _stack(blocks)
    else:
      for i, block in enumerate(blocks):
        setattr(self, f'layer_{i}', block)
    self.final_norm = _rms_norm(config, rngs)
    # A small head makes the initial prediction nearly uniform (loss about
    # ln(vocab_size)) while keeping logits dependent on the input.
    self.head = _linear(
        config,
        config.d_model,
        config.vocab_size,
        ('embed', 'vocab'),
        _init.normal(stddev=0.02),
        rngs,
    )

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """The residual stream's input: a one-hot matmul with the table.

    With a byte vocabulary it costs little, it is deterministic, and GSPMD
    partitions it as a matmul: over a batch-sharded input without gathering
    the tokens, and over a vocabulary split across ``tensor`` as partial
    sums (a gather there aborts the SPMD partitioner).
    """
    config = self.config
    one_hot = jax.nn.one_hot(tokens, config.vocab_size, dtype=config.dtype)
    one_hot = config.constrain(one_hot, 'batch', 'length', 'vocab')
    x = _weight_grad.matmul(one_hot,
                            self.embed.embedding[...].astype(config.dtype),
                            config.weight_grad)
    return config.constrain(x, 'batch', 'length', 'embed')

  def __call__(self, tokens: jax.Array) -> jax.Array:
    return self.forward(tokens)[0]

  def forward(self, tokens: jax.Array
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(logits, aux)``: with MoE, ``aux`` holds ``aux_loss`` (summed
    over the blocks) and the routing statistics stacked over the blocks
    (``load`` ``[L, E]``; ``dropped``, ``entropy``, ``balance_loss``,
    ``z_loss`` ``[L]``); dense: ``{}``."""
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
    # Constants of the compiled program, not computed in it: XLA fuses
    # sin and cos into each of their consumers, evaluating them once per
    # element of q and k there (2% of the 853k LM's step on XLA:CPU).
    with jax.ensure_compile_time_eval():
      sin, cos = rope_tables(length, config.head_dim)
    with jax.named_scope('embed'):
      x = self.embed_tokens(tokens)
    if config.scan_layers:
      x, stats = _scan_blocks(self.layers, x, sin, cos, config.remat)
    else:
      per_block = []
      for i in range(config.num_layers):
        x, block_stats = _call_block(getattr(self, f'layer_{i}'), x, sin,
                                     cos, config.remat)
        per_block.append(block_stats)
      stats = jax.tree.map(lambda *xs: jnp.stack(xs), *per_block)
    x = _norm(config, self.final_norm, x)
    with jax.named_scope('head'):
      logits = self.head(x).astype(jnp.float32)
    aux = {}
    if stats:
      aux = dict(stats, aux_loss=jnp.sum(stats['aux_loss']))
    return config.constrain(logits, 'batch', 'length', 'vocab'), aux


def build_transformer(config: TransformerConfig) -> core.Model:
  """The functional :class:`~loc_opt.models.core.Model` of a Transformer LM.

  Args:
    config: the sizes and dtypes.

  Returns:
    A ``Model`` whose ``apply(params, tokens)`` maps int tokens ``[B, T]``
    (``T <= max_len``) to float32 logits ``[B, T, vocab_size]``, and whose
    ``specs`` are the parameters' logical axes mapped to mesh axes by
    ``config.axis_rules``.

  Example:
    >>> model = build_transformer(TransformerConfig(num_layers=1))
    >>> params = model.init(jax.random.key(0))
    >>> model.apply(params, jnp.zeros((2, 8), jnp.int32)).shape
    (2, 8, 256)
  """
  model = core.from_nnx(lambda rngs: Transformer(config, rngs=rngs),
                       aux_method='forward' if config.moe.enabled else None)
  specs = dict(model.specs)
  if config.scan_layers:  # the stacking axis leads every block leaf
    specs['layers'] = jax.tree.map(lambda s: jax.P('layers', *s),
                                   specs['layers'],
                                   is_leaf=lambda x: isinstance(x, jax.P))
  specs = sharding.logical_to_mesh_specs(specs, config.axis_rules)
  return model._replace(specs=specs)
