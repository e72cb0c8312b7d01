"""Tests of corpus files and fingerprints (loc_opt.data.corpus)."""

import io
import json
import tarfile

import pytest

from loc_opt import data as data_lib
from loc_opt.data import corpus
from loc_opt.data import export_corpus
from loc_opt.data import lm_data
from loc_opt.data import local_text


def _config(**fields):
  config = data_lib.get_config()
  config.update(fields)
  return config


def test_corpus_file_reads_back_the_same_splits_and_fingerprint(
    source_tree, tmp_path):
  root, files = source_tree
  cap = sum(map(len, files.values())) // 2
  out = tmp_path / 'c.tar'
  assert export_corpus.main([str(out), f'--source_dir={root}']) == 0
  # A cap applied when reading the whole export selects what it selects
  # from the directory.
  direct = _config(source_dirs=(str(root),), max_bytes=cap)
  via_file = _config(corpus_file=str(out), max_bytes=cap)
  a = local_text.split_documents(lm_data.local_text_config_of(direct))
  b = local_text.split_documents(lm_data.local_text_config_of(via_file))
  assert a == b and 0 < sum(map(len, a['train'])) <= cap
  fa = data_lib.corpus_fingerprint(direct)
  fb = data_lib.corpus_fingerprint(via_file)
  assert fa['sha256'] == fb['sha256']
  assert (fa['source'], fb['source']) == ('source_dirs', 'corpus_file')
  assert fa['documents'] == [len(a['train']), len(a['validation'])]
  manifest = local_text.read_manifest(out)
  assert manifest['files'] == len(files) and manifest['python'] is None
  # Byte for byte the same archive from the same files.
  again = tmp_path / 'again.tar'
  export_corpus.main([str(again), f'--source_dir={root}'])
  assert again.read_bytes() == out.read_bytes()


def test_trainer_data_carries_the_fingerprint_of_its_text(
    source_tree, tmp_path):
  root, _ = source_tree
  config = _config(source_dirs=(str(root),), data_dir=str(tmp_path))
  data = data_lib.make_lm_data(config, num_workers=2, global_batch=4,
                               seq_len=16)
  # What the TFDS build stores hashes as the files read directly.
  assert data.corpus == data_lib.corpus_fingerprint(config)
  assert data.corpus in corpus.loaded()


def test_fingerprint_changes_with_one_byte(tree_writer, tmp_path):
  root = tmp_path / 'src'
  files = tree_writer(root, num_files=6)
  config = _config(source_dirs=(str(root),))
  before = data_lib.corpus_fingerprint(config)
  rel = sorted(files)[0]
  (root / rel).write_bytes(files[rel][:-1] + b'#')
  after = data_lib.corpus_fingerprint(config)
  assert before['sha256'] != after['sha256']
  assert before['bytes'] == after['bytes']


def test_stdlib_fingerprint_names_the_python_version(tmp_path):
  import platform  # pylint: disable=g-import-not-at-top
  config = _config(max_bytes=200_000)
  fp = data_lib.corpus_fingerprint(config)
  assert fp['source'] == 'stdlib'
  assert fp['python'] == platform.python_version()
  assert f'Python {platform.python_version()} standard library' in (
      corpus.describe(fp))
  # Exported, it keeps the version it came from.
  out = tmp_path / 'stdlib.tar'
  export_corpus.export(local_text.local_text_config(max_bytes=200_000),
                       out)
  via_file = data_lib.corpus_fingerprint(
      _config(corpus_file=str(out), max_bytes=200_000))
  assert via_file['sha256'] == fp['sha256']
  assert via_file['python'] == platform.python_version()


def test_bad_corpus_files_raise_clear_errors(source_tree, tmp_path):
  root, _ = source_tree
  with pytest.raises(ValueError, match='not both'):
    local_text.local_text_config((root,), corpus_file=tmp_path / 'c.tar')
  with pytest.raises(FileNotFoundError, match='corpus_file'):
    local_text.local_text_config(corpus_file=tmp_path / 'missing.tar')
  junk = tmp_path / 'junk.tar'
  junk.write_text('not an archive')
  with pytest.raises(ValueError, match='not a corpus file'):
    local_text.local_text_config(corpus_file=junk)
  bare = tmp_path / 'bare.tar'
  with tarfile.open(bare, 'w') as tar:
    info = tarfile.TarInfo('a.py')
    info.size = 2
    tar.addfile(info, io.BytesIO(b'x\n'))
  with pytest.raises(ValueError, match='no .loc_opt_corpus.json'):
    local_text.read_manifest(bare)
  with pytest.raises(SystemExit):  # argparse's error, naming the file
    export_corpus.main([str(tmp_path / 'o.tar'),
                        f'--corpus_file={tmp_path / "missing.tar"}'])


def test_track_refuses_to_resume_on_other_text(tmp_path):
  fp = {'sha256': 'a' * 64, 'source': 'source_dirs', 'python': None,
        'documents': [2, 1], 'bytes': [10, 5],
        'data': {'source_dirs': ['/x']}}
  other = {**fp, 'sha256': 'b' * 64}
  assert corpus.track(tmp_path, fp, 0)['from_step'] == 0
  assert json.loads((tmp_path / corpus.FILE).read_text())['sha256'] == fp[
      'sha256']
  assert corpus.track(tmp_path, fp, 8)['from_step'] == 0  # resumed
  with pytest.raises(ValueError, match='cannot resume on other text'):
    corpus.track(tmp_path, other, 8)
  assert corpus.track(tmp_path, other, 0)['sha256'] == other['sha256']
  # A run begun before fingerprints were kept: from the resume on.
  assert corpus.track(tmp_path / 'old', fp, 8)['from_step'] == 8
