"""Tests of the local text TFDS builder (array_record, no TensorFlow)."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds

from loc_opt.data import local_text


def _read_split(builder, split: str) -> dict[str, bytes]:
  source = builder.as_data_source(split)
  out = {}
  for i in range(len(source)):
    example = source[i]
    out[example['path'].decode()] = example['text'].tobytes()
  return out


@pytest.fixture(scope='module')
def built(source_tree, tmp_path_factory):
  root, files = source_tree
  data_dir = tmp_path_factory.mktemp('data')
  config = local_text.local_text_config([root])
  builder = local_text.prepare_local_text(config, data_dir=data_dir)
  return config, builder, data_dir, files


def test_tensorflow_is_not_imported(built):
  del built  # Built and read back above.
  assert 'tensorflow' not in sys.modules


def test_round_trip_bytes_equal_files(built):
  _, builder, _, files = built
  train = _read_split(builder, 'train')
  validation = _read_split(builder, 'validation')
  assert train and validation
  assert not set(train) & set(validation)
  assert train | validation == files
  assert builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD


def test_load_local_text_matches_split_in_path_order(built):
  config, builder, data_dir, _files = built
  docs = local_text.load_local_text(config, split='train', data_dir=data_dir)
  train = _read_split(builder, 'train')
  assert [d.tobytes() for d in docs] == [train[p] for p in sorted(train)]
  assert all(d.dtype == np.uint8 for d in docs)
  capped = local_text.load_local_text(
    config, split='train', data_dir=data_dir, max_bytes=500
  )
  assert 0 < sum(d.size for d in capped) <= 500


def test_public_tfds_data_source_reads_it(built):
  config, _, data_dir, files = built
  source = tfds.data_source(
    f'loc_opt_local_text/{config.name}', split='validation', data_dir=data_dir
  )
  path = source[0]['path'].decode()
  assert source[0]['text'].tobytes() == files[path]


def test_rebuild_reuses_data(built):
  config, builder, data_dir, _ = built
  version_dir = pathlib.Path(builder.data_dir)
  before = {p.name: p.stat().st_mtime_ns for p in version_dir.iterdir()}
  again = local_text.prepare_local_text(config, data_dir=data_dir)
  assert again.data_dir == builder.data_dir
  assert {p.name: p.stat().st_mtime_ns for p in version_dir.iterdir()} == before
  assert not [p for p in version_dir.parent.iterdir() if 'incomplete' in p.name]


def test_validation_is_about_five_percent_and_stable():
  keys = [f'dir{i % 7}/file_{i}.py' for i in range(2000)]
  files = [local_text._SourceFile(k, k, 1, 0) for k in keys]
  splits = local_text._split_files(files, 5.0)
  share = len(splits['validation']) / len(keys)
  assert 0.03 < share < 0.07
  # Adding files never moves an existing file to the other split.
  more = files + [
    local_text._SourceFile(f'n{i}', f'n{i}', 1, 0) for i in range(99)
  ]
  val_before = {f.key for f in splits['validation']}
  val_after = {f.key for f in local_text._split_files(more, 5.0)['validation']}
  assert val_after & set(keys) == val_before


def test_validation_non_empty_for_two_files():
  files = [local_text._SourceFile(k, k, 1, 0) for k in ('a.py', 'b.py')]
  splits = local_text._split_files(files, 5.0)
  assert len(splits['train']) == 1 and len(splits['validation']) == 1


def test_one_file_is_an_error(tmp_path):
  (tmp_path / 'only.py').write_text('x = 1\n')
  config = local_text.local_text_config([tmp_path])
  with pytest.raises(ValueError, match='at least 2 source files'):
    local_text.prepare_local_text(config, data_dir=tmp_path / 'data')


def test_selection_respects_glob_and_exclusions(source_tree):
  root, files = source_tree
  keys = [
    f.key
    for f in local_text._list_files(
      [str(root)], '**/*.py', ('__pycache__', 'tests'), None
    )
  ]
  assert keys == sorted(files)
  everything = local_text._list_files([str(root)], '**/*', (), None)
  assert {'notes.txt', 'pkg0/tests/test_thing.py'} <= {
    f.key for f in everything
  }
  top = local_text._list_files([str(root)], '*.py', (), None)
  assert {f.key for f in top} == {k for k in files if '/' not in k}


def test_glob_regex():
  regex = local_text._glob_regex('**/*.py')
  assert regex.fullmatch('a.py') and regex.fullmatch('x/y/a.py')
  assert not regex.fullmatch('a.pyc') and not regex.fullmatch('a_py')
  assert not local_text._glob_regex('*.py').fullmatch('x/a.py')
  assert local_text._glob_regex('d?/[ab].txt').fullmatch('d1/b.txt')
  assert not local_text._glob_regex('d?/[!ab].txt').fullmatch('d1/b.txt')


def test_max_bytes_takes_a_subset_within_the_cap(source_tree):
  root, files = source_tree
  cap = sum(len(v) for v in files.values()) // 3
  chosen = local_text._list_files(
    [str(root)], '**/*.py', ('tests', '__pycache__'), cap
  )
  assert 0 < sum(f.size for f in chosen) <= cap
  assert {f.key for f in chosen} < set(files)


def test_config_name_tracks_the_sources(source_tree, tree_writer, tmp_path):
  root, _ = source_tree
  name = local_text.local_text_config([root]).name
  assert local_text.local_text_config([root]).name == name
  assert local_text.local_text_config([root], glob='*.py').name != name
  assert local_text.local_text_config([root], max_bytes=10**4).name != name
  copy = tmp_path / 'copy'
  tree_writer(copy)
  first = local_text.local_text_config([copy]).name
  assert first.startswith('copy_')
  (copy / 'top_0.py').write_text('changed and longer\n')
  assert local_text.local_text_config([copy]).name != first


def test_missing_source_dir(tmp_path):
  with pytest.raises(FileNotFoundError, match='source_dirs'):
    local_text.local_text_config([tmp_path / 'nope'])


def _race(monkeypatch, config, data_dir) -> list[object]:
  """Makes another build of ``config`` finish while the first one runs."""
  original = local_text.LocalText._split_generators
  calls = []

  def racing(self, dl_manager):
    calls.append(self)
    if len(calls) == 1:  # The other process, mid-build of the first.
      local_text.prepare_local_text(config, data_dir=data_dir)
    return original(self, dl_manager)

  monkeypatch.setattr(local_text.LocalText, '_split_generators', racing)
  return calls


def test_loser_of_a_build_race_reuses_the_winner(
  source_tree, tmp_path, monkeypatch
):
  root, files = source_tree
  config = local_text.local_text_config([root])
  calls = _race(monkeypatch, config, tmp_path)
  builder = local_text.prepare_local_text(config, data_dir=tmp_path)
  assert len(calls) == 2  # Both built; the first lost the rename.
  assert builder.is_prepared()
  data = _read_split(builder, 'train') | _read_split(builder, 'validation')
  assert data == files
  parent = pathlib.Path(builder.data_dir).parent
  assert [p.name for p in parent.iterdir()] == ['1.0.0']  # No temp dirs.


def test_tfds_alone_fails_the_loser_of_a_build_race(
  source_tree, tmp_path, monkeypatch
):
  root, _ = source_tree
  config = local_text.local_text_config([root])
  calls = _race(monkeypatch, config, tmp_path)
  builder = local_text.LocalText(config=config, data_dir=tmp_path)
  with pytest.raises(OSError, match='already exists'):
    builder.download_and_prepare(file_format='array_record')
  assert len(calls) == 2


def test_concurrent_processes_build_once(source_tree, tmp_path):
  root, files = source_tree
  code = (
    'import sys\n'
    'from loc_opt.data import local_text\n'
    'config = local_text.local_text_config([sys.argv[1]])\n'
    'b = local_text.prepare_local_text(config, data_dir=sys.argv[2])\n'
    'print(len(b.as_data_source("train")))\n'
  )
  repo = pathlib.Path(__file__).resolve().parents[2]
  env = dict(os.environ, PYTHONPATH=str(repo), JAX_PLATFORMS='cpu')
  procs = [
    subprocess.Popen(
      [sys.executable, '-c', code, str(root), str(tmp_path)],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      env=env,
    )
    for _ in range(2)
  ]
  outputs = [p.communicate(timeout=120) for p in procs]
  for p, (out, err) in zip(procs, outputs):
    assert p.returncode == 0, err.decode()[-2000:]
  config = local_text.local_text_config([root])
  builder = local_text.prepare_local_text(config, data_dir=tmp_path)
  sizes = {int(out.decode().split()[-1]) for out, _ in outputs}
  assert sizes == {len(builder.as_data_source('train'))}
  data = _read_split(builder, 'train') | _read_split(builder, 'validation')
  assert data == files


def test_default_stdlib_source_with_a_cap(tmp_path):
  config = local_text.local_text_config(max_bytes=200_000)
  assert config.name.startswith('stdlib_')
  assert config.source_dirs == (local_text.stdlib_dir(),)
  builder = local_text.prepare_local_text(config, data_dir=tmp_path)
  docs = {}
  for split in ('train', 'validation'):
    docs |= _read_split(builder, split)
  assert 0 < sum(len(v) for v in docs.values()) <= 200_000
  stdlib = pathlib.Path(local_text.stdlib_dir())
  for path, data in docs.items():
    parts = pathlib.PurePosixPath(path).parts
    assert not {'site-packages', 'test', 'tests'} & set(parts)
    assert (stdlib / path).read_bytes() == data
