"""Helpers shared by the trainer tests: a tiny config and array leaves."""

import jax
import numpy as np

from configs import diloco_lm
from loc_opt.train import config as cfg_lib


def tiny_config(data_dir, base=diloco_lm, **overrides):
  """The default config (or the config module ``base``'s) shrunk to a
  1-block LM on short sequences (H = 4); ``overrides`` maps dotted fields to
  values."""
  c = base.get_config()
  c.num_steps = 12
  c.batch_size = 16
  c.data.eval_batch_size = 16
  c.eval_batches = 1
  c.eval_every = 6
  c.log_every = 2
  c.checkpoint_every = 4
  c.progress = False
  c.model.d_model = 32
  c.model.num_heads = 2
  c.model.num_layers = 1
  c.model.d_ff = 64
  c.model.max_len = 32
  c.data.seq_len = 32
  c.data.max_bytes = 300_000
  c.data.data_dir = data_dir
  c.outer.sync_every = 4
  return cfg_lib.with_overrides(c, overrides)


def leaves(tree):
  """The leaves of ``tree`` as NumPy arrays."""
  return [np.asarray(x) for x in jax.tree.leaves(tree)]
