"""Larger reference LMs for compile-only scale checks (and pods).

``configs/diloco_lm.py`` with a model size picked by the config argument,
bfloat16 activations over float32 parameters, 8 virtual CPU devices as 2
workers x 4 fsdp by default. Sizes (parameters with the byte vocabulary):

=====  =======  ======  ====  =====  =======  ============  ============
size   d_model  layers  d_ff  heads  seq_len  global batch  parameters
=====  =======  ======  ====  =====  =======  ============  ============
100m   768      12      3072  12     1024     16            85.3M
1b     2048     16      8192  16     1024     16            806M
8b     4096     32      16384 32     1024     16            6.44B
=====  =======  ======  ====  =====  =======  ============  ============

Launch (compile only; see experiments/scale_check.py):
  python -m experiments.scale_check --config=configs/scale_lm.py:1b \\
    --config.mesh.fsdp=2 --config.mesh.tensor=2

``SIZE,accelerator`` (e.g. ``configs/scale_lm.py:8b,accelerator``) is the
recommended starting point for a GPU or TPU run of that size
(:data:`ACCELERATOR`): scanned blocks, remat by size, attention through
``jax.nn.dot_product_attention`` (XLA or cuDNN picks the kernel), the
model options whose ``'auto'`` resolves by backend spelled out with their
accelerator values (``docs/sharding.md``, "Accelerator defaults"), and a
mesh of 2 workers x 8 devices (16 chips: one 8-chip host per worker, FSDP
inside it for ~1B and ~8B, data parallelism for ~100M). These are starting
points from the compile-only checks on CPU (the scale_sync table of
docs/sharding.md: the ~8B sync step needs about 51 GiB per device at
fsdp 4, less at fsdp 8); no GPU or TPU run has measured them.
"""

import ml_collections

from configs import diloco_lm

# size -> (d_model, num_layers, d_ff, num_heads)
SIZES = {
    '100m': (768, 12, 3072, 12),
    '1b': (2048, 16, 8192, 16),
    '8b': (4096, 32, 16384, 32),
}


# The accelerator starting point per size (``SIZE,accelerator``): config
# overrides on top of the size's config. remat 'full' keeps one block's
# activations at a time (the ~1B inner step's temporary memory 4.8x lower
# than unscanned without remat on CPU, docs/sharding.md); at ~100M 'dots'
# keeps the matmul outputs and recomputes the rest. On a mesh with tensor >
# 1 use 'full_tp': it keeps each block's attention output too, so the
# recompute repeats no all-reduce (docs/sharding.md, the fsdp x tensor mesh).
_ACCELERATOR_COMMON = {
    'model.scan_layers': True,  # Compile time flat in depth.
    'model.attention': 'auto',  # jax.nn.dot_product_attention, kernel by XLA.
    'model.backward': 'xla',  # 'auto' off CPU: JAX's own backward rules.
    'model.weight_grad': 'xla',  # 'auto' off CPU: JAX's rules.
    # (model.causal_blocks stays 'auto': one query block off CPU.)
    'mesh.workers': 2,  # DiLoCo workers (e.g. one 8-chip host each).
}
ACCELERATOR = {
    '100m': {**_ACCELERATOR_COMMON, 'model.remat': 'dots',
             'mesh.data': 8, 'mesh.fsdp': 1, 'batch_size': 256},
    '1b': {**_ACCELERATOR_COMMON, 'model.remat': 'full',
           'mesh.data': 1, 'mesh.fsdp': 8, 'batch_size': 256},
    '8b': {**_ACCELERATOR_COMMON, 'model.remat': 'full',
           'mesh.data': 1, 'mesh.fsdp': 8, 'batch_size': 256},
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The DiLoCo LM config at size ``arg`` (a key of ``SIZES``, default
  ``'1b'``); ``'SIZE,accelerator'`` adds :data:`ACCELERATOR`'s starting
  point for a GPU or TPU run."""
  size, _, variant = (arg or '1b').partition(',')
  if size not in SIZES:
    raise ValueError(f'size {size!r} is not one of {sorted(SIZES)}')
  if variant not in ('', 'accelerator'):
    raise ValueError(f"configs/scale_lm.py takes SIZE or 'SIZE,accelerator', "
                     f'got variant {variant!r} in {arg!r}')
  c = diloco_lm.get_config()
  d_model, layers, d_ff, heads = SIZES[size]
  c.model.d_model = d_model  # Residual width.
  c.model.num_layers = layers  # Transformer blocks.
  c.model.d_ff = d_ff  # MLP hidden width.
  c.model.num_heads = heads  # Attention heads (head_dim 128 or 64).
  c.model.max_len = 1024  # Longest sequence.
  c.model.dtype = 'bfloat16'  # Activations; parameters stay float32.
  c.data.seq_len = 1024  # Tokens per training sequence.
  c.batch_size = 16  # Global sequences per step.
  c.mesh.workers, c.mesh.data, c.mesh.fsdp = 2, 1, 4  # 8 devices.
  c.num_steps = 1000  # (Only the plan's phases matter: inner and sync.)
  c.outer.sync_every = 100  # DiLoCo's H.
  if variant:
    from loc_opt.train import config as cfg_lib  # pylint: disable=g-import-not-at-top
    c = cfg_lib.with_overrides(c, ACCELERATOR[size])
  return c
