"""Within-worker sharding of the trainer's programs: the collectives of an
inner step, read from the compiled HLO, against ideal FSDP and Megatron."""

import jax
import numpy as np
import pytest

from configs import diloco_lm
from loc_opt import models
from loc_opt import parallel
from loc_opt import train
from loc_opt.train import experiment
from tests.train import _helpers

ideal = parallel.ideal
D_MODEL, LAYERS, SEQ, ROWS = 256, 2, 128, 16


def _config(fsdp, tensor):
  c = diloco_lm.get_config()
  c.mesh.workers, c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 1, fsdp, tensor
  c.model.update(d_model=D_MODEL, num_layers=LAYERS, d_ff=4 * D_MODEL,
                 max_len=SEQ)
  c.data.seq_len = SEQ
  c.batch_size, c.num_steps, c.outer.sync_every = ROWS, 100, 10
  return c


def test_config_axis_rules_are_the_library_defaults():
  rules = diloco_lm.get_config().model.axis_rules.to_dict()
  # (ConfigDict sorts its keys; the order of rules does not matter.)
  assert dict(models.sharding.normalize_rules(rules)) == \
      dict(models.sharding.DEFAULT_RULES)


@pytest.mark.parametrize('fsdp, tensor', [(4, 1), (2, 2)])
def test_inner_step_moves_about_ideal_fsdp_and_tensor_bytes(fsdp, tensor):
  """Batch split over fsdp inside a worker, parameters gathered: within 1.2x
  of ideal FSDP (+ Megatron), and no more than ideal."""
  exp = experiment.build_experiment(_config(fsdp, tensor))
  report = parallel.collective_bytes(exp.programs.steps[exp.plan.inner],
                                     exp.mesh)
  assert report.cross_worker_bytes == 0
  layout = ideal.WorkerLayout(
      data=1, fsdp=fsdp, tensor=tensor,
      param_bytes=4 * exp.model.num_params, rows=ROWS // 2, length=SEQ,
      d_model=D_MODEL, num_layers=LAYERS)
  expected = 2 * ideal.inner_step_bytes(layout)  # two workers
  within = ideal.unrolled_bytes(report, cross_worker=False)
  assert within == report.within_worker_bytes  # no loops here
  # Lower bound: at least the parameter all-gather and the gradient
  # reduction (XLA keeps the forward's gathered parameters for the
  # backward pass, so it may move less than the ideal; norm scales are
  # replicated, not gathered).
  assert within >= 0.95 * 2 * (1 + fsdp) * layout.param_bytes
  assert within <= 1.2 * expected, (within / expected, report.summary())
  # Before activations were constrained, every fsdp device computed on the
  # whole worker batch: all-reduces of [rows, length, d_ff] activations.
  # Now no collective carries the worker's whole batch.
  whole_batch = f'[{ROWS // 2},{SEQ},'
  assert not [c.shape for c in report.collectives if whole_batch in c.shape]


def test_streaming_diloco_with_scanned_layers_trains_as_unrolled(
    data_dir, tmp_path):
  """Streaming DiLoCo on a scanned model (fragments split the stacked
  leaves by layer) ends where the unrolled model does, workers=2 x fsdp=4,
  P = 3 (non-block leaves, layer 0, layer 1)."""
  summaries = {}
  for scan in (False, True):
    config = _helpers.tiny_config(data_dir, **{
        'outer.method': 'streaming_diloco', 'outer.sync_every': 6,
        'outer.streaming_diloco.num_fragments': 3,
        'model.num_layers': 2, 'model.scan_layers': scan,
        'mesh.workers': 2, 'mesh.data': 1, 'mesh.fsdp': 4,
        'eval_every': 12, 'checkpoint_every': 0})
    summaries[scan] = train.train_and_evaluate(config, tmp_path / str(scan))
  unrolled, scanned = (summaries[s]['state']['params'] for s in (False,
                                                                True))
  for layer in range(2):
    for want, got in zip(
        jax.tree.leaves(unrolled[f'layer_{layer}']),
        jax.tree.leaves(jax.tree.map(lambda x, i=layer: x[:, i],
                                     scanned['layers']))):
      np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-6)
  for name in ('embed', 'head', 'final_norm'):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4,
                                                         atol=2e-6),
                 scanned[name], unrolled[name])
  assert summaries[True]['syncs'] == summaries[False]['syncs']
  assert summaries[True]['cross_worker_bytes'] == pytest.approx(
      summaries[False]['cross_worker_bytes'], rel=0.02)
  np.testing.assert_allclose(summaries[True]['final_eval_loss'],
                             summaries[False]['final_eval_loss'], rtol=1e-4)


def test_data_parallel_step_applies_the_activation_constraints():
  """Data parallel (no worker axis, plain jit) is traced with the mesh in
  context: its batch is split over workers x fsdp like a DiLoCo worker's,
  so its within-worker bytes are those of FSDP (they were 3x before, when
  every fsdp device computed on its worker's whole batch), and the
  gradients cross workers once (4 bytes x parameters per worker)."""
  config = _config(4, 1)
  config.outer.method = 'data_parallel'
  exp = experiment.build_experiment(config)
  report = parallel.collective_bytes(exp.programs.steps[exp.plan.inner],
                                     exp.mesh)
  layout = ideal.WorkerLayout(
      data=1, fsdp=4, tensor=1, param_bytes=4 * exp.model.num_params,
      rows=ROWS // 2, length=SEQ, d_model=D_MODEL, num_layers=LAYERS)
  within = ideal.unrolled_bytes(report, cross_worker=False)
  assert within <= 1.2 * 2 * ideal.inner_step_bytes(layout), \
      report.summary()
  assert report.cross_worker_bytes / 2 == pytest.approx(layout.param_bytes,
                                                        rel=0.02)
  for rows in (ROWS, ROWS // 2):
    assert not [c.shape for c in report.collectives
                if f'[{rows},{SEQ},' in c.shape]
