"""configs/muloco_lm.py: it validates, its inner optimizer splits the
reference LM by parameter path, and it trains the tiny LM for a few steps
with 2-bit statistical pseudo-gradients whose bytes on the wire are the
codec's payload."""

import jax
import numpy as np

from configs import muloco_lm
from loc_opt import models
from loc_opt import train
from loc_opt.inner.muon_adamw import muon_adamw_labels
from loc_opt.train import config as cfg_lib
from tests.train._helpers import tiny_config

WORKERS = 4


def _config(data_dir, **overrides):
  # MuLoCo's skip rules name the Transformer's leaves (embed, head, norms).
  return tiny_config(data_dir, base=muloco_lm, model='transformer', **{
      'num_steps': 8, 'eval_every': 0, 'checkpoint_every': 0,
      **overrides})


def test_config_sets_muloco_s_outer_step_and_codec():
  c = muloco_lm.get_config()
  assert (c.outer.learning_rate, c.outer.momentum, c.outer.sync_every) == (
      0.7, 0.6, 30)
  assert c.outer.nesterov and c.optimizer.name == 'muon_adamw'
  assert c.outer.codec == 'statistical' and c.outer.codec_kwargs.bits == 2
  assert c.outer.error_feedback == 'ef'
  train.validate_config(c, 8)


def test_labels_put_embeddings_head_and_norms_on_adamw(data_dir):
  config = _config(data_dir)
  model = models.build_model(config.model)
  params = jax.eval_shape(model.init, jax.random.key(0))
  paths = tuple(config.optimizer.kwargs.adamw_paths)
  flat = jax.tree_util.tree_flatten_with_path(
      muon_adamw_labels(params, paths))[0]
  labels = {jax.tree_util.keystr(p): v for p, v in flat}
  for path, label in labels.items():
    hidden = ('attn' in path or 'mlp' in path) and 'norm' not in path
    assert label == ('muon' if hidden else 'adamw'), (path, label)
  assert labels["['embed']['embedding']"] == 'adamw'
  assert labels["['head']['kernel']"] == 'adamw'
  assert sum(v == 'muon' for v in labels.values()) == 6  # q k v o up down


def test_trains_a_few_steps_and_sends_the_codec_payload(data_dir, tmp_path):
  config = _config(data_dir)
  summary = train.train_and_evaluate(config, tmp_path / 'run')
  assert summary['finished']
  assert np.isfinite(summary['final_eval_loss'])
  assert summary['syncs'] == 2  # H = 4 over 8 steps
  model = models.build_model(config.model)
  params = jax.eval_shape(model.init, jax.random.key(0))
  payload = cfg_lib.make_compressor(config).payload_bytes(params)
  per_sync = summary['cross_worker_bytes'] / summary['syncs'] / WORKERS
  assert payload <= per_sync <= 1.05 * payload, (per_sync, payload)
  # the tiny LM is mostly embedding and head (fp32): 2/3 of its params
  assert per_sync < 0.8 * 4 * model.num_params
