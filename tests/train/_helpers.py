"""Helpers shared by the trainer tests: a tiny config and array leaves."""

import jax
import numpy as np

from configs import diloco_lm


def tiny_config(data_dir, **overrides):
  c = diloco_lm.get_config()
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
  for key, value in overrides.items():
    node = c
    *parents, leaf = key.split('.')
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


def leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]
