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


def test_config_follows_the_paper_s_inner_settings():
  kw = muloco_lm.get_config().optimizer.kwargs
  assert (kw.momentum, kw.nesterov, kw.adamw_b1, kw.adamw_b2) == (
      0.9, False, 0.9, 0.99)
  assert len(kw.ns_coeffs) == 5
  # the one departure measured here (docs/muloco.md): optax's width rule
  assert kw.width_scale == 'max1'


def test_outer_rate_applies_once_on_the_compressed_path():
  # The reference code's compressed path scales its error-feedback
  # accumulator by the outer rate and steps with it again (rate^2 = 0.49
  # for 0.7); ours applies it once, like the uncompressed path: one sync of
  # two workers through the config's codec (8 bits here, so the codec's
  # error is small) moves the anchor by lr x mean(Delta).
  import optax  # pylint: disable=g-import-not-at-top
  import loc_opt  # pylint: disable=g-import-not-at-top
  c = muloco_lm.get_config()
  c.outer.codec_kwargs.bits = 8
  lr = c.outer.learning_rate
  codec = cfg_lib.make_compressor(c)
  tx = loc_opt.diloco(optax.sgd(1.), sync_every=1, outer=optax.sgd(lr),
                      codec=codec)
  rng = np.random.default_rng(0)
  params = {'layer_0': {'mlp': {'up': {'kernel': jax.numpy.asarray(
      rng.standard_normal((2, 16, 64)), jax.numpy.float32)}}}}
  grads = jax.tree.map(lambda x: jax.numpy.asarray(
      rng.standard_normal(x.shape), jax.numpy.float32), params)
  zero = jax.tree.map(jax.numpy.zeros_like, params)

  def sync(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  state = jax.vmap(tx.init)(zero)
  new, _ = jax.vmap(sync, axis_name='worker')(zero, state, grads)
  got = np.asarray(new['layer_0']['mlp']['up']['kernel'][0])
  delta = np.asarray(grads['layer_0']['mlp']['up']['kernel']).mean(0)
  # anchor - lr * mean(anchor - (anchor - g)) = -lr * mean(g)
  np.testing.assert_allclose(got, -lr * delta, atol=0.05 * np.abs(
      delta).max())
  assert np.abs(got + lr * lr * delta).max() > 0.1 * np.abs(delta).max()
