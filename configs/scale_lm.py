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
"""

import ml_collections

from configs import diloco_lm

# size -> (d_model, num_layers, d_ff, num_heads)
SIZES = {
    '100m': (768, 12, 3072, 12),
    '1b': (2048, 16, 8192, 16),
    '8b': (4096, 32, 16384, 32),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The DiLoCo LM config at size ``arg`` (a key of ``SIZES``, default
  ``'1b'``)."""
  size = arg or '1b'
  if size not in SIZES:
    raise ValueError(f'size {size!r} is not one of {sorted(SIZES)}')
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
  return c
