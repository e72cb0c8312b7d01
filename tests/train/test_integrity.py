"""Checkpoint integrity (loc_opt.train.integrity, loc_opt.train.checkpoint):
digests checked on restore, a whole state checked finite before a save,
rotation that keeps the newest verified checkpoint, and unreadable
checkpoints that fall back without crashing."""

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest

from loc_opt import train
from loc_opt.train import checkpoint as ckpt_lib
from loc_opt.train import config as cfg_lib
from loc_opt.train import experiment as exp_lib
from loc_opt.train import faults
from loc_opt.train import integrity
from tests.train._helpers import leaves
from tests.train._helpers import tiny_config


@pytest.fixture(scope='module')
def full_run(data_dir, tmp_path_factory):
  """One finished 12-step run (checkpoints at 8 and 12 kept): its config,
  workdir and summary; tests copy the workdir before changing it."""
  config = tiny_config(data_dir)
  workdir = tmp_path_factory.mktemp('full')
  summary = train.train_and_evaluate(config, workdir)
  assert summary['finished']
  assert ckpt_lib.Checkpointer(workdir, every=0,
                               read_only=True).all_steps() == [8, 12]
  return config, workdir, summary


def _copy(full_run, tmp_path) -> pathlib.Path:
  workdir = tmp_path / 'run'
  shutil.copytree(full_run[1], workdir)
  return workdir


def _largest_array_file(step_dir: pathlib.Path) -> pathlib.Path:
  files = [f for f in (step_dir / 'state').rglob('*')
           if f.is_file() and f.parent.name == 'd']
  return max(files, key=lambda f: f.stat().st_size)


def _checkpointer(workdir, lines, **kwargs):
  config = kwargs.pop('config')
  exp = exp_lib.get_experiment(config)
  return exp, ckpt_lib.Checkpointer(workdir, every=4, layout=exp.layout,
                                    warn=lines.append, **kwargs)


def test_flipped_bytes_are_caught_and_the_run_falls_back(full_run, tmp_path,
                                                         capfd):
  # 64 bytes flipped in the middle of the largest array file of the newest
  # checkpoint, its size unchanged: Orbax reads it without complaint (the
  # values come back finite but wrong); the digest says so, the run resumes
  # from step 8 and ends bit for bit where the uninterrupted run did.
  config, _, full = full_run
  workdir = _copy(full_run, tmp_path)
  target = _largest_array_file(workdir / 'checkpoints' / '12')
  data = bytearray(target.read_bytes())
  size, middle = len(data), len(data) // 2
  for i in range(middle, middle + 64):
    data[i] ^= 0xFF
  target.write_bytes(bytes(data))
  assert target.stat().st_size == size
  capfd.readouterr()
  resumed = train.train_and_evaluate(config, workdir)
  err = capfd.readouterr().err
  lines = [l for l in err.splitlines() if 'unreadable' in l]
  assert len(lines) == 1, err
  assert lines[0].startswith('checkpoint at step 12 is unreadable (checksum '
                             'mismatch in '), lines[0]
  assert 'resuming from step 8' in lines[0]
  assert (workdir / 'unreadable_checkpoints' / '12').is_dir()
  assert resumed['finished'] and resumed['step'] == 12
  for a, b in zip(leaves(full['state']), leaves(resumed['state'])):
    np.testing.assert_array_equal(a, b)


def test_digests_name_the_changed_leaf_whatever_the_sharding():
  mesh = jax.make_mesh((8,), ('x',))
  x = np.arange(64, dtype=np.float32).reshape(8, 8)
  sharded = jax.device_put(x, jax.NamedSharding(mesh, jax.P('x')))
  whole = jax.device_put(x, jax.NamedSharding(mesh, jax.P()))
  d1, f1 = integrity.inspect({'a': sharded, 'b': np.int32(3)})
  d2, _ = integrity.inspect({'a': whole, 'b': np.int32(3)})
  assert d1 == d2 and all(f1.values())
  y = x.copy()
  y[5, 2] = np.nextafter(y[5, 2], np.float32(1e9))  # one bit of one value
  d3, _ = integrity.inspect({'a': y, 'b': np.int32(3)})
  assert integrity.mismatches(d1, d3) == ['a']
  # The same bytes in another place differ too.
  d4, _ = integrity.inspect({'a': x.T.copy(), 'b': np.int32(3)})
  assert integrity.mismatches(d1, d4) == ['a']
  y[0, 0] = np.nan
  _, f5 = integrity.inspect({'a': y, 'b': np.int32(3)})
  assert integrity.first_non_finite(f5) == 'a'


def test_a_non_finite_leaf_anywhere_in_the_state_is_never_saved(
    full_run, tmp_path):
  # The outer optimizer state (not the parameters) goes NaN: the save
  # refuses, naming the leaf, and writes nothing.
  config, _, full = full_run
  exp, ckpt = _checkpointer(tmp_path / 'new', [], config=config)
  state = dict(full['state'])
  opt = state['opt_state']
  outer = jax.tree.map(lambda x: x * np.nan if jax.numpy.issubdtype(
      x.dtype, jax.numpy.floating) else x, opt.outer_state)
  state['opt_state'] = opt._replace(outer_state=outer)
  with pytest.raises(faults.NonFiniteError,
                     match=r'non-finite values in shared\.opt_state\.'
                     r'outer_state\..* at step 16; not saving'):
    ckpt.save(16, state, cfg_lib.config_to_json(config))
  assert ckpt.all_steps() == []
  ckpt.close()


def test_rotation_keeps_the_newest_verified_checkpoint(full_run, tmp_path):
  config, _, _ = full_run
  workdir = _copy(full_run, tmp_path)
  config_json = cfg_lib.config_to_json(config)
  exp, ckpt = _checkpointer(workdir, [], config=config, max_to_keep=2)
  step, state = ckpt.restore(exp.layout, config_json)
  assert step == 12 and ckpt.verified == {12}
  for s in (16, 20, 24):  # never read back: not verified
    ckpt.save(s, state, config_json)
  assert ckpt.all_steps() == [12, 20, 24]
  ckpt.close()
  # A new run verifies 24 when it resumes; its next save lets 12 go.
  exp, ckpt = _checkpointer(workdir, [], config=config, max_to_keep=2)
  assert ckpt.restore(exp.layout, config_json)[0] == 24
  ckpt.save(28, state, config_json)
  assert ckpt.all_steps() == [24, 28]
  ckpt.close()


@pytest.mark.parametrize('damage, reason', [
    ('truncate', 'an array file is shorter than its metadata says ('),
    ('metadata', 'metadata missing ('),
    ('config', "item 'config' missing ("),
    ('directory', 'array data cannot be decoded ('),
])
def test_unreadable_reasons_are_words(full_run, tmp_path, damage, reason):
  config, _, _ = full_run
  workdir = _copy(full_run, tmp_path)
  step_dir = workdir / 'checkpoints' / '12'
  target = _largest_array_file(step_dir)
  if damage == 'truncate':
    target.write_bytes(target.read_bytes()[:target.stat().st_size // 2])
  elif damage == 'metadata':
    (step_dir / 'state' / '_METADATA').unlink()
  elif damage == 'config':
    shutil.rmtree(step_dir / 'config')
  else:  # a file replaced by a directory: reading it fails (even as root)
    target.unlink()
    target.mkdir()
  lines = []
  exp, ckpt = _checkpointer(workdir, lines, config=config)
  assert ckpt.restore(exp.layout, cfg_lib.config_to_json(config))[0] == 8
  ckpt.close()
  assert len(lines) == 1
  assert lines[0].startswith(f'checkpoint at step 12 is unreadable ({reason}'
                             ), lines[0]
  assert 'pybind' not in lines[0] and 'TensorStore(' not in lines[0]


def test_a_checkpoint_that_cannot_be_read_or_moved_is_skipped(
    full_run, tmp_path, capfd):
  # Tests may run as root, where chmod does not stop reads: the newest
  # checkpoint's largest array file is replaced by a directory (reading
  # it fails), and workdir/unreadable_checkpoints is a plain file, so the
  # checkpoint cannot be moved aside either. The run falls back to step 8
  # and finishes; the bad checkpoint stays, named, and nothing crashes.
  config, _, full = full_run
  workdir = _copy(full_run, tmp_path)
  target = _largest_array_file(workdir / 'checkpoints' / '12')
  target.unlink()
  target.mkdir()
  (workdir / 'unreadable_checkpoints').write_text('in the way')
  capfd.readouterr()
  resumed = train.train_and_evaluate(config, workdir)
  err = capfd.readouterr().err
  assert 'Traceback' not in err, err
  lines = [l for l in err.splitlines() if 'checkpoint' in l]
  assert len(lines) == 2, err
  assert lines[0].startswith('checkpoint at step 12 is unreadable (array '
                             'data cannot be decoded (')
  assert 'resuming from step 8 (could not move it aside: ' in lines[0]
  assert f'skipped, it stays at {workdir / "checkpoints" / "12"})' in lines[0]
  assert lines[1].startswith('not saving step 12: the unreadable checkpoint')
  assert resumed['finished'] and resumed['step'] == 12
  for a, b in zip(leaves(full['state']['params']),
                  leaves(resumed['state']['params'])):
    np.testing.assert_array_equal(a, b)
  summary = json.loads((workdir / 'summary.json').read_text())
  assert summary['step'] == 12


def _strict_load(text):
  def refuse(name):
    raise ValueError(f'{name} is not JSON')
  return json.loads(text, parse_constant=refuse)


def test_a_finished_runs_rerun_leaves_its_records_byte_identical(
    full_run, tmp_path):
  # Before: a rerun rewrote summary.json with "final_train_loss": NaN (not
  # JSON) and train_seconds_this_run 0.0.
  config, _, full = full_run
  workdir = _copy(full_run, tmp_path)
  names = ('summary.json', 'metrics.jsonl')
  before = {n: (workdir / n).read_bytes() for n in names}
  summary = _strict_load(before['summary.json'])
  assert np.isfinite(summary['final_train_loss'])
  again = train.train_and_evaluate(config, workdir)
  assert {n: (workdir / n).read_bytes() for n in names} == before
  assert again['final_train_loss'] == full['final_train_loss']
  assert again['finished'] and again['step'] == 12
  assert not list(workdir.glob('*.tmp')) and not list(workdir.glob('.*.tmp'))


def test_records_are_strict_json_with_the_non_finite_named(tmp_path):
  from loc_opt.train import records
  path = tmp_path / 'summary.json'
  records.write_json(path, {'loss': float('nan'), 'ok': 1.5,
                            'curve': [1.0, float('inf')],
                            'nested': {'x': float('-inf')}})
  value = _strict_load(path.read_text())
  assert value == {'loss': None, 'ok': 1.5, 'curve': [1.0, None],
                   'nested': {'x': None},
                   'non_finite': {'loss': 'nan', 'curve.1': 'inf',
                                  'nested.x': '-inf'}}
  assert [p.name for p in tmp_path.iterdir()] == ['summary.json']


@pytest.fixture
def small_disk(tmp_path):
  """A 2.2 MB tmpfs (room for one checkpoint of the tiny run, not two);
  skipped where mounting is not allowed (mount needs root)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  where = tmp_path / 'small'
  where.mkdir()
  mounted = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=2200k',
                            'tmpfs', str(where)], capture_output=True,
                           text=True)
  if mounted.returncode:
    pytest.skip(f'cannot mount a small filesystem: {mounted.stderr.strip()}')
  try:
    yield where
  finally:
    subprocess.run(['umount', str(where)], check=True)


def test_a_full_disk_ends_in_one_error_and_keeps_the_earlier_checkpoint(
    full_run, small_disk, capfd):
  config, _, _ = full_run
  workdir = small_disk / 'run'
  capfd.readouterr()
  with pytest.raises(ckpt_lib.DiskFullError) as info:
    train.train_and_evaluate(config, workdir)
  err = capfd.readouterr().err
  assert 'Traceback' not in err and 'ERROR' not in err, err[-3000:]
  message = str(info.value)
  assert message.startswith(f'no space left on the device of {workdir} '
                            'while saving the checkpoint of step 8: it needs '
                            'about '), message
  assert 'bytes are free; its partial copy was removed' in message
  assert not list((workdir / 'checkpoints').glob('*tmp*'))
  assert not (workdir / 'lock.json').exists()
  exp, ckpt = _checkpointer(workdir, [], config=config)
  assert ckpt.all_steps() == [4]
  assert ckpt.restore(exp.layout, cfg_lib.config_to_json(config))[0] == 4
  ckpt.close()


def test_a_half_written_save_is_never_picked(full_run, tmp_path):
  # What kill -9 during a save leaves: Orbax's temporary directory, here a
  # copy of step 12 renamed to a newer step's temporary name, cut short.
  config, _, _ = full_run
  workdir = _copy(full_run, tmp_path)
  half = workdir / 'checkpoints' / '16.orbax-checkpoint-tmp-1234'
  shutil.copytree(workdir / 'checkpoints' / '12', half)
  (half / 'state' / '_METADATA').unlink()
  lines = []
  exp, ckpt = _checkpointer(workdir, lines, config=config)
  assert ckpt.all_steps() == [8, 12]
  assert ckpt.restore(exp.layout, cfg_lib.config_to_json(config))[0] == 12
  ckpt.close()
  assert not lines


def test_digests_of_another_kind_are_not_checked_nor_count_as_verified(
    full_run, tmp_path):
  config, _, _ = full_run
  workdir = _copy(full_run, tmp_path)
  meta = workdir / 'checkpoints' / '12' / 'digests' / 'metadata'
  value = json.loads(meta.read_text())
  assert value['algorithm'] == integrity.ALGORITHM
  value['algorithm'] = 'some-other-digest-v0'
  meta.write_text(json.dumps(value))
  exp, ckpt = _checkpointer(workdir, [], config=config)
  assert ckpt.restore(exp.layout, cfg_lib.config_to_json(config))[0] == 12
  assert ckpt.verified == set()
  ckpt.close()


def test_a_startup_signal_wrapped_by_the_restore_stops_the_run(
    full_run, tmp_path, monkeypatch):
  # A real SIGTERM to this process lands while Orbax reads a checkpoint;
  # Orbax re-raises what cut it inside its own error (seen in a
  # --local_processes run: "no readable checkpoint ... (interrupted by
  # SIGTERM during startup ...)", then a hang). The run stops on the
  # signal; no checkpoint is called unreadable or moved aside.
  import os  # pylint: disable=g-import-not-at-top
  import signal  # pylint: disable=g-import-not-at-top
  from loc_opt.train import preemption  # pylint: disable=g-import-not-at-top
  config = full_run[0]
  workdir = _copy(full_run, tmp_path)
  lines = []
  exp, ckpt = _checkpointer(workdir, lines, config=config)
  restore = ckpt.manager.restore

  def cut(*args, **kwargs):
    try:
      os.kill(os.getpid(), signal.SIGTERM)
      for _ in range(10_000_000):  # the handler runs between bytecodes
        pass
      return restore(*args, **kwargs)
    except preemption.Interrupted as e:
      raise RuntimeError(f'restore failed: {e}') from None  # context lost

  monkeypatch.setattr(ckpt.manager, 'restore', cut)
  with pytest.raises(preemption.Interrupted, match='SIGTERM'):
    with preemption.startup_signals():
      ckpt.restore(exp.layout, cfg_lib.config_to_json(config))
  assert preemption.startup_interruption() is None  # cleared after
  assert not lines and ckpt.all_steps() == [8, 12]
  assert not (workdir / 'unreadable_checkpoints').exists()
  ckpt.close()
