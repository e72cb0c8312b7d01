"""End-to-end tests of the trainer: resume, communication, bad input."""

import copy
import gc
import json
import re

import jax
import numpy as np
import pytest

import loc_opt
from loc_opt import train
from loc_opt.train import checkpoint as ckpt_lib
from loc_opt.train import config as cfg_lib
from loc_opt.train import experiment as exp_lib
from tests.train._helpers import leaves
from tests.train._helpers import tiny_config


def test_interrupted_and_resumed_run_equals_uninterrupted(data_dir, tmp_path):
  config = tiny_config(data_dir)
  full = train.train_and_evaluate(config, tmp_path / 'full')

  config.halt_after_steps = 7  # dies after step 7; last checkpoint at 4
  part = train.train_and_evaluate(config, tmp_path / 'resumed')
  assert part['step'] == 7 and not part['finished']
  config.halt_after_steps = 0
  resumed = train.train_and_evaluate(config, tmp_path / 'resumed')
  assert resumed['finished']

  # The resume replays the same compiled steps: bit for bit.
  for a, b in zip(leaves(full['state']), leaves(resumed['state'])):
    np.testing.assert_array_equal(a, b)
  for key in ('final_eval_loss', 'cross_worker_bytes', 'syncs'):
    assert full[key] == resumed[key], key
  steps = [r['step'] for r in train.read_metrics(tmp_path / 'resumed')]
  assert steps == sorted(set(steps)) and steps[-1] == 12
  # After the final sync the anchors (one all-reduced value, the same
  # operations on every worker) agree bit for bit on every worker and
  # the local parameters, reset through `theta + (phi - theta)`, agree to
  # within one rounding.
  state = full['state']
  for a, x in zip(jax.tree.leaves(state['opt_state'].anchor),
                  jax.tree.leaves(state['params'])):
    for m in range(1, x.shape[0]):
      np.testing.assert_array_equal(np.asarray(a[m]), np.asarray(a[0]))
      np.testing.assert_allclose(np.asarray(x[m]), np.asarray(a[0]),
                                 rtol=2e-7, atol=1e-9)
  summary = json.loads((tmp_path / 'full' / 'summary.json').read_text())
  assert summary['syncs'] == 3
  assert summary['cross_worker_bytes'] == 3 * summary['bytes_per_sync_step']
  assert summary['data_parallel_cross_worker_bytes'] > \
      3 * summary['cross_worker_bytes']
  assert (tmp_path / 'full' / 'tensorboard').is_dir()


def test_identical_initialisation_on_every_worker(data_dir):
  exp = exp_lib.build_experiment(tiny_config(data_dir))
  state = exp.init_state()
  assert state['params']['dense_1']['kernel'].sharding.spec[0] == 'worker'
  for x in jax.tree.leaves(state['params']) + \
      jax.tree.leaves(state['opt_state'].anchor):
    for m in range(1, 4):  # one initialisation, broadcast: exact
      np.testing.assert_array_equal(np.asarray(x[m]), np.asarray(x[0]))


def _copied_state(exp):
  """``(dtype, name)`` of each optimizer-state parameter the compiled inner
  step copies."""
  hlo = exp.programs.steps[exp.plan.inner].as_text()
  entry = hlo[hlo.index('ENTRY'):]
  params = dict(re.findall(r'(%\S+) = \S+ parameter\(\d+\), '
                           r'metadata=\{op_name="(state\[\W*opt_state[^"]*)"',
                           entry))
  return [(dtype, params[arg]) for dtype, arg in
          re.findall(r'= (\w+)\[[^\]]*\]\S* copy\((%\S+)\)', entry)
          if arg in params]


def test_stacked_inner_step_copies_no_optimizer_moment(data_dir):
  """The donated optimizer state is updated in place: with the workers
  stacked (under jax.vmap), the compiled inner step copies none of its
  float leaves (AdamW's moments), which it did while the skip's selects
  were unordered; the integer counters are still copied."""
  exp = exp_lib.build_experiment(tiny_config(
      data_dir, **{'mesh.simulate_workers': True, 'mesh.data': 8,
                   'batch_size': 32, 'data.eval_batch_size': 32}))
  copied = _copied_state(exp)
  assert [n for d, n in copied if d.startswith('s')], copied  # it sees them
  assert [n for d, n in copied if d.startswith('f')] == []


@pytest.mark.parametrize('data,fsdp', [(2, 1), (1, 2)])
def test_inner_step_moves_nothing_across_workers_sync_moves_fp32_delta(
    data_dir, data, fsdp):
  config = tiny_config(data_dir, **{'mesh.data': data, 'mesh.fsdp': fsdp})
  exp = exp_lib.build_experiment(config)
  nbytes, n = exp.programs.bytes_per_step, exp.model.num_params
  assert nbytes[False] == 0
  # Per worker, the sync moves the fp32 pseudo-gradient once: worker_mean
  # spreads it over the worker's devices before the cross-worker mean, so
  # data-parallel replicas do not each send their copy.
  per_worker = nbytes[True] / config.mesh.workers
  expected = 4 * n
  assert expected == loc_opt.outer.pseudo_gradient_bytes(
      jax.eval_shape(exp.model.init, jax.random.key(0)))
  assert abs(per_worker - expected) <= 0.05 * expected, (per_worker, expected)
  dp = exp_lib.data_parallel_bytes_per_step(config)
  # Data parallelism all-reduces the fp32 gradient (a 1/fsdp shard of it per
  # device) on every one of the 8 devices, every step.
  expected = 4 * n * exp.mesh.size / fsdp
  assert abs(dp - expected) <= 0.05 * expected, (dp, expected)


def test_data_parallel_method_runs(data_dir, tmp_path):
  config = tiny_config(data_dir, **{'outer.method': 'data_parallel',
                                    'num_steps': 4})
  summary = train.train_and_evaluate(config, tmp_path)
  assert summary['finished'] and summary['syncs'] == 0
  assert summary['cross_worker_bytes'] == \
      summary['data_parallel_cross_worker_bytes'] > 0
  assert np.isfinite(summary['final_eval_loss'])


@pytest.mark.parametrize('field,value,match', [
    ('outer.sync_every', 0, 'outer.sync_every'),
    ('outer.sync_every', -5, 'outer.sync_every'),
    ('mesh.workers', 3, 'mesh.workers'),
    ('batch_size', 18, 'batch_size'),
    ('batch_size', 20, 'batch_size'),
    ('optimizer.name', 'adamz', 'optimizer.name'),
    ('outer.method', 'fedprox', 'outer.method'),
    ('data.seq_len', 64, 'data.seq_len'),  # > the Transformer's max_len
    ('data.eval_batch_size', 12, 'data.eval_batch_size'),
    ('model.out_dim', 128, 'model.out_dim'),  # the MLP: < 256 bytes
])
def test_bad_config_fields_raise_clear_errors(data_dir, tmp_path, field,
                                             value, match):
  model = 'transformer' if field == 'data.seq_len' else 'mlp'
  config = tiny_config(data_dir, model=model, **{field: value})
  with pytest.raises(ValueError, match=match):
    train.train_and_evaluate(config, tmp_path)
  assert not (tmp_path / 'checkpoints').exists()


def test_missing_dataset_raises_clear_error(tmp_path):
  config = tiny_config(str(tmp_path / 'empty'), **{'data.dataset': 'lm1b'})
  with pytest.raises((ValueError, FileNotFoundError), match='lm1b'):
    train.train_and_evaluate(config, tmp_path / 'wd')


def test_resume_with_other_model_or_corrupt_checkpoint(data_dir, tmp_path):
  config = tiny_config(data_dir, num_steps=4)
  train.train_and_evaluate(config, tmp_path)
  other = tiny_config(data_dir, num_steps=8, **{'model.hidden': 32})
  with pytest.raises(ckpt_lib.CheckpointError, match='model'):
    train.train_and_evaluate(other, tmp_path)
  # Corrupt the saved arrays: a clear error, and nothing is overwritten.
  step_dir = tmp_path / 'checkpoints' / '4'
  for f in (step_dir / 'state').rglob('*'):
    if f.is_file() and f.stat().st_size > 0 and 'ocdbt' not in f.name:
      f.write_bytes(b'garbage')
  with pytest.raises(ckpt_lib.CheckpointError,
                     match='no readable checkpoint.*checkpoints/4 is '
                     'unreadable'):
    train.train_and_evaluate(config, tmp_path)
  assert sorted(p.name for p in (tmp_path / 'checkpoints').iterdir()
                if p.name.isdigit()) == ['4']


def test_resume_config_check_names_leaves_and_refuses_num_steps(data_dir,
                                                               tmp_path):
  config = tiny_config(data_dir, num_steps=8, halt_after_steps=4)
  train.train_and_evaluate(config, tmp_path)
  longer = tiny_config(data_dir, num_steps=12)
  with pytest.raises(ckpt_lib.CheckpointError,
                     match=r'num_steps: 8 -> 12 \(the schedules'):
    train.train_and_evaluate(longer, tmp_path)
  other = tiny_config(data_dir, num_steps=8, **{
      'optimizer.learning_rate': 1e-3, 'model.hidden': 128})
  with pytest.raises(ckpt_lib.CheckpointError) as info:
    train.train_and_evaluate(other, tmp_path)
  message = str(info.value)
  assert 'model.hidden: 64 -> 128' in message
  assert 'optimizer.learning_rate: 0.003 -> 0.001' in message
  assert '{' not in message and 'num_steps' not in message
  assert ckpt_lib.latest_step(tmp_path) == 4
  # run-control fields may change on resume
  same = tiny_config(data_dir, num_steps=8, **{
      'log_every': 1, 'eval_every': 0, 'eval_batches': 2,
      'checkpoint_every': 2, 'keep_checkpoints': 3, 'progress': True,
      'data.data_dir': data_dir + '/', 'init_from.step': 2})
  summary = train.train_and_evaluate(same, tmp_path)
  assert summary['finished'] and summary['step'] == 8
  steps = [r['step'] for r in train.read_metrics(tmp_path)]
  assert steps[-4:] == [5, 6, 7, 8]


def test_resume_ignores_fields_the_method_never_reads(data_dir):
  # A field added to another method's section (or a learner-failure field
  # without a timeline) since a run was saved does not block its resume;
  # the same field in the run's own section does.
  current = tiny_config(data_dir).to_dict()
  saved = copy.deepcopy(current)
  del saved['outer']['desloc']['clip_radius']
  del saved['faults']['failures']
  assert ckpt_lib.resume_diffs(saved, current) == []
  current['outer']['method'] = saved['outer']['method'] = 'desloc'
  assert ckpt_lib.resume_diffs(saved, current) == [
      'outer.desloc.clip_radius: None -> 1.0']
  current['outer']['method'] = saved['outer']['method'] = 'decoupled_diloco'
  assert any(d.startswith('faults.failures')
             for d in ckpt_lib.resume_diffs(saved, current))
  # A field added later whose value reproduces the old behaviour.
  saved['faults']['failures'] = current['faults']['failures']
  del saved['faults']['chaos_chips_per_learner']
  assert ckpt_lib.resume_diffs(saved, current) == []
  current['faults']['chaos_chips_per_learner'] = 2
  assert ckpt_lib.resume_diffs(saved, current) == [
      'faults.chaos_chips_per_learner: None -> 2']
  # Runs saved before mesh.simulate_workers existed had their own devices.
  current['faults']['chaos_chips_per_learner'] = 1
  del saved['mesh']['simulate_workers']
  assert ckpt_lib.resume_diffs(saved, current) == []
  current['mesh']['simulate_workers'] = True
  assert ckpt_lib.resume_diffs(saved, current)[0].startswith(
      'mesh.simulate_workers: None -> True')


def _truncate_arrays(step_dir):
  """Cuts every array data file of a checkpoint in half."""
  files = [f for f in (step_dir / 'state').rglob('*')
           if f.is_file() and f.parent.name == 'd']
  assert files
  for f in files:
    f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])


def test_resume_falls_back_from_a_corrupt_newest_checkpoint(data_dir,
                                                            tmp_path, capfd,
                                                            caplog):
  config = tiny_config(data_dir)
  full = train.train_and_evaluate(config, tmp_path / 'full')
  config.halt_after_steps = 10  # checkpoints at 4 and 8
  train.train_and_evaluate(config, tmp_path / 'run')
  _truncate_arrays(tmp_path / 'run' / 'checkpoints' / '8')
  capfd.readouterr()
  config.halt_after_steps = 0
  resumed = train.train_and_evaluate(config, tmp_path / 'run')
  gc.collect()  # failed Orbax read tasks report when collected
  err = capfd.readouterr().err
  assert not [r for r in caplog.records if r.name == 'asyncio'], \
      caplog.text
  lines = [l for l in err.splitlines() if 'unreadable' in l]
  assert len(lines) == 1, err
  assert lines[0].startswith('checkpoint at step 8 is unreadable (')
  assert 'resuming from step 4' in lines[0]
  assert 'Traceback' not in err and 'Event loop is closed' not in err, err
  assert resumed['finished']
  # The same compiled steps replayed from step 4: bit for bit.
  for a, b in zip(leaves(full['state']), leaves(resumed['state'])):
    np.testing.assert_array_equal(a, b)
  assert (tmp_path / 'run' / 'unreadable_checkpoints' / '8').is_dir()
  assert ckpt_lib.latest_step(tmp_path / 'run') == 12


def test_int8_codec_sync_moves_a_quarter_of_the_fp32_bytes(data_dir):
  config = tiny_config(data_dir, **{'outer.codec': 'int8'})
  exp = exp_lib.build_experiment(config)
  n = exp.model.num_params
  nbytes = exp.programs.bytes_per_step
  assert nbytes[False] == 0
  per_worker = nbytes[True] / config.mesh.workers
  # int8 values + one fp32 scale per 256 values, each leaf padded to whole
  # blocks on each of the worker's 2 devices.
  assert n * (1 + 4 / 256) <= per_worker <= 1.1 * n * (1 + 4 / 256)
  assert per_worker < 0.3 * 4 * n


def test_compressed_data_parallel_sends_the_payload_every_step(data_dir,
                                                               tmp_path):
  config = tiny_config(data_dir, **{
      'outer.method': 'compressed_data_parallel', 'outer.codec': 'int8',
      'outer.error_feedback': 'ef', 'num_steps': 4})
  exp = exp_lib.build_experiment(config)
  assert set(exp.programs.bytes_per_step) == {False}
  per_worker = exp.programs.bytes_per_step[False] / config.mesh.workers
  params = jax.eval_shape(exp.model.init, jax.random.key(0))
  expected = cfg_lib.make_compressor(config).payload_bytes(
      params)
  assert expected <= per_worker <= 1.1 * expected
  summary = train.train_and_evaluate(config, tmp_path)
  assert summary['finished'] and summary['syncs'] == 0
  assert summary['cross_worker_bytes'] == 4 * exp.programs.bytes_per_step[
      False]
  # every worker applied the same mean gradient with the same operations
  # (one program): replicas stay bit-identical
  for x in jax.tree.leaves(summary['state']['params']):
    for m in range(1, config.mesh.workers):
      np.testing.assert_array_equal(np.asarray(x[m]), np.asarray(x[0]))
  assert np.isfinite(summary['final_eval_loss'])


@pytest.mark.parametrize('field,value,match', [
    ('outer.codec', 'int3', 'outer.codec'),
    ('outer.error_feedback', 'ef3', 'outer.error_feedback'),
    ('outer.codec_kwargs', {'bits': 3}, 'outer.codec_kwargs'),
    ('outer.compress_min_size', -1, 'outer.compress_min_size'),
])
def test_bad_compression_fields_raise_clear_errors(data_dir, tmp_path, field,
                                                  value, match):
  config = tiny_config(data_dir, **{field: value})
  with pytest.raises(ValueError, match=match):
    train.train_and_evaluate(config, tmp_path)
  assert not (tmp_path / 'checkpoints').exists()
